"""The sdist and the wheel as a user gets them: built from the clone's files,
each installed into a fresh virtual environment of this Python (no torch
there), and a smoke test run in it from outside the source tree: import,
pin_memory of NumPy batches, cuda_status, `python -m fastpin.bench --help`.

Building needs setuptools >= 77, wheel and numpy in this Python (make test's
venv has them) and runs offline. Each fresh venv gets numpy (and, for the
sdist, setuptools and wheel) from pip's configured indexes: where none can
be reached, the test is skipped and says so. Needs no torch; about a minute."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)

SMOKE = r"""
import subprocess, sys
import numpy as np
import fastpin
assert fastpin.__file__.startswith(sys.prefix), fastpin.__file__   # the installed copy
rng = np.random.default_rng(11)
batch = {"image": rng.integers(1, 255, size=(8, 3, 32, 32), dtype=np.uint8),
         "pair": (rng.standard_normal((4, 5)).astype(np.float32), rng.integers(1, 9, 6)),
         "name": "batch", "step": 7}
out = fastpin.pin_memory(batch)
assert set(out) == set(batch) and type(out["pair"]) is tuple
assert out["name"] == "batch" and out["step"] == 7
for a, b in [(out["image"], batch["image"]), *zip(out["pair"], batch["pair"])]:
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert a.ctypes.data != b.ctypes.data
status = fastpin.cuda_status()
assert status.state and (status.state == "ready" or status.reason), status
try:
    fastpin.Loader([batch])
except ModuleNotFoundError as e:
    assert "needs PyTorch" in str(e), e
help = subprocess.run([sys.executable, "-m", "fastpin.bench", "--help"], capture_output=True,
                      text=True)
assert help.returncode == 0 and "usage: python -m fastpin.bench" in help.stdout, help.stderr
print("smoke ok", fastpin.__version__, status.state, fastpin.stats()["batches"])
"""


def run(cmd, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def source_copy(dest: Path) -> Path:
    """The files a clone would have (tracked, plus new ones git does not ignore)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git clone of fastpin (and git) to know its files")
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                ROOT).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def fresh_venv(path: Path, *requirements: str) -> Path:
    """A new venv of this Python with `requirements` from pip's indexes, or a skip."""
    run([sys.executable, "-m", "venv", path], path.parent, timeout=300)
    python = path / "bin" / "python"
    r = subprocess.run([python, "-m", "pip", "install", "-q", "--retries", "1", "--timeout",
                        "30", *requirements], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"could not install {' '.join(requirements)} into a fresh venv "
                    f"(no index reachable?): {r.stderr.strip()[-500:]}")
    return python


def smoke(python: Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = run([python, "-c", SMOKE], cwd, env=env)
    assert "smoke ok 0.1.0" in r.stdout and r.stdout.strip().endswith(" 1"), r.stdout
    r = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=cwd)
    assert r.returncode != 0, "the fresh venv has torch: the smoke test did not run without it"
    return r.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict:
    for module, why in [("setuptools", "setuptools>=77"), ("wheel", "wheel"), ("numpy", "numpy")]:
        pytest.importorskip(module, reason=f"building fastpin needs {why}")
    import setuptools
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building fastpin needs setuptools>=77, this Python has "
                    f"{setuptools.__version__}")
    tmp = tmp_path_factory.mktemp("packaging")
    src = source_copy(tmp / "src")
    out = tmp / "dist"
    out.mkdir()
    run([sys.executable, "-c",
         f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"], src)
    [sdist] = out.glob("fastpin-*.tar.gz")
    # The wheel from the sdist, as pip builds it for a user: the sdist holds all it needs.
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", out, sdist], tmp)
    [wheel] = out.glob("fastpin-*.whl")
    return {"tmp": tmp, "sdist": sdist, "wheel": wheel}


def test_sdist_holds_the_sources_and_no_half_test_suite(dists):
    # Bug: the sdist shipped tests/test_*.py without tests/conftest.py, so they
    # failed with "No module named 'conftest'". It ships no tests now.
    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for c in ("arena.c", "copier.c", "cuda.c", "dlpack.c", "error.c", "lease.c", "module.c",
              "prim.c", "repair.c", "stage.c", "tlsf.c", "fastpin.h", "arena_internal.h",
              "dlpack.h", "streaming.h", "batch.c", "module.h", "arena_type.c", "block_type.c",
              "record.c", "block_record.c"):
        assert f"csrc/{c}" in names, c
    for f in ("fastpin/__init__.py", "fastpin/bench/__init__.py", "fastpin/bench/__main__.py",
              "fastpin/_C.pyi", "fastpin/py.typed", "LICENSE", "README.md", "pyproject.toml",
              "setup.py"):
        assert f in names, f
    tests = sorted(n for n in names if n.startswith("tests/"))
    assert not tests or "tests/conftest.py" in tests, tests


def test_wheel_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(meta).decode()
    assert any(n.startswith("fastpin/_C.") and n.endswith(".so") for n in names)
    assert "fastpin/py.typed" in names and "fastpin/_C.pyi" in names
    assert not [n for n in names if n.startswith("tests/")]
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Requires-Python: >=3.10" in metadata
    for minor in (10, 11, 12, 13):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}" in metadata
    assert "Requires-Dist: numpy" in metadata and "Requires-Dist: torch" not in metadata


def test_wheel_holds_every_module_of_the_tree(dists):
    # The venv of make test imports fastpin editable, from the tree: a module or
    # subpackage the wheel leaves out would still import there. The wheel must
    # hold every Python file and stub under fastpin/ that the clone has.
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fastpin").rglob("*")
            if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts}
    with zipfile.ZipFile(dists["wheel"]) as whl:
        shipped = set(whl.namelist())
    assert tree and not sorted(tree - shipped), sorted(tree - shipped)


def test_sdist_installs_into_a_fresh_venv_and_runs(dists):
    tmp = dists["tmp"]
    python = fresh_venv(tmp / "venv-sdist", "numpy", "setuptools>=77", "wheel")
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
         dists["sdist"]], tmp)
    smoke(python, tmp)


def test_wheel_installs_into_a_fresh_venv_and_runs(dists):
    tmp = dists["tmp"]
    python = fresh_venv(tmp / "venv-wheel", "numpy")
    run([python, "-m", "pip", "install", "-q", "--no-index", dists["wheel"]], tmp)
    smoke(python, tmp)


def fastpin_file() -> str:
    """The fastpin these tests import (the installed copy, or an in-place build)."""
    import fastpin
    return fastpin.__file__


def test_the_pytest_config_works_without_pytest_timeout(tmp_path):
    # Bug: `timeout = 300` with filterwarnings = error stopped pytest with an
    # INTERNALERROR (exit 3) where pytest-timeout was not installed.
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("needs the clone's pyproject.toml")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:cacheprovider",
                        "-q", "-c", ROOT / "pyproject.toml", "--rootdir", ROOT,
                        ROOT / "tests" / "test_logging.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(Path(fastpin_file()).parent.parent)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "INTERNALERROR" not in r.stdout + r.stderr and " passed" in r.stdout
    assert " failed" not in r.stdout and " error" not in r.stdout
