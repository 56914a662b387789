"""The README's Python examples run as written.

The convention: an HTML comment line (invisible when the README is rendered)
right before a Python fence claims that the block runs on a machine without a
GPU, as written, and on a GPU machine too:

    <!-- runs on the CPU -->                    the block runs alone
    <!-- runs on the CPU, given torch, dataset -->  it uses names it does not define:
                                                   GIVEN below defines each one listed

Blocks with no marker are fragments (a method of a LightningModule, a line of a
larger script) and are not run; a block that shows one of the calls in MUST_RUN
must be marked. Each marked block runs in a fresh interpreter (this one's python,
importing the fastpin this test imported), in an empty folder, with a timeout.
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

README = Path(__file__).resolve().parent.parent / "README.md"
MARKER = re.compile(r"^\s*<!-- runs on the CPU(?:, given (?P<given>[\w, ]+))? -->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\w*)\s*$")

# What a marked block may be given, by name: small, patterned, quick to load.
GIVEN = {
    "torch": "import torch\n",
    "DataLoader": "from torch.utils.data import DataLoader\n",
    "RandomSampler": "from torch.utils.data import RandomSampler\n",
    # Enough samples for compare()'s 1 + 3 warm-up + 100 timed batches of 256.
    "dataset": """\
        import torch
        from torch.utils.data import TensorDataset
        dataset = TensorDataset(torch.arange(256 * 110 * 8, dtype=torch.float32).reshape(-1, 8),
                                torch.arange(256 * 110))
        """,
}
# The README's examples of these run here.
MUST_RUN = ("fastpin.install()", "fastpin.pin_memory(", "fastpin.Loader(dataloader",
            "zero_copy=False", "bench.compare(")


def blocks() -> list[tuple[int, str, list[str] | None]]:
    """Every fenced Python block of the README: (line of its fence, its code,
    the names it is given, or None where it is not marked to run)."""
    lines = README.read_text().splitlines()
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
                          None if not marker else [n.strip() for n in given.split(",")] if given else []))
        i = end + 1
    return found


MARKED = [(line, code, given) for line, code, given in blocks() if given is not None]


def test_markers_sit_on_python_blocks():
    lines = README.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("<!--") and "runs on the CPU" in line:
            assert MARKER.match(line), f"README.md:{i + 1}: not a marker as this test reads it"
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1])["lang"] == "python", \
                f"README.md:{i + 1}: a marker must come right before a ```python fence"
    for line, _, given in MARKED:
        assert set(given) <= set(GIVEN), f"README.md:{line}: GIVEN has no {set(given) - set(GIVEN)}"


def test_the_examples_that_must_run_are_marked():
    every = blocks()
    for call in MUST_RUN:
        assert any(call in code for _, code, given in every if given is not None), \
            f"no marked README block shows {call}"
        unmarked = [line for line, code, given in every if given is None and call in code]
        assert not unmarked, f"README.md:{unmarked}: a block that shows {call} is not marked"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("line, code, given", MARKED, ids=[f"README.md:{b[0]}" for b in MARKED])
def test_readme_block_runs(line, code, given, tmp_path):
    setup = "".join(textwrap.dedent(GIVEN[name]) for name in given)
    script = tmp_path / f"readme_{line}.py"
    script.write_text(setup + code + "\n")
    env = dict(os.environ, PYTHONPATH=str(Path(fastpin.__file__).parent.parent), MPLBACKEND="agg")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"README.md:{line} failed:\n{script.read_text()}\n{proc.stderr}"
