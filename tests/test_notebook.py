"""examples/compare_throughput.ipynb runs headless, start to end, in a kernel
that is this interpreter (the venv's python), with small parameters."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import fastpin
from fastpin import bench

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "compare_throughput.ipynb"
SMALL = "IMAGES = 96\nBATCH_SIZE = 16\nWORKERS = 1\nBATCHES = 4\nCOMPUTE_MS = 0.0\n"


def parameters(nb) -> int:
    """The index of the notebook's parameters cell (tagged, as papermill reads it)."""
    [at] = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    return at


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec that starts this very interpreter, found first on JUPYTER_PATH,
    and a kernel environment that imports the fastpin this test imported."""
    spec = tmp_path / "jupyter" / "kernels" / "fastpin-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fastpin test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("PYTHONPATH", str(Path(fastpin.__file__).parent.parent))
    monkeypatch.setenv("MPLBACKEND", "agg")
    return "fastpin-test"


def test_notebook_runs_headless(kernel, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in requirements-dev.txt")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in requirements-dev.txt")
    pytest.importorskip("matplotlib", reason="matplotlib is in requirements-dev.txt")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook without outputs"
    # Papermill-style: the parameters cell, then a cell that overrides it.
    nb.cells.insert(parameters(nb) + 1,
                    nbformat.v4.new_code_cell(SMALL + f"OUT_DIR = {str(tmp_path)!r}\n"))

    # The kernel starts in the notebook's folder, as Jupyter and `make notebook` start it.
    before = sorted(os.listdir(NOTEBOOK.parent))
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()   # raises CellExecutionError, with the traceback, if a cell fails
    finally:
        left = sorted(set(os.listdir(NOTEBOOK.parent)) - set(before))
        for name in left:
            if name.startswith(NOTEBOOK.stem):   # what the notebook wrote, nothing else
                (NOTEBOOK.parent / name).unlink()
    assert not left, f"the notebook wrote {left} into the source tree, not OUT_DIR"

    results = bench.Results.from_dict(json.loads((tmp_path / "compare_throughput.json").read_text()))
    rows = {r.path: r for r in results.rows}
    assert list(rows) == list(bench.PATHS)
    for path in ("pageable", "fastpin_pin", "loader_host", "zero_copy"):
        assert rows[path].ok, (path, rows[path].reason)
        assert rows[path].batches >= 4   # at least BATCHES, and a second of them
        assert rows[path].batch_mb * bench.MB == 16 * (3 * 224 * 224 + 8)
    if not fastpin.cuda_available():
        for path in ("pin_memory", "prefetcher", "loader_cuda"):
            assert rows[path].status == "skipped"
            assert fastpin.cuda_status().reason in rows[path].reason
    png = tmp_path / "compare_throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any("| Loader(device=None) |" in m for m in markdown), "the results table is shown"
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is shown"
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert f"fastpin {fastpin.__version__}" in text and "fastest here:" in text


def test_notebook_default_workers_fit_the_machine():
    """torch warns when a DataLoader asks for more workers than the CPUs this process
    may use (2 on the dev machine): the default WORKERS comes from them."""
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in requirements-dev.txt")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    names: dict = {}
    exec(nb.cells[parameters(nb)].source, names)
    assert 1 <= names["WORKERS"] <= max(1, len(os.sched_getaffinity(0)) - 1)
