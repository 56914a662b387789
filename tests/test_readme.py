"""The Python examples of the README and of docs/*.md run as written.

The convention: an HTML comment line (invisible when the page is rendered)
right before a Python fence claims that the block runs as written:

    <!-- runs on the CPU -->                    on a machine without a GPU, and with one
    <!-- runs on the CPU, given torch, dataset -->  it uses names it does not define:
                                                   GIVEN below defines each one listed
    <!-- runs on a GPU -->                      where a GPU is (marked gpu: skipped
                                                   elsewhere); `, given ...` as above

Blocks with no marker are fragments (a method of a LightningModule, a line of a
larger script) and are not run; a block that shows one of the calls in MUST_RUN
must be marked. Each marked block runs in a fresh interpreter (this one's python,
importing the fastpin this test imported), in an empty folder, with a timeout.
A block's `fastpin.bench.compare` must measure what it claims: every path that
can run here runs, none runs out of batches or times too few to mean much.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastpin

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!-- runs on (?P<where>the CPU|a GPU)(?:, given (?P<given>[\w, ]+))? -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\w*)\s*$")

# What a marked block may be given, by name: small, patterned, quick to load.
GIVEN = {
    "torch": "import torch\n",
    "DataLoader": "from torch.utils.data import DataLoader\n",
    "RandomSampler": "from torch.utils.data import RandomSampler\n",
    # 16 batches of 256: far fewer than compare() takes from each path (its warm-up,
    # then at least `batches` and a second), so its example must draw with replacement.
    "dataset": """\
        import torch
        from torch.utils.data import TensorDataset
        dataset = TensorDataset(torch.arange(256 * 16 * 8, dtype=torch.float32).reshape(-1, 8),
                                torch.arange(256 * 16))
        """,
}
# Put before a block that calls fastpin.bench.compare: its results are checked as
# they come back (a loader that runs out is no example to copy).
CHECK_COMPARE = """\
import fastpin.bench as _bench

def _checked_compare(*args, _compare=_bench.compare, **kwargs):
    results = _compare(*args, **kwargs)
    bad = [f"{r.label}: {r.status}, {r.batches} timed: {r.reason}" for r in results.rows
           if not r.unavailable and (not r.ok or r.reason or _bench._too_few(r))]
    assert not bad, "compare() of this example measured too little:\\n" + "\\n".join(bad)
    return results

_bench.compare = _checked_compare
"""
# Examples of these must be marked, and so run here.
MUST_RUN = ("fastpin.install()", "fastpin.pin_memory(", "fastpin.Loader(dataloader",
            "zero_copy=False", "bench.compare(")


def blocks(page: Path = README) -> list[tuple[int, str, list[str] | None, str | None]]:
    """Every fenced Python block of a page: (line of its fence, its code, the
    names it is given or None where it is not marked to run, where it runs)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence or not fence["lang"]:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence["lang"] == "python":
            marker = MARKER.match(lines[i - 1]) if i else None
            given = marker["given"] if marker else None
            found.append((i + 1, textwrap.dedent("\n".join(lines[i + 1:end])),
                          None if not marker else [n.strip() for n in given.split(",")] if given else [],
                          marker["where"] if marker else None))
        i = end + 1
    return found


def every_block() -> list[tuple[str, int, str, list[str] | None, str | None]]:
    return [(page.relative_to(ROOT).as_posix(), *b) for page in PAGES for b in blocks(page)]


MARKED = [b for b in every_block() if b[3] is not None]


def test_markers_sit_on_python_blocks():
    for page in PAGES:
        lines = page.read_text().splitlines()
        name = page.relative_to(ROOT).as_posix()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!--") and "runs on " in line:
                assert MARKER.match(line), f"{name}:{i + 1}: not a marker as this test reads it"
                assert i + 1 < len(lines) and FENCE.match(lines[i + 1])["lang"] == "python", \
                    f"{name}:{i + 1}: a marker must come right before a ```python fence"
    for name, line, _, given, _ in MARKED:
        assert set(given) <= set(GIVEN), f"{name}:{line}: GIVEN has no {set(given) - set(GIVEN)}"


def test_the_examples_that_must_run_are_marked():
    every = every_block()
    for call in MUST_RUN:
        assert any(call in code for _, _, code, given, _ in every if given is not None), \
            f"no marked block of the README or docs/ shows {call}"
        unmarked = [f"{name}:{line}" for name, line, code, given, _ in every
                    if given is None and call in code]
        assert not unmarked, f"{unmarked}: a block that shows {call} is not marked"


def test_the_readme_shows_the_one_line_uses_first():
    # The first screen: what fastpin is, the two commands, and a first example.
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    first = "\n".join(lines[:40])
    assert "make bench" in first and "make test" in first and "fastpin.install()" in first
    for call in ("fastpin.install()", 'fastpin.install(device="cuda")', "fastpin.Loader("):
        assert any(call in code for line, code, given, _ in blocks() if given is not None), call


def _params():
    for name, line, code, given, where in MARKED:
        marks = [pytest.mark.gpu] if where == "a GPU" else []
        yield pytest.param(name, line, code, given, marks=marks, id=f"{name}:{line}")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name, line, code, given", list(_params()))
def test_block_runs(name, line, code, given, tmp_path):
    setup = "".join(textwrap.dedent(GIVEN[g]) for g in given)
    if "bench.compare(" in code:
        setup += CHECK_COMPARE
    script = tmp_path / f"block_{line}.py"
    script.write_text(setup + code + "\n")
    env = dict(os.environ, PYTHONPATH=str(Path(fastpin.__file__).parent.parent), MPLBACKEND="agg")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{name}:{line} failed:\n{script.read_text()}\n{proc.stderr}"
