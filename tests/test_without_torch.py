"""fastpin where torch is not installed: pin_memory of NumPy batches and
cuda_status work; collate, Loader, install and the benchmark say that they need
PyTorch and how to install it, instead of a bare ModuleNotFoundError; and
`python -m fastpin.bench --help` / `--list` still work.

Each check runs in a child Python. Where torch is installed (make test), the
child blocks its import (sys.modules["torch"] = None: `import torch` then
raises ModuleNotFoundError, as it does where torch is missing); where it is
not (make test-pythons), the child is simply that Python."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fastpin

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def child(code: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(fastpin.__file__).parent.parent))
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def bench_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """python -m fastpin.bench ARGS, without torch."""
    return child("import runpy; sys.argv[0] = 'fastpin.bench'\n"
                 "runpy.run_module('fastpin.bench', run_name='__main__', alter_sys=True)",
                 *args, cwd=cwd)


def says_torch_is_needed(text: str, what: str) -> bool:
    return (f"{what} needs PyTorch" in text and "pip install torch" in text
            and "https://pytorch.org/get-started/locally/" in text)


def test_numpy_batches_pin_without_torch(tmp_path):
    r = child("""
import numpy as np
import fastpin
rng = np.random.default_rng(5)
batch = {"x": rng.integers(1, 255, size=(4, 3, 8, 8), dtype=np.uint8),
         "y": (rng.standard_normal(7), "label", 3)}
out = fastpin.pin_memory(batch)
assert type(out["y"]) is tuple and out["y"][1:] == ("label", 3)
assert np.array_equal(out["x"], batch["x"]) and np.array_equal(out["y"][0], batch["y"][0])
assert out["x"].ctypes.data != batch["x"].ctypes.data
print("state", fastpin.cuda_status().state, fastpin.stats()["batches"])
""", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "state " in r.stdout and r.stdout.strip().endswith(" 1")


def test_configure_device_without_torch(tmp_path):
    """configure(device=...) takes the Loader's CUDA names with torch absent
    (no torch.device can exist then), and refuses a GPU this machine lacks."""
    r = child("""
import fastpin
for device in ("cuda:0", 0, "cuda"):
    try:
        fastpin.configure(device=device)
    except ValueError as e:
        assert not fastpin.cuda_available() and "no usable CUDA GPU here" in str(e), e
    else:
        assert fastpin.cuda_available(), device
try:
    fastpin.configure(device="cpu")
except ValueError as e:
    print("said:", e)
print("torch", sys.modules.get("torch"))
""", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "said: device must be a CUDA device ('cuda', 'cuda:N'" in r.stdout
    assert r.stdout.strip().endswith("torch None")


def test_collate_loader_install_without_torch_say_what_to_install(tmp_path):
    # Bug: a bare "ModuleNotFoundError: No module named 'torch'", no hint.
    r = child("""
import fastpin
for what, call in [("fastpin.collate", lambda: fastpin.collate),
                   ("fastpin.Loader", lambda: fastpin.Loader([1, 2])),
                   ("fastpin.install", fastpin.install)]:
    try:
        call()
    except ModuleNotFoundError as e:
        assert e.name == "torch", e.name
        print("said:", e)
    else:
        raise AssertionError(what + " ran without torch")
try:
    import fastpin.bench
except ModuleNotFoundError as e:
    print("said:", e)
""", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith("said:")]
    assert len(said) == 4
    for line, what in zip(said, ["fastpin.collate", "fastpin.Loader", "fastpin.install",
                                 "fastpin.bench"]):
        assert says_torch_is_needed(line, what), line


def test_bench_help_and_list_work_without_torch(tmp_path):
    # Bug: --help and --list exited 1 with a raw ModuleNotFoundError traceback.
    r = bench_cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m fastpin.bench" in r.stdout and "--device" in r.stdout
    r = bench_cli("--list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("pin_sizes", "loader_images", "images_u8", "video", "zero_copy"):
        assert name in r.stdout


def test_bench_run_without_torch_says_what_to_install(tmp_path):
    # Bug: --quick exited 1 with a raw ModuleNotFoundError traceback.
    r = bench_cli("--quick", cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert says_torch_is_needed(r.stderr, "the benchmark"), r.stderr
