"""Lifetimes: thousands of produce/consume/drop cycles with RSS and arena use
stable, the producer dropped before the consumer, many threads pinning at
once, the copy pool resized under load, fork, and interpreter exit."""
from __future__ import annotations

import collections
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C
from conftest import assert_same, in_arena, patterned, rss_bytes, settle, tensor_bytes

ITERATIONS = 10_000
WARMUP = 1_000
RSS_SLACK = 16 << 20      # a leak check, not a measurement
FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"


class Batches:
    """Cheap batches whose every element changes with the iteration number:
    fixed random bases XOR-ed with a per-iteration mask (never all zero)."""

    def __init__(self, seed):
        self.t = patterned((4096,), torch.int64, seed)                  # 32 KiB
        self.v = patterned((64, 48), torch.int32, seed + 1)             # sliced below
        self.a = patterned((3000,), np.uint16, seed + 2)
        self.seed = seed

    def make(self, i):
        mask = (i + 1) * 0x9E3779B1 + self.seed
        return {
            "t": self.t ^ mask,
            "v": (self.v ^ (mask & 0x7FFFFFFF))[::2, 1::3],             # non-contiguous
            "a": self.a ^ np.uint16(mask & 0xFFFF | 1),
            "meta": ("label", i),
        }

    @staticmethod
    def check(out, ref):
        assert_same(out["t"], ref["t"])
        assert_same(out["v"], ref["v"])
        assert_same(out["a"], ref["a"])
        assert out["meta"] == ref["meta"]


def _loop(step, iterations=ITERATIONS):
    """Runs step(i) `iterations` times; returns RSS growth after warm-up."""
    for i in range(WARMUP):
        step(i)
    settle()
    rss_warm = rss_bytes()
    for i in range(WARMUP, iterations):
        step(i)
    settle()
    return rss_bytes() - rss_warm


def test_pin_and_drop_loop():
    arena = fastpin.default_arena()
    gen = Batches(1)
    in_use = arena.stats()["bytes_in_use"]

    def step(i):
        ref = gen.make(i)
        out = fastpin.pin_memory(ref)
        Batches.check(out, ref)
        assert in_arena(out["t"], arena)

    growth = _loop(step)
    assert growth < RSS_SLACK, f"RSS grew {growth} bytes over {ITERATIONS - WARMUP} batches"
    s = arena.stats()
    assert s["bytes_in_use"] == in_use
    assert s["bytes_pending"] == 0


def test_sliding_window_loop(arena):
    """A few batches stay alive while new ones are pinned: a block in use is
    never handed out again."""
    gen = Batches(2)
    window = collections.deque()

    def step(i):
        ref = gen.make(i)
        out = fastpin.pin_memory(ref, arena=arena)
        Batches.check(out, ref)
        window.append((out, ref))
        if len(window) > 4:
            old_out, old_ref = window.popleft()
            Batches.check(old_out, old_ref)       # untouched by the 4 batches since

    growth = _loop(step)
    assert growth < RSS_SLACK
    assert arena.stats()["blocks_in_use"] == 4
    for out, ref in window:
        Batches.check(out, ref)
    del out, ref
    window.clear()
    s = arena.stats()
    assert s["bytes_in_use"] == 0 and s["blocks_in_use"] == 0
    assert s["high_water"] <= 5 * 128 * 1024   # five live batches at most, rounded


def test_producer_dropped_first_loop(arena):
    """Block -> capsule/producer -> torch or NumPy; the Block is dropped before
    the data is read, and the consumer alone keeps it alive."""
    base = patterned((2048,), torch.int32, 3)

    def step(i):
        src = base ^ ((i + 1) * 0x01000193)
        block, _ = arena.pin([(src.data_ptr(), src.numel() * 4)], 1)
        kind = i % 3
        if kind == 0:
            out = torch.from_dlpack(block.dlpack(0, [32, 64], [64, 1], 0, 32))
        elif kind == 1:
            out = torch.from_dlpack(block.dlpack(0, [2048], [1], 0, 32, version=1))
        else:
            out = np.from_dlpack(block)
        del block
        if kind == 2:
            assert out.tobytes() == tensor_bytes(src)
        else:
            assert tensor_bytes(out) == tensor_bytes(src)

    growth = _loop(step)
    assert growth < RSS_SLACK
    s = arena.stats()
    assert s["bytes_in_use"] == 0 and s["blocks_in_use"] == 0
    assert s["allocs"] == ITERATIONS


def test_many_threads_pin_at_once():
    n_threads, iterations = 8, 300
    errors = []
    start = threading.Barrier(n_threads)

    def worker(tid):
        try:
            gen = Batches(100 + tid)
            big = patterned((40_000,), torch.int64, 200 + tid)     # 320 KiB: the pool
            start.wait()
            for i in range(iterations):
                ref = gen.make(i)
                ref["big"] = big ^ (tid << 20 | i)
                out = fastpin.pin_memory(ref)
                Batches.check(out, ref)
                assert_same(out["big"], ref["big"])
        except BaseException as e:  # reported below, with the thread's id
            errors.append((tid, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert fastpin.default_arena().is_valid()


def test_set_threads_while_pinning():
    stop = threading.Event()
    errors = []
    sizes = []

    def pinner(tid):
        try:
            base = patterned((100_000,), torch.int32, 300 + tid)         # 400 KiB
            for i in range(150):
                src = base ^ (tid << 16 | i)
                out = fastpin.pin_memory([src, src[::3]])
                assert_same(out[0], src)
                assert_same(out[1], src[::3])
        except BaseException as e:
            errors.append((tid, repr(e)))

    def resizer():
        n = 0
        while not stop.wait(0.002):            # pacing only; nothing is timed
            _C.set_threads(n % 5)               # 0 = the default
            sizes.append(_C.get_threads())
            n += 1

    pinners = [threading.Thread(target=pinner, args=(t,)) for t in range(4)]
    r = threading.Thread(target=resizer)
    r.start()
    for t in pinners:
        t.start()
    for t in pinners:
        t.join()
    stop.set()
    r.join()
    _C.set_threads(0)
    assert not errors, errors
    assert len(sizes) > 1 and all(s >= 1 for s in sizes)
    assert len(set(sizes)) > 1          # the pool really was remade under load
    assert _C.get_threads() >= 1
    with pytest.raises(ValueError):
        _C.set_threads(-1)


@pytest.mark.filterwarnings(FORK_WARNING)
def test_forked_child_pins():
    """A forked child gets its own arena and copy pool; the parent's stay good."""
    fastpin.pin_memory(patterned((100_000,), torch.int32, 1))   # pool and arena exist
    keep_src = patterned((70_000,), torch.int64, 2)
    keep = fastpin.pin_memory(keep_src)
    ctx = multiprocessing.get_context("fork")
    parent = fastpin.default_arena()
    p = ctx.Process(target=_child_pins, args=(5, [a.base for a in getattr(parent, "segments",
                                                                        (parent,))]))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert_same(keep, keep_src)
    src = patterned((100_000,), torch.int32, 6)
    assert_same(fastpin.pin_memory(src), src)


def _child_pins(seed, parent_bases):
    try:
        # The parent's arena (inherited, not usable here) is not this process's.
        arena = fastpin.default_arena()
        assert not {a.base for a in getattr(arena, "segments", (arena,))} & set(parent_bases)
        for i in range(20):
            src = patterned((100_000,), torch.int32, seed + i)
            out = fastpin.pin_memory({"x": src, "y": src.numpy()[::2]})
            assert tensor_bytes(out["x"]) == tensor_bytes(src)
            assert out["y"].tobytes() == src.numpy()[::2].tobytes()
            assert in_arena(out["x"], arena)
    except BaseException:
        import traceback
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


_EXIT_SCRIPT = textwrap.dedent("""
    import threading, time, numpy as np, torch, fastpin
    from fastpin import _C
    # Blocks alive at exit: tensors, arrays, unconsumed capsules, a private
    # arena already dropped, and a thread still pinning (NumPy leaves only:
    # torch itself aborts when a daemon thread runs its ops at exit).
    keep = fastpin.pin_memory({"t": torch.arange(1, 100_001), "a": np.arange(1, 5001)})
    arena = _C.Arena(1 << 20, cuda=False)
    block = arena.alloc(1000)
    capsules = [block.dlpack(0, [10], [1], 1, 8), block.dlpack(0, [10], [1], 1, 8, version=1)]
    tensor = torch.from_dlpack(block.dlpack(0, [250], [1], 0, 32))
    del arena
    started = threading.Event()
    def spin():
        x = np.arange(1, 400_001)
        while True:
            out = fastpin.pin_memory([x, x[::2], x])
            started.set()
    threading.Thread(target=spin, daemon=True).start()
    started.wait()
    time.sleep(0.05)
    assert int(keep["t"][-1]) == 100_000
    print("done")
""")


@pytest.mark.parametrize("run", range(3))
def test_interpreter_exit_with_live_blocks(run):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # Run beside the fastpin this test imported: a source tree in the working
    # directory would otherwise shadow an installed, built package.
    here = os.path.dirname(os.path.dirname(fastpin.__file__))
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True,
                       timeout=120, env=env, cwd=here)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert "Traceback" not in r.stderr and "Fatal" not in r.stderr, r.stderr
