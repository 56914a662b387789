"""One Loader per rank: examples/ddp_train.py under torchrun (2 ranks, gloo, on the
CPU), its checker, the per-device default arenas, and, where there are two GPUs,
the binding to one GPU with no context on another."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastpin
from fastpin import _C, _arena, _runtime
from conftest import in_arena, patterned

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "ddp_train.py"
PACKAGE_ROOT = str(Path(fastpin.__file__).resolve().parent.parent)
MiB = 1 << 20

def _gpus() -> int:
    return torch.cuda.device_count() if fastpin.cuda_available() and torch.cuda.is_available() else 0


def gpus(n):
    return lambda fn: pytest.mark.gpu(pytest.mark.skipif(
        _gpus() < n, reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''}")(fn))


two_gpus = gpus(2)


def quiet_env(**extra) -> dict:
    """One thread per library: the ranks share a small machine."""
    path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               FASTPIN_ARENA_BYTES=str(64 * MiB), PYTHONWARNINGS="error", PYTHONPATH=path)
    env.update(extra)
    return env


def torchrun(nproc, *args, timeout=120, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=REPO, env=quiet_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def reports(out: str) -> list:
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
            if line.startswith("ddp_train: {")]


# ---- the example under torchrun -----------------------------------------------------

@pytest.mark.skipif(not (torch.distributed.is_available()
                         and torch.distributed.is_gloo_available()),
                    reason="torch built without gloo")
def test_two_ranks_on_the_cpu_get_exact_data():
    samples, batch = 192, 8
    p = torchrun(2, "--samples", str(samples), "--shape", "3", "16", "16", "--batch-size",
                 str(batch), "--workers", "1", "--compare",
                 CUDA_VISIBLE_DEVICES="")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = reports(p.stdout)
    fast = sorted((r for r in runs if r["mode"] == "fastpin"), key=lambda r: r["rank"])
    other = [r for r in runs if r["mode"] != "fastpin"]
    assert [r["rank"] for r in fast] == [0, 1] and len(other) == 2
    for r in fast + other:
        assert r["world"] == 2 and r["device"] == "cpu"
        assert r["exact"] is True and r["problems"] == []
        assert r["batches"] == samples // 2 // batch
        assert r["gbps"] > 0
    assert all(r["fallbacks"] == 0 and r["numa_node"] == -1 for r in fast)
    assert "ddp_train: fastpin: every sample once: True; models equal across ranks: True" \
        in p.stdout
    assert p.stdout.rstrip().endswith("ddp_train: all exact")


def test_without_torchrun_it_says_how_to_run_it():
    """Bug: python examples/ddp_train.py ended in KeyError: 'RANK' (the torchrun
    line was only in its docstring)."""
    env = {k: v for k, v in quiet_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and p.stdout == ""
    [line] = p.stderr.splitlines()
    assert "Traceback" not in line and "torchrun --nproc_per_node=" in line
    assert "examples/ddp_train.py" in line


def load_example():
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_rank_group(tmp_path):
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["fastpin", "pin_memory"])
def test_the_checker_sees_one_wrong_sample(one_rank_group, mode):
    """The example's check is no formality: one sample off by one fails its batch."""
    ex = load_example()

    class OneWrong(ex.Patterned):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            if i == 37:
                sample["image"].view(-1)[100] += 1
            return sample

    args = SimpleArgs(batch_size=8, workers=0, steps=-1, depth=2, zero_copy=False)
    good = ex.run(mode, args, 0, 1, torch.device("cpu"), ex.Patterned(64, (2, 8, 8)))
    assert good["exact"] and good["batches"] == 8 and sorted(good["seen"]) == list(range(64))
    bad = ex.run(mode, args, 0, 1, torch.device("cpu"), OneWrong(64, (2, 8, 8)))
    assert not bad["exact"] and len(bad["problems"]) == 1 and bad["batches"] == 8


class SimpleArgs:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_zero_copy_rank(one_rank_group):
    ex = load_example()
    args = SimpleArgs(batch_size=4, workers=2, steps=-1, depth=2, zero_copy=True)
    r = ex.run("fastpin", args, 0, 1, torch.device("cpu"), ex.Patterned(32, (4, 4)))
    assert r["exact"] and r["batches"] == 8 and r["fallbacks"] == 0


# ---- one default arena per device ----------------------------------------------------

@pytest.fixture
def pretend_gpus(monkeypatch):
    """fastpin's Python layer believes in GPUs (the C core still registers nothing
    here): device names resolve to ordinals, each with its own default arena."""
    if fastpin.cuda_available():
        pytest.skip("pretends GPUs on a machine with no driver; a real GPU is here")
    monkeypatch.setattr(_arena, "cuda_available", lambda: True)
    monkeypatch.setattr(_arena, "cuda_status",   # what configure(device=...) checks
                        lambda: _arena.CudaStatus("ready", "pretended", 12080, 8, "event"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    saved = dict(_arena._arenas)
    _arena._arenas.clear()
    yield
    _arena._arenas.clear()
    _arena._arenas.update(saved)


def test_device_names(pretend_gpus):
    assert _arena.device_index("cuda:3") == 3
    assert _arena.device_index(torch.device("cuda", 2)) == 2
    assert _arena.device_index(0) == 0
    # "cuda" (what DataLoader's pin thread passes) and None: the current device.
    assert _arena.device_index("cuda") == 1
    assert _arena.device_index(torch.device("cuda")) == 1
    assert _arena.device_index(None) == 1
    assert _arena.device_index("cpu") == 1
    with pytest.raises(ValueError):
        _arena.device_index("cuda:x")
    with pytest.raises(ValueError):
        _arena.device_index(-2)


def test_configured_device_is_the_default(pretend_gpus):
    old = _runtime.settings.device
    try:
        fastpin.configure(device=4)
        assert _arena.device_index(None) == 4
        assert _arena.device_index("cuda") == 1     # still the current device
        with pytest.raises(ValueError):
            fastpin.configure(device=-1)
    finally:
        _runtime.settings.device = old


def test_one_default_arena_per_device(pretend_gpus):
    a0, a1 = fastpin.default_arena(0), fastpin.default_arena("cuda:1")
    assert a0 is not a1
    assert fastpin.default_arena("cuda") is a1 and fastpin.default_arena() is a1
    assert fastpin.default_arena(torch.device("cuda", 0)) is a0
    src = patterned((4096,), torch.int64, 11)
    for device, arena in (("cuda:0", a0), ("cuda:1", a1), ("cuda", a1), (None, a1)):
        out = fastpin.pin_memory({"x": src}, device)
        assert in_arena(out["x"], arena) and torch.equal(out["x"], src)


def test_without_a_gpu_one_arena_serves_every_name():
    if fastpin.cuda_available():
        pytest.skip("a GPU is here")
    a = fastpin.default_arena()
    assert all(fastpin.default_arena(d) is a for d in (None, "cuda", "cuda:1", 3, "cpu"))
    assert _arena.device_index("cuda:5") == -1
    assert a.device == -1


# ---- two GPUs: bound to one, nothing on the other --------------------------------------

BIND_CHECK = """
import ctypes, sys, torch
from torch.utils.data import DataLoader
import fastpin

def contexts():
    cuda = ctypes.CDLL("libcuda.so.1")
    out = []
    for i in range(torch.cuda.device_count()):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
        if active.value:
            out.append(i)
    return out

data = [torch.arange(i * 1000, i * 1000 + 300_000, dtype=torch.int64) for i in range(12)]
dl = DataLoader(data, batch_size=3, num_workers=1, pin_memory=False)
loader = fastpin.Loader(dl, device=DEVICE)
n = 0
for i, batch in enumerate(loader):
    assert batch.device == torch.device("cuda", 1), batch.device
    assert torch.equal(batch.cpu(), torch.stack(data[3 * i:3 * i + 3])), i
    n += 1
assert n == 4
assert loader.arena.device == 1 and loader.arena.registered
pinned = fastpin.pin_memory(data[0], "cuda")          # as DataLoader's pin thread would
assert fastpin.default_arena("cuda").device == 1
print("contexts", contexts())
sys.exit(0 if contexts() == [1] else 3)
"""


@two_gpus
@pytest.mark.parametrize("how", ["index", "current"])
def test_a_loader_on_gpu1_touches_no_other_gpu(how):
    setup = ('DEVICE = "cuda:1"\n' if how == "index"
             else 'torch.cuda.set_device(1)\nDEVICE = "cuda"\n')
    p = subprocess.run([sys.executable, "-c", "import torch\n" + setup + BIND_CHECK],
                       env=quiet_env(PYTHONWARNINGS="default"), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


@two_gpus
def test_an_arena_of_another_gpu_is_refused():
    arena = _C.Arena(4 * MiB, device=0)
    with pytest.raises(ValueError, match="registered with cuda:0"):
        fastpin.Loader([], device="cuda:1", arena=arena)


@two_gpus
def test_two_ranks_on_two_gpus():
    p = torchrun(2, "--samples", "1024", "--shape", "3", "64", "64", "--batch-size", "16",
                 "--workers", "2", "--compare", PYTHONWARNINGS="default")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = reports(p.stdout)
    assert len(runs) == 4
    for r in runs:
        assert r["exact"] and r["device"] == f"cuda:{r['rank']}"
        assert r["contexts"] == [r["rank"]], f"rank {r['rank']}: contexts on {r['contexts']}"


@gpus(1)
def test_one_rank_on_a_gpu():
    p = torchrun(1, "--samples", "256", "--shape", "3", "64", "64", "--batch-size", "16",
                 "--workers", "2", "--compare", PYTHONWARNINGS="default")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = reports(p.stdout)
    assert len(runs) == 2
    for r in runs:
        assert r["exact"] and r["device"] == "cuda:0" and r["batches"] == 16
        assert r["contexts"] == [0]
