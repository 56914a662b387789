"""Issue 25: the default arena sizes itself. Unset (no configure(capacity=...),
no FASTPIN_ARENA_BYTES), each GPU's default arena starts small and grows by
segments (arenas, each page-locked once) as the live batches need, never past
its cap; past the cap, and when the driver refuses to page-lock a new segment
(one warning), the on_full policy applies as for a fixed arena. An explicit
capacity is a fixed arena, as before."""
from __future__ import annotations

import collections
import gc
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C, _arena, _grow, _runtime, _segments
from conftest import assert_same, in_arena, patterned

MiB = 1 << 20
FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"
pytestmark = pytest.mark.timeout(120)
Pair = collections.namedtuple("Pair", "x y")


@pytest.fixture
def self_sizing(monkeypatch):
    """The default arenas self-sizing (capacity unset), made anew by the test
    with sizes(start, cap); the suite's own settings and arenas put back after."""
    settings = _runtime.settings
    saved = dict(_arena._arenas), settings.capacity, settings.policy()
    _arena._arenas.clear()
    settings.capacity = None

    def sizes(start: int, cap: int) -> None:
        monkeypatch.setattr(_arena, "START_BYTES", start)
        monkeypatch.setattr(_arena, "growth_cap", lambda registered: cap)
        _arena._arenas.clear()

    yield sizes
    arenas, capacity, policy = saved
    _arena._arenas.clear()
    _arena._arenas.update(arenas)
    settings.capacity = capacity
    settings.on_full, settings.wait_timeout = policy["on_full"], policy["wait_timeout"]


def ints(nbytes: int, seed: int) -> torch.Tensor:
    return patterned((nbytes // 4,), torch.int32, seed)


def fallbacks() -> int:
    return fastpin.stats()["fallbacks"]


def test_grows_by_segments_as_the_live_batches_need(self_sizing, caplog):
    self_sizing(4 * MiB, 256 * MiB)
    arena = fastpin.default_arena()
    assert isinstance(arena, _grow.GrowingArena)
    assert arena.capacity == 4 * MiB and len(arena.segments) == 1
    before = fallbacks()
    srcs, outs = [], []
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        for i in range(15):   # 3 MB (1.5 MB strided), every one held: 37.5 MB live
            src = ints(3 * MiB, i)
            # The three ways in: pin_tree (a dict), pin_batch (a namedtuple),
            # the Python pipeline (a non-contiguous leaf).
            batch = [{"x": src, "i": i}, Pair(src, src[:8]), {"x": src.view(-1, 4)[:, ::2]}][i % 3]
            srcs.append(batch)
            outs.append(fastpin.pin_memory(batch))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert fallbacks() == before
    for src, out in zip(srcs, outs):
        leaves = list(src.values()) if isinstance(src, dict) else list(src)
        got = list(out.values()) if isinstance(out, dict) else list(out)
        for s, o in zip(leaves, got):
            if isinstance(s, torch.Tensor):
                assert_same(o, s.contiguous())
                assert any(in_arena(o, seg) for seg in arena.segments)
            else:
                assert o == s
    assert fastpin.default_arena() is arena
    assert len(arena.segments) > 1 and 37 * MiB <= arena.capacity <= 256 * MiB
    assert arena.is_valid()
    # stats() sums the segments.
    s, per = fastpin.stats()["arena"], [seg.stats() for seg in arena.segments]
    for key in ("capacity", "bytes_in_use", "high_water"):
        assert s[key] == sum(p[key] for p in per), key
    assert s["capacity"] == arena.capacity and s["bytes_in_use"] >= 37 * MiB


def test_growing_arena_reserves_past_its_first_segment(self_sizing):
    # Bug: pin(sources) with no alignment given (torch's copy_ path reserves
    # its block so) raised TypeError once the first segment was full.
    self_sizing(2 * MiB, 32 * MiB)
    arena = fastpin.default_arena()
    held = [arena.pin([(0, 1536 * 1024)]) for _ in range(3)]  # more than one segment holds
    assert len(arena.segments) > 1
    for block, offsets in held:
        assert tuple(offsets) == (0,) and block.nbytes >= 1536 * 1024


def test_growth_under_concurrent_pins_never_past_its_cap(self_sizing):
    cap = 96 * MiB
    self_sizing(2 * MiB, cap)
    arena = fastpin.default_arena()
    before = fallbacks()
    start = threading.Barrier(4)
    errors, held = [], []

    def pinner(t: int) -> None:
        try:
            start.wait()
            live = collections.deque(maxlen=6)   # 4 threads x 6 x at most 2 MB live
            for i in range(25):
                src = ints((1 + (t + i) % 2) * MiB, 1000 * t + i)
                live.append((src, fastpin.pin_memory({"x": src})))
                held.append(arena.capacity)
                for s, o in live:
                    assert_same(o["x"], s)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=pinner, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert fallbacks() == before
    assert max(held) <= cap and arena.capacity <= cap and arena.capacity > 2 * MiB
    assert arena.is_valid()


def test_past_its_cap_the_policy_applies(self_sizing):
    cap = 16 * MiB
    self_sizing(2 * MiB, cap)
    arena = fastpin.default_arena()
    srcs, outs = [], []
    with pytest.raises(fastpin.ArenaFullError, match=r"cap of 16777216 bytes"):
        for i in range(20):
            srcs.append(ints(3 * MiB, i))
            outs.append(fastpin.pin_memory(srcs[-1], on_full="raise"))
    assert 4 <= len(outs) < 20 and arena.capacity <= cap
    before = fallbacks()
    src = ints(3 * MiB, 99)
    assert_same(fastpin.pin_memory(src, on_full="fallback"), src)   # pinned the ordinary way
    assert fallbacks() == before + 1
    _runtime.settings.wait_timeout = 0
    with pytest.raises(fastpin.ArenaFullError, match=r"waited 0 s"):
        fastpin.pin_memory(src, on_full="wait")
    # A batch bigger than the cap: the error says so, at once.
    with pytest.raises(fastpin.ArenaFullError, match=r"cap of 16777216 bytes"):
        fastpin.pin_memory(ints(20 * MiB, 7), on_full="wait")
    for s, o in zip(srcs, outs):
        assert_same(o, s)
    assert arena.capacity <= cap


def test_blocks_from_every_segment_freed_and_reused(self_sizing):
    self_sizing(2 * MiB, 64 * MiB)
    arena = fastpin.default_arena()
    srcs = [ints(MiB + 4096 * i, i) for i in range(12)]
    outs = [fastpin.pin_memory(s) for s in srcs]
    segments = list(arena.segments)
    assert len(segments) >= 3
    assert all(seg.stats()["bytes_in_use"] > 0 for seg in segments)  # each holds a batch
    for s, o in zip(srcs, outs):
        assert_same(o, s)
    del outs, o
    gc.collect()
    arena.collect()
    assert all(seg.stats()["bytes_in_use"] == 0 for seg in segments)
    assert fastpin.stats()["arena"]["bytes_in_use"] == 0
    # The same batches again find room in the same segments: nothing grows.
    capacity = arena.capacity
    again = [fastpin.pin_memory(s) for s in reversed(srcs)]
    assert arena.capacity == capacity and list(arena.segments) == segments
    for s, o in zip(reversed(srcs), again):
        assert_same(o, s)
        assert any(in_arena(o, seg) for seg in segments)


def test_an_empty_older_segment_is_released_and_its_tensors_outlive_the_arena(self_sizing):
    self_sizing(2 * MiB, 256 * MiB)
    arena = fastpin.default_arena()
    first = arena.segments[0]
    small = ints(MiB, 1)
    out = fastpin.pin_memory(small)
    assert in_arena(out, first)
    del out
    gc.collect()
    # Batches too big for the first segment: it stays empty, and goes once a
    # bigger one is made.
    big = [ints(3 * MiB, 10 + i) for i in range(8)]
    outs = [fastpin.pin_memory(b) for b in big]
    assert first not in arena.segments and arena.capacity <= 256 * MiB
    # Blocks keep their own segment alive: dropping the whole default arena
    # (configure makes a new one) leaves every tensor readable.
    old_segments = list(arena.segments)
    del arena, first
    fastpin.configure(capacity=8 * MiB)
    try:
        assert isinstance(fastpin.default_arena(), _C.Arena)
        gc.collect()
        for b, o in zip(big, outs):
            assert_same(o, b)
            assert any(in_arena(o, seg) for seg in old_segments)
    finally:
        fastpin.configure(capacity="auto")
    assert isinstance(fastpin.default_arena(), _grow.GrowingArena)


def test_a_refused_segment_warns_once_then_the_policy_applies(self_sizing, monkeypatch, caplog):
    """The driver refuses to page-lock a new segment (RLIMIT_MEMLOCK): one
    warning, no more attempts, and batches that do not fit take on_full."""
    self_sizing(4 * MiB, 64 * MiB)
    arena = fastpin.default_arena()
    asked = []

    def refused(capacity, index, **kwargs):
        asked.append(capacity)
        raise _C.CudaError("cuMemHostRegister: out of memory (simulated). fastpin could not "
                           f"page-lock an arena of {capacity} bytes (RLIMIT_MEMLOCK: 8388608 bytes)")

    monkeypatch.setattr(_arena, "make_placed_arena", refused)
    before = fallbacks()
    srcs = [ints(3 * MiB, i) for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        outs = [fastpin.pin_memory(s) for s in srcs]
    for s, o in zip(srcs, outs):
        assert_same(o, s)
    assert fallbacks() == before + 5 and len(asked) == 1
    grow_warnings = [r for r in caplog.records if "could not grow" in r.getMessage()]
    assert len(grow_warnings) == 1, caplog.text
    assert "RLIMIT_MEMLOCK" in grow_warnings[0].getMessage()
    with pytest.raises(fastpin.ArenaFullError):
        fastpin.pin_memory(srcs[0], on_full="raise")
    assert len(asked) == 1 and arena.capacity == 4 * MiB


def test_the_cap_is_a_share_of_memory_and_of_memlock(monkeypatch):
    import resource

    memory = _runtime.memory_bytes()
    assert _segments.machine_cap(False) == memory // 4
    monkeypatch.setattr(resource, "getrlimit", lambda which: (4 << 30, 4 << 30))
    assert _segments.machine_cap(True) == min(memory // 4, 2 << 30)
    assert _segments.machine_cap(False) == memory // 4   # not page-locked: memlock is moot
    # FASTPIN_ZERO_COPY_MAX_BYTES is zero-copy's, not the default arena's.
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(8 * MiB))
    assert _segments.default_cap(False) == 8 * MiB
    assert _arena.growth_cap(False) == memory // 4


def test_explicit_capacity_is_a_fixed_arena(self_sizing):
    self_sizing(2 * MiB, 64 * MiB)
    fastpin.configure(capacity=8 * MiB)
    try:
        arena = fastpin.default_arena()
        assert isinstance(arena, _C.Arena) and arena.capacity == 8 * MiB
        before = fallbacks()
        srcs = [ints(3 * MiB, i) for i in range(3)]
        outs = [fastpin.pin_memory(s) for s in srcs]
        assert fallbacks() == before + 1 and arena.capacity == 8 * MiB   # no growth
        for s, o in zip(srcs, outs):
            assert_same(o, s)
    finally:
        fastpin.configure(capacity="auto")
    assert _arena.get_capacity() is None
    arena = fastpin.default_arena()
    assert isinstance(arena, _grow.GrowingArena) and arena.capacity == 2 * MiB


def test_environment_capacity_is_fixed_and_unset_sizes_itself():
    home = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
    code = ("import fastpin, numpy as np\n"
            "a = fastpin.default_arena()\n"
            "print(type(a).__name__, a.capacity, getattr(a, 'cap', None))\n")
    env = dict(os.environ, PYTHONPATH=home + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FASTPIN_ARENA_BYTES", None)
    for extra, want in [({"FASTPIN_ARENA_BYTES": str(4 * MiB)}, ["Arena", str(4 * MiB), "None"]),
                        ({}, ["GrowingArena", str(_arena.START_BYTES),
                              str(_arena.growth_cap(fastpin.cuda_available()))])]:
        r = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(),
                           env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == want


def test_copying_loader_grows_the_default_arena(self_sizing):
    self_sizing(2 * MiB, 64 * MiB)
    srcs = [{"x": ints(3 * MiB, i), "i": i} for i in range(10)]
    loader = fastpin.Loader(srcs, device=None, depth=3)
    got = list(loader)   # every batch held
    assert len(got) == 10
    for s, o in zip(srcs, got):
        assert_same(o["x"], s["x"]) and o["i"] == s["i"]
    stats = loader.stats()
    assert stats["fallbacks"] == 0
    assert stats["pool_capacity"] == fastpin.default_arena().capacity > 2 * MiB


@pytest.mark.filterwarnings(FORK_WARNING)
def test_fork_while_it_grows(self_sizing, monkeypatch):
    self_sizing(2 * MiB, 64 * MiB)
    arena = fastpin.default_arena()
    parent, real = os.getpid(), _arena.make_placed_arena
    growing = threading.Event()

    def slow(capacity, index, **kwargs):
        if os.getpid() == parent:
            growing.set()
            time.sleep(0.5)   # the fork comes while the lock is held
        return real(capacity, index, **kwargs)

    monkeypatch.setattr(_arena, "make_placed_arena", slow)
    src = ints(3 * MiB, 5)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", fastpin.pin_memory(src)))
    thread.start()
    assert growing.wait(30)
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            assert not _runtime.process.arenas and _arena.made_default_arena() is None
            # NumPy only: torch's own thread pool may hang in a child forked
            # from a process that ran parallel torch ops.
            before = fallbacks()
            mine = [patterned((3 * MiB // 4,), np.int32, 50 + i) for i in range(3)]
            outs = [fastpin.pin_memory(m) for m in mine]
            ok = all(np.array_equal(o, m) for o, m in zip(outs, mine))
            ok = ok and fastpin.default_arena() is not arena and fallbacks() == before
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    thread.join(30)
    assert os.waitstatus_to_exitcode(status) == 0
    assert_same(result["out"], src)
    # The first segment, empty and too small, went when the bigger one came.
    assert arena.capacity > 2 * MiB and in_arena(result["out"], arena.newest)
