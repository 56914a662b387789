"""The suite: the dict python -m fastpin.bench builds as it runs (and --json
writes), and its report (report(), also what --from-json prints): the header,
the summary (each workload case's GB/s through the stock path and those the
registry marks for it, and the training table's images/s), then each case's
details."""
from __future__ import annotations

import json
import os
from typing import Optional

from .cases import SUITE
from .paths import PATHS
from .results import LEGEND, Results, ratio, workers_label, wrap


def report(suite: dict) -> str:
    """The whole suite (as main() runs it, or as its --json wrote it) as Markdown."""
    parts = [header(suite["machine"], suite.get("command")), summary(suite)]
    details = [section(suite, name) for name in suite.get("order", [])]
    details = [d for d in details if d]
    if details:
        parts.append("# Details")
        if suite.get("cases"):
            parts.append(wrap(LEGEND))
        left = left_out(suite)
        if left:
            parts.append("\n".join(wrap(f"- {line}", "  ") for line in left))
        parts.extend(details)
    parts.append(not_run(suite))
    return "\n\n".join(p for p in parts if p)


def header(info: dict, command: Optional[str] = None) -> str:
    date = f", {info['date']}" if info.get("date") else ""
    lines = [f"fastpin {info['fastpin']}, torch {info['torch']}, Python {info['python']}, "
             f"{info['cpus']} CPUs, GPU: {info.get('gpu', 'none')}{date}"]
    if command:
        lines.append(f"`{command}`")
    if info["cuda"]["state"] != "ready":
        lines.append(f"No GPU: {info['cuda']['reason']}")
    return "\n".join(lines)


# ---- the summary ------------------------------------------------------------------------

def _summary_paths(group: list) -> list:
    """The stock path of these cases (pin_memory=True, else pageable), then every
    path of the registry marked for the summary that ran in any of them."""
    ran = {r.path for res in group for r in res.rows if r.ok}
    stock = next((p for p in ("pin_memory", "pageable") if p in ran), None)
    rest = [p for p, info in PATHS.items() if info.in_summary and p in ran and p != stock]
    return ([stock] if stock else []) + rest


def _summary_cell(res: Results, path: str, stock: Optional[str]) -> str:
    try:
        row = res[path]
    except KeyError:
        return "-"
    if not row.ok:
        return row.status
    if path == stock or not stock or not res[stock].ok or not res[stock].gbps:
        return f"{row.gbps:.1f}"
    return f"{row.gbps:.1f} ({ratio(row.gbps / res[stock].gbps)})"


def _delivery_table(group: list, nw: int) -> str:
    paths = _summary_paths(group)
    if not paths:
        return ""
    stock = paths[0] if paths[0] in ("pin_memory", "pageable") else None
    where = "the GPU" if any(res.device != "host" for res in group) else "host memory"
    first = (f"GB/s delivered to {where}, {workers_label(nw)}; in brackets, x the stock "
             f"path ({PATHS[stock].label})" if stock else
             f"GB/s delivered to {where}, {workers_label(nw)}")
    head = "| case | " + " | ".join(PATHS[p].heading for p in paths) + " |"
    lines = [wrap(first + "."), "", head, "|---|" + "---:|" * len(paths)]
    for res in group:
        cells = [_summary_cell(res, p, stock) for p in paths]
        lines.append(f"| {res.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _training_table(train: dict) -> str:
    """The training table's images/s, the summary's paths only (the fractions of the
    bound are in the details)."""
    paths = [p for p in train["paths"] if p in PATHS and (p == "pin_memory" or PATHS[p].in_summary)]
    rows = train["rows"]
    several = len({r["workers"] for r in rows}) > 1
    workers = "" if several or not rows else f", {workers_label(rows[0]['workers'])}"
    head = "| training | on the GPU | " + " | ".join(PATHS[p].heading for p in paths) + " |"
    lines = [wrap(f"Training resnet18 (train_model){workers}: images/s, and with the batch "
                  "already on the GPU."), "", head, "|---|---:|" + "---:|" * len(paths)]
    for r in rows:
        what = f"{r['dtype']}, {r['workers']}" if several else r["dtype"]
        cells = [f"{r['paths'][p]['ips']:.0f}" if "ips" in r["paths"].get(p, {}) else "failed"
                 for p in paths]
        lines.append(f"| {what} | {r['bound_ips']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(suite: dict) -> str:
    """The report's opening: per worker count, each workload case's GB/s through
    the summary's paths, and the training table's images/s."""
    groups: dict = {}
    for c in suite.get("cases", []):
        res = Results.from_dict(c)
        if res.ran:
            groups.setdefault(res.workers, []).append(res)
    tables = [_delivery_table(group, nw) for nw, group in groups.items()]
    if "train" in suite:
        tables.append(_training_table(suite["train"]))
    tables = [t for t in tables if t]
    if not tables:
        return ""
    return "# Summary\n\n" + "\n\n".join(tables)


# ---- the details -----------------------------------------------------------------------

def section(suite: dict, name: str) -> str:
    """One case's section; a workload case this version does not know, from its rows."""
    case = SUITE.get(name)
    if case is not None:
        return case.section(suite)
    return "\n\n".join(Results.from_dict(c).markdown(legend=False, left_out=False)
                       for c in suite["cases"] if c["name"] == name)


def left_out(suite: dict) -> list:
    """The paths asked for that could not run here (no GPU, a host target), each
    reason once (main() asks for none of them unless --path names them)."""
    seen: dict = {}
    for c in suite.get("cases", []):
        for line in Results.from_dict(c).left_out():
            seen[line] = True
    return list(seen)


def not_run(suite: dict) -> str:
    lines = []
    for name, why in suite.get("not_run_cases", {}).items():
        lines.append(wrap(f"- {name}: {why}", "  "))
    groups: dict = {}
    for c in suite.get("cases", []):
        res = Results.from_dict(c)
        if not res.ran:
            continue  # a case skipped whole: its section says why
        for r in res.not_run:
            if not r.unavailable:
                groups.setdefault(f"{r.status}: {r.reason}", {}).setdefault(
                    r.label, []).append(res.name)
    for why, paths in groups.items():
        where = "; ".join(f"{label} ({', '.join(dict.fromkeys(cases))})"
                          for label, cases in paths.items())
        lines.append(wrap(f"- {why}: {where}", "  "))
    if not lines:
        return ""
    return "# Not run\n\n" + "\n".join(lines)


def failed(suite: dict) -> bool:
    if suite.get("failed_cases"):
        return True
    return any(r["status"] == "failed" for c in suite.get("cases", []) for r in c["rows"])


def save(suite: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(suite, f, indent=2)
    os.replace(tmp, path)
