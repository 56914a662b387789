"""The suite: the dict python -m fastpin.bench builds as it runs (and --json
writes), and its Markdown report (report(), also what --from-json prints)."""
from __future__ import annotations

import json
import os
from typing import Optional

from .cases import SUITE
from .results import Results


def report(suite: dict) -> str:
    """The whole suite (as main() runs it, or as its --json wrote it) as Markdown."""
    parts = [header(suite["machine"], suite.get("command"))]
    for name in suite.get("order", []):
        parts.append(section(suite, name))
    parts.append(not_run(suite))
    return "\n\n".join(p for p in parts if p)


def header(info: dict, command: Optional[str] = None) -> str:
    lines = [f"fastpin {info['fastpin']}, torch {info['torch']}, Python {info['python']}, "
             f"{info['cpus']} CPUs, GPU: {info.get('gpu', 'none')}"]
    if command:
        lines.append(f"`{command}`, {info.get('date', '')}".rstrip(", "))
    if info["cuda"]["state"] != "ready":
        lines.append(f"No GPU path: {info['cuda']['reason']}")
    return "\n".join(lines)


def section(suite: dict, name: str) -> str:
    """One case's section; a workload case this version does not know, from its rows."""
    case = SUITE.get(name)
    if case is not None:
        return case.section(suite)
    return "\n\n".join(Results.from_dict(c).markdown() for c in suite["cases"]
                       if c["name"] == name)


def not_run(suite: dict) -> str:
    lines = [f"- {name}: {why}" for name, why in suite.get("not_run_cases", {}).items()]
    rows = []
    for c in suite.get("cases", []):
        res = Results.from_dict(c)
        rows += [(res, r) for r in res.not_run]
    groups: dict = {}
    for res, r in rows:
        groups.setdefault(f"{r.status}: {r.reason}", {}).setdefault(r.label, []).append(res.name)
    for why, paths in groups.items():
        where = "; ".join(f"{label} ({', '.join(dict.fromkeys(cases))})"
                          for label, cases in paths.items())
        lines.append(f"- {why}: {where}")
    if not lines:
        return ""
    return "## Not run\n\n" + "\n".join(lines)


def failed(suite: dict) -> bool:
    if suite.get("failed_cases"):
        return True
    return any(r["status"] == "failed" for c in suite.get("cases", []) for r in c["rows"])


def save(suite: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(suite, f, indent=2)
    os.replace(tmp, path)
