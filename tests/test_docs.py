"""The documents: what they say runs, runs; what they must not say, they do not.

- benchmarks/RESULTS.md: each shell block carries a marker on the line before it,
  `<!-- runs on the CPU -->` (optionally `, in CI with: FLAGS`) or `<!-- needs a
  GPU -->`. Every CPU block runs here as written, from the clone's root, first on
  PATH a venv with fastpin installed as the quick start installs it (editable:
  tests/editable_venv.py), FLAGS appended to each `python` command to keep it
  short. Every GPU block's `python` commands run with `--help` appended, which
  parses every option shown before it prints: a renamed option or a removed
  script fails here.
- README.md, docs/ and benchmarks/ name no paths of the machines they were
  written on and say nothing of how the work on fastpin was organised.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from editable_venv import installed_venv

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MARKER = re.compile(r"^<!-- (?:(?P<cpu>runs on the CPU)(?:, in CI with: (?P<flags>[^>]*?))?"
                    r"|(?P<gpu>needs a GPU)) -->\s*$")
FORBIDDEN = [
    (re.compile(r"/opt/|/root/"), "a path of a development machine"),
    (re.compile(r"\bsession\s*\d+|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|"
                r"ninth|tenth|\d+(st|nd|rd|th))\s+session", re.I), "a numbered session"),
    (re.compile(r"\bissue\s+\d+|#\d+", re.I), "an issue number"),
]


def documents() -> list[Path]:
    """The files the repository holds there: what git tracks (a clone's), not
    what a run left beside them (__pycache__, outputs)."""
    tracked = subprocess.run(["git", "ls-files", "README.md", "docs", "benchmarks"], cwd=ROOT,
                             capture_output=True, text=True)
    if tracked.returncode == 0:
        files = [ROOT / name for name in tracked.stdout.splitlines()]
    else:  # not a git checkout (an unpacked sdist)
        files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*")),
                 *sorted((ROOT / "benchmarks").rglob("*"))]
        files = [f for f in files if "__pycache__" not in f.parts]
    return [f for f in files if f.is_file() and f.suffix not in (".png", ".jpg", ".svg", ".pyc")]


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documents_name_no_machine_paths_sessions_or_issues(path):
    text = path.read_text(errors="replace")
    found = [f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {what}: "
             f"{m.group(0)!r}" for pattern, what in FORBIDDEN for m in pattern.finditer(text)]
    assert not found, "\n".join(found)


def blocks() -> list[tuple[int, str, str, str]]:
    """RESULTS.md's fenced blocks: (line, 'cpu' or 'gpu' or '' where unmarked, CI
    flags, commands), each command on one line (continuations joined)."""
    lines = RESULTS.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[i - 1]) if i else None
        kind = "" if not marker else "cpu" if marker["cpu"] else "gpu"
        flags = (marker["flags"] or "") if marker else ""
        found.append((i + 1, kind, flags, "\n".join(lines[i + 1:end]).replace("\\\n", " ")))
        i = end + 1
    return found


BLOCKS = blocks()


def test_results_blocks_are_marked():
    unmarked = [line for line, kind, _, _ in BLOCKS if not kind]
    assert not unmarked, f"benchmarks/RESULTS.md: blocks at lines {unmarked} have no marker"
    assert any(kind == "cpu" for _, kind, _, _ in BLOCKS)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    return installed_venv(tmp_path_factory.mktemp("docs"))


def shell(commands: str, timeout: float, venv: Path) -> subprocess.CompletedProcess:
    """Run as a user of the venv would, from the clone's root: the venv's bin/
    first on PATH, and no PYTHONPATH (the venv must find fastpin itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env["MPLBACKEND"] = "agg"
    return subprocess.run(["bash", "-ec", commands], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def runs_python(words: list) -> bool:
    """Whether a command line runs python: its first word after any NAME=VALUE
    settings (or after `env` and them)."""
    setting = re.compile(r"env|[A-Za-z_]\w*=.*")
    command = next((w for w in words if not setting.fullmatch(w)), "")
    return re.fullmatch(r"python3?", command) is not None


def with_flags(commands: str, flags: str) -> str:
    """Each python command of the block, with `flags` appended."""
    out = []
    for line in commands.splitlines():
        words = shlex.split(line) if line.strip() else []
        out.append(f"{line} {flags}" if runs_python(words) and flags else line)
    return "\n".join(out)


CPU = [pytest.param(cmd, flags, id=f"RESULTS.md:{line}")
       for line, kind, flags, cmd in BLOCKS if kind == "cpu"]
GPU = [pytest.param(cmd, id=f"RESULTS.md:{line}") for line, kind, _, cmd in BLOCKS if kind == "gpu"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commands, flags", CPU)
def test_cpu_commands_of_results_run(commands, flags, venv):
    r = shell(with_flags(commands, flags), timeout=240, venv=venv)
    assert r.returncode == 0, f"{with_flags(commands, flags)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("commands", GPU)
def test_gpu_commands_of_results_take_their_options(commands, venv):
    for line in commands.splitlines():
        words = shlex.split(line)
        if runs_python(words):
            r = shell(f"{line} --help", timeout=120, venv=venv)
            assert r.returncode == 0 and "usage" in r.stdout.lower(), \
                f"{line} --help\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        else:
            named = [w for w in words if w.startswith("benchmarks/")]
            assert named and all((ROOT / w).exists() for w in named), line
