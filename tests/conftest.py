"""Shared fixtures and helpers for fastpin's tests.

Never test on zeros: `patterned` fills every element from a seeded generator,
so values differ per element and per seed, and a stale or unwritten buffer
shows. Compare with `assert_same`, which checks bytes, so NaN payloads and
exotic dtypes (float8, float4, complex32) compare exactly.
"""
from __future__ import annotations

import gc
import os
import zlib

import numpy as np
import pytest

try:
    import torch
except ModuleNotFoundError:
    # The tests that need no torch (make test-pythons) import this file too:
    # a stand-in of whose Tensor and dtype nothing is an instance.
    import types
    torch = types.SimpleNamespace(Tensor=type("Tensor", (), {}), dtype=type("dtype", (), {}))

import fastpin
from fastpin import _C


def pytest_configure(config):
    # torch says so once per process when a complex32 tensor is made; the
    # suite makes them on purpose.
    config.addinivalue_line(
        "filterwarnings", "ignore:ComplexHalf support is experimental:UserWarning")


def pytest_collection_modifyitems(config, items):
    if fastpin.cuda_available():
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {fastpin.cuda_status().reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def gpu(fn):
    """Marks a test that needs a CUDA GPU (skipped where none is usable)."""
    return pytest.mark.gpu(fn)


def open_cuda() -> None:
    """Where a GPU is usable, open what the CUDA driver keeps open for the
    process (device files, its pipe and eventfds, the context) and what
    fastpin's first pinned copy adds: tests that count descriptors left behind
    count from after them."""
    if not (fastpin.cuda_available() and torch.cuda.is_available()):
        return
    torch.cuda.init()
    x = fastpin.pin_memory(torch.arange(1024, dtype=torch.int32))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = x.to("cuda", non_blocking=True)
    torch.cuda.Event(blocking=True).record(stream)
    stream.synchronize()
    del x, y


# ---- patterned data ------------------------------------------------------

def _rng(seed, *salt) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(repr(salt).encode())])


def _pattern_bytes(nbytes: int, seed: int, salt) -> np.ndarray:
    return _rng(seed, salt).integers(0, 256, size=nbytes, dtype=np.uint8)


def patterned(shape, dtype, seed: int = 0):
    """A tensor (torch dtype) or array (NumPy dtype) of `shape` whose elements
    differ per element and per seed, and never all zero. Built from random
    bytes viewed as the dtype; bool gets a random mix of True and False, and
    every element has a non-zero byte, so a zeroed buffer never matches."""
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    numel = int(np.prod(shape, dtype=np.int64))
    if isinstance(dtype, torch.dtype):
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        raw = _pattern_bytes(numel * itemsize, seed, str(dtype)).reshape(numel, itemsize)
        if dtype == torch.bool:
            raw = raw & 1
            if numel > 1:
                raw[0], raw[1] = 1, 0      # both values present
            elif numel == 1:
                raw[0] = 1
        else:
            raw[:, 0] |= 1                 # every element has a non-zero byte
        flat = torch.from_numpy(raw.reshape(-1).copy())
        return flat.view(dtype).reshape(shape)
    dtype = np.dtype(dtype)
    raw = _pattern_bytes(numel * dtype.itemsize, seed, dtype.str).reshape(numel, dtype.itemsize)
    if dtype == np.bool_:
        raw = raw & 1
        if numel:
            raw[0] = 1
    elif dtype.itemsize:
        raw[:, 0] |= 1
    return raw.reshape(-1).view(dtype).reshape(shape)


_cycles_per_ms = None


def sleep_cycles(ms) -> int:
    """Cycles of torch.cuda._sleep that take about `ms` on this GPU (measured
    once): the kernel the GPU tests queue to keep a stream busy."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms = 50_000_000 / start.elapsed_time(end)
    return int(_cycles_per_ms * ms)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's elements in logical (row-major) order."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return b""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(out, ref):
    """`out` is a copy of `ref`: same type, dtype, shape, and the same bits;
    dicts, lists and tuples of them the same type and keys, leaf by leaf."""
    if isinstance(ref, (dict, list, tuple)):
        assert type(out) is type(ref), type(out)
        if isinstance(ref, dict):
            assert list(out) == list(ref)
            out, ref = list(out.values()), list(ref.values())
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            assert_same(o, r)
    elif isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor), type(out)
        assert out.dtype == ref.dtype
        assert out.shape == ref.shape
        assert out.device == ref.device
        assert tensor_bytes(out) == tensor_bytes(ref)
    elif isinstance(ref, np.ndarray):
        assert type(out) is np.ndarray, type(out)
        assert out.dtype == ref.dtype
        assert out.shape == ref.shape
        assert out.tobytes() == ref.tobytes()
    else:
        raise TypeError(f"assert_same on {type(ref)}")


def shares_memory(a, b) -> bool:
    """True when two tensors/arrays overlap in memory."""
    def span(x):
        if isinstance(x, torch.Tensor):
            start = x.data_ptr()
            size = x.untyped_storage().nbytes()
            return start, start + max(size, 1)
        lo, hi = np.byte_bounds(x) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(x)
        return lo, max(hi, lo + 1)
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def in_arena(x, arena) -> bool:
    """True when the data of tensor/array `x` lies inside `arena`'s region (a
    self-sizing default arena's: one of its segments)."""
    ptr = x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data
    return any(a.base <= ptr < a.base + a.capacity for a in getattr(arena, "segments", (arena,)))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def process_state(pid: int) -> str:
    """A process's state letter in /proc ("Z": exited, not yet reaped), or
    "gone" where there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def settle():
    """Collect garbage so dropped blocks go back to their arenas (blocks held
    by reference cycles, or by a traceback an exception left behind)."""
    gc.collect()


# ---- fixtures -------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _freeze_imports():
    """Move what torch, NumPy and pytest made at import into the permanent
    generation, so the many gc.collect() calls stay cheap."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def arena():
    """A private 16 MiB arena in ordinary memory; checked valid and empty after the test."""
    a = _C.Arena(16 << 20, cuda=False)
    yield a
    assert a.is_valid()


@pytest.fixture
def small_arena():
    """A private 64 KiB arena, for tests of what happens when it is full."""
    a = _C.Arena(64 << 10, cuda=False)
    yield a
    assert a.is_valid()


@pytest.fixture
def accelerator(monkeypatch):
    """Make DataLoader pin where there is no GPU.

    dataloader.py pins only when `torch.accelerator.is_available()` (and warns
    otherwise, which filterwarnings=error turns into a failure); it names the
    pin device from `current_accelerator()`, hands the pin thread
    `current_device_index()`, and the thread calls `set_device_index()` on it.
    Those four are all it asks of the accelerator; everything else the pin
    thread does is the pin function itself, which fastpin replaces. On a
    machine with a GPU the real ones are used."""
    threads = torch.get_num_threads()       # the pin thread sets 1 for the process
    if not fastpin.cuda_available():
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda check_available=False: torch.device("cuda"))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    yield
    torch.set_num_threads(threads)


def run_threads(target, n: int, timeout: float = 300) -> None:
    """Run target(t) for t in range(n), each in its own thread, at once; fail if
    one hangs past `timeout` or raises (the first error is re-raised here)."""
    import threading

    errors: list = []

    def guarded(t: int) -> None:
        try:
            target(t)
        except BaseException as e:  # noqa: BLE001 - reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors[0]


def workers_gone(workers, timeout: float = 10.0) -> bool:
    """Whether DataLoader worker processes `workers` are gone within `timeout`:
    a worker that did not leave when told is terminated (SIGTERM) by the
    iterator's shutdown, which does not wait for it to die."""
    import time

    deadline = time.monotonic() + timeout
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    return not any(w.is_alive() for w in workers)


def children_gone(timeout: float = 10.0) -> list:
    """This process's multiprocessing children still alive after `timeout`
    (active_children() also reaps those that died)."""
    import multiprocessing
    import time

    deadline = time.monotonic() + timeout
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return multiprocessing.active_children()


# Appended to a script by exits_of_forked_runs: each child runs `{run}()`, then
# falls off the end of the script, as a script ends.
_FORKED_RUNS = """
codes = []
for run in range(int(sys.argv[1])):
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        {run}()
        break  # and on to the end of the script: the interpreter exits
    codes.append(os.waitstatus_to_exitcode(os.wait()[1]))
else:
    print("CODES", *codes)
"""


def exits_of_forked_runs(script: str, run: str, runs: int, timeout: float = 550) -> tuple:
    """Run `script` (which imports os and sys and defines the function named
    `run`) in a fresh interpreter that finds this fastpin, and fork `runs`
    children from it, each calling run() and then exiting as a script does:
    torch is imported once, so many runs are affordable. (The children's exit
    codes as strings, the interpreter's stderr's end.)"""
    import subprocess
    import sys
    import tempfile

    home = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
    env = dict(os.environ, PYTHONPATH=home + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script + _FORKED_RUNS.format(run=run), str(runs)],
                          cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True,
                          timeout=timeout)
    codes = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("CODES")]
    assert proc.returncode == 0 and codes, proc.stderr[-4000:]
    return codes[0], proc.stderr[-4000:]
