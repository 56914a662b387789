"""The shared arena across processes, the C side of zero-copy mode seen from
Python: workers attach through the memfd (fork, spawn, forkserver), allocate,
fill and detach blocks and say where they are; the creator adopts them.
Blocks of killed workers are reclaimed; a forked child never frees its
parent's blocks."""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import pickle
import signal
import time
from multiprocessing import reduction

import numpy as np
import pytest

from fastpin import _C
from conftest import gpu, process_state

MiB = 1 << 20
START_METHODS = ["fork", "spawn", "forkserver"]
FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"
WAIT = 60  # seconds for a child to start (spawn imports torch) and answer

pytestmark = [pytest.mark.filterwarnings(FORK_WARNING), pytest.mark.timeout(240)]


class Fd:
    """A file descriptor for a child: inherited under fork, sent as a file
    descriptor under spawn and forkserver (multiprocessing's DupFd)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (Fd._rebuild, (reduction.DupFd(self.fd),))

    @staticmethod
    def _rebuild(dup):
        return Fd(dup.detach())


def pattern(seed: int, k: int, nbytes: int) -> np.ndarray:
    """Bytes that differ per worker, per block and per byte, never zero."""
    return np.random.default_rng([seed, k]).integers(1, 256, size=nbytes, dtype=np.uint8)


def view(block) -> np.ndarray:
    return block.numpy(0, (block.nbytes,), (1,), np.uint8)


def shared_arena(capacity: int, cuda: bool = False) -> _C.Arena:
    return _C.Arena(capacity, shared=True, cuda=cuda)


def receive(conn, process):
    """The child's answer, or a failure that says what the child did."""
    if not conn.poll(WAIT):
        process.kill()
        process.join(WAIT)
        pytest.fail(f"no answer from the child (exit code {process.exitcode})")
    kind, payload = conn.recv()
    if kind != "ok":
        process.join(WAIT)
        pytest.fail(f"child failed: {payload}")
    return payload


# ---- what the children run ---------------------------------------------------

def _fill_blocks(fd, seed, sizes, conn):
    """Attach, fill one detached block per size, report (index, nbytes, pid)."""
    try:
        arena = _C.Arena.attach(fd.fd)
        os.close(fd.fd)  # the Arena keeps its own copy
        assert arena.attached and not arena.registered
        out = []
        for k, n in enumerate(sizes):
            block = arena.alloc(n)
            view(block)[:] = pattern(seed, k, n)
            block.detach()
            out.append((block.index, block.nbytes, os.getpid()))
            del block  # detached: leaves the block allocated
        conn.send(("ok", (out, arena.token)))
    except BaseException as e:  # the parent reports it
        conn.send(("error", repr(e)))


def _hold_blocks(fd, sizes, conn):
    """Attach, allocate, report, and wait to be killed."""
    try:
        arena = _C.Arena.attach(fd.fd)
        blocks = [arena.alloc(n) for n in sizes]
        for k, b in enumerate(blocks):
            view(b)[:] = pattern(99, k, b.nbytes)
        blocks[0].detach()  # sent but never adopted: reclaimed all the same
        conn.send(("ok", [b.index for b in blocks]))
    except BaseException as e:
        conn.send(("error", repr(e)))
    time.sleep(3600)


def _fill_until_full(fd, conn):
    """Fill a small arena until it refuses, count the fallback, free all."""
    try:
        arena = _C.Arena.attach(fd.fd)
        blocks = []
        with pytest.raises(_C.ArenaFullError):
            for _ in range(1000):
                blocks.append(arena.alloc(10_000))
        arena.count_fallback()
        n = len(blocks)
        del blocks  # freed by this process
        conn.send(("ok", n))
    except BaseException as e:
        conn.send(("error", repr(e)))


_inherited: list = []


def _drop_inherited(conn):
    """A forked child drops its copy of the parent's Block."""
    try:
        _inherited.clear()
        gc.collect()
        conn.send(("ok", None))
    except BaseException as e:
        conn.send(("error", repr(e)))


def _start(method, target, *args):
    ctx = multiprocessing.get_context(method)
    ours, theirs = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    p.start()
    theirs.close()
    return p, ours


# ---- one process -------------------------------------------------------------

def test_attach_in_the_same_process():
    arena = shared_arena(4 * MiB)
    w = _C.Arena.attach(arena.fd)
    assert w.attached and not arena.attached
    assert w.token == arena.token and w.capacity == arena.capacity
    assert w.base != arena.base and w.fd not in (-1, arena.fd)
    assert not w.registered and w.stats()["shared"] and arena.stats()["shared"]
    block = w.alloc(50_000)
    view(block)[:] = pattern(1, 0, 50_000)
    # The same bytes through the creator's mapping.
    seen = ctypes.string_at(arena.base + (block.ptr - w.base), 50_000)
    assert seen == pattern(1, 0, 50_000).tobytes()
    assert arena.owner(block.index) == os.getpid()

    with pytest.raises(ValueError, match="not detached"):
        arena.adopt(block.index, block.nbytes)
    with pytest.raises(ValueError, match="created the arena"):
        w.adopt(block.index, block.nbytes)
    block.detach()
    index, nbytes = block.index, block.nbytes
    del block, seen
    with pytest.raises(ValueError, match="allocated for 50000"):
        arena.adopt(index, nbytes + 1)
    with pytest.raises(ValueError, match="out of range"):
        arena.adopt(1 << 40, nbytes)
    adopted = arena.adopt(index, nbytes)
    assert adopted.index == index and adopted.nbytes == nbytes
    assert arena.owner(index) == 0
    assert np.array_equal(view(adopted), pattern(1, 0, 50_000))
    with pytest.raises(ValueError, match="already adopted"):
        arena.adopt(index, nbytes)
    with pytest.raises(ValueError, match="adopted"):
        adopted.detach()
    del adopted
    arena.collect()
    with pytest.raises(ValueError, match="not allocated"):
        arena.adopt(index, nbytes)
    s = arena.stats()
    assert s["blocks_in_use"] == 0 and s["blocks_foreign"] == 0
    assert arena.is_valid() and w.is_valid()


def test_prefault_only_maps_what_registration_made_resident():
    """Unregistered (no GPU, or cuda=False), the pages do not exist yet: prefaulting
    would allocate the whole arena in shared memory, so attach leaves it alone."""
    arena = shared_arena(64 * MiB)
    w = _C.Arena.attach(arena.fd)
    before = os.fstat(arena.fd).st_blocks
    assert not w.prefault() and not arena.prefault()
    assert os.fstat(arena.fd).st_blocks == before  # nothing allocated


def test_arenas_refuse_pickling():
    arena = shared_arena(MiB)
    with pytest.raises(TypeError, match="Arena.attach"):
        pickle.dumps(arena)
    with pytest.raises(TypeError):
        pickle.dumps(arena.alloc(10))
    with pytest.raises(TypeError, match="Arena.attach"):
        pickle.dumps(_C.Arena.attach(arena.fd))


def test_attach_rejects_what_is_not_an_arena(tmp_path):
    with pytest.raises(OSError):
        _C.Arena.attach(1 << 20)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="does not hold a fastpin arena"):
            _C.Arena.attach(r)
    finally:
        os.close(r)
        os.close(w)
    path = tmp_path / "junk"
    path.write_bytes(pattern(5, 0, 1 << 16).tobytes())
    with open(path, "rb+") as f:
        with pytest.raises(ValueError, match="magic"):
            _C.Arena.attach(f)  # anything with fileno()
    assert _C.Arena(MiB, cuda=False).fd == -1  # a private arena has no fd to give


def test_tokens_differ():
    tokens = {shared_arena(MiB).token for _ in range(20)}
    assert len(tokens) == 20 and 0 not in tokens


# ---- workers -----------------------------------------------------------------

@pytest.mark.parametrize("method", START_METHODS)
def test_workers_fill_blocks_the_creator_adopts(method):
    arena = shared_arena(16 * MiB)
    workers = []
    for w in range(3):
        sizes = [1 + (w * 7919 + k * 104_729) % 300_000 for k in range(8)]
        sizes[0] = 0  # an empty batch still gets a block
        workers.append((w + 10, sizes, *_start(method, _fill_blocks, Fd(arena.fd), w + 10, sizes)))
    reports = []
    for seed, sizes, p, conn in workers:
        out, token = receive(conn, p)
        assert token == arena.token and len(out) == len(sizes)
        reports += [(seed, k, *r) for k, r in enumerate(out)]
        p.join(WAIT)
        assert p.exitcode == 0
    s = arena.stats()
    assert s["blocks_foreign"] == s["blocks_in_use"] == len(reports)

    adopted = []
    for seed, k, index, nbytes, pid in reports:
        assert arena.owner(index) == pid
        block = arena.adopt(index, nbytes)
        assert arena.owner(index) == 0
        with pytest.raises(ValueError, match="already adopted"):
            arena.adopt(index, nbytes)
        adopted.append((seed, k, block))
    assert arena.stats()["blocks_foreign"] == 0
    for seed, k, block in adopted:  # nothing overlapped
        assert np.array_equal(view(block), pattern(seed, k, block.nbytes))
    del adopted, block
    arena.collect()
    s = arena.stats()
    assert s["blocks_in_use"] == 0 and s["bytes_in_use"] == 0 and s["reclaimed"] == 0
    assert arena.is_valid()


def test_killed_worker_blocks_are_reclaimed_before_it_is_reaped():
    """A dead worker nobody has waited for yet (DataLoader reaps its workers
    when it shuts them down, which may come after the epoch's reclaim) is a
    zombie: it still answers kill(), but it writes nothing more."""
    arena = shared_arena(4 * MiB)
    sizes = [30_000, 1, 200_000]
    p, conn = _start("fork", _hold_blocks, Fd(arena.fd), sizes)
    receive(conn, p)
    os.kill(p.pid, signal.SIGKILL)  # not p.kill(): nothing here may reap it
    deadline = time.monotonic() + WAIT
    while process_state(p.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(p.pid) == "Z"
    assert arena.reclaim() == len(sizes)
    assert process_state(p.pid) == "Z"  # left for its parent's own wait
    p.join(WAIT)
    assert p.exitcode == -signal.SIGKILL
    assert arena.reclaim() == 0 and arena.stats()["blocks_in_use"] == 0
    assert arena.is_valid()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_killed_worker_blocks_are_reclaimed(method):
    arena = shared_arena(4 * MiB)
    sizes = [30_000, 1, 200_000, 4096, 77_777]
    p, conn = _start(method, _hold_blocks, Fd(arena.fd), sizes)
    indices = receive(conn, p)
    assert arena.stats()["blocks_in_use"] == len(sizes)
    assert arena.reclaim() == 0  # alive
    p.kill()
    p.join(WAIT)  # reaps: only then is the pid gone
    assert p.exitcode is not None and p.exitcode < 0
    assert arena.reclaim() == len(sizes)
    for i in indices:
        with pytest.raises(ValueError, match="not allocated"):
            arena.adopt(i, 1)
    s = arena.stats()
    assert s["blocks_in_use"] == 0 and s["reclaimed"] == len(sizes)
    whole = arena.alloc(arena.capacity)  # every block merged back
    del whole
    assert arena.is_valid()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_finds_the_arena_full(method):
    arena = shared_arena(64 << 10)
    keep = arena.alloc(20_000)  # the creator's block stays untouched
    view(keep)[:] = pattern(3, 3, 20_000)
    p, conn = _start(method, _fill_until_full, Fd(arena.fd))
    n = receive(conn, p)
    p.join(WAIT)
    assert p.exitcode == 0 and 0 < n < 7
    arena.collect()
    s = arena.stats()
    assert s["fallbacks"] == 1 and s["failed"] == 1 and s["blocks_in_use"] == 1
    assert np.array_equal(view(keep), pattern(3, 3, 20_000))
    arena.count_fallback()
    assert arena.stats()["fallbacks"] == 2


def test_forked_child_never_frees_the_parents_blocks():
    arena = shared_arena(MiB)
    _inherited.append(arena.alloc(100_000))
    view(_inherited[0])[:] = pattern(4, 4, 100_000)
    try:
        p, conn = _start("fork", _drop_inherited)
        receive(conn, p)
        p.join(WAIT)
        assert p.exitcode == 0
        arena.collect()
        assert arena.stats()["blocks_in_use"] == 1
        assert np.array_equal(view(_inherited[0]), pattern(4, 4, 100_000))
    finally:
        _inherited.clear()
    arena.collect()
    assert arena.stats()["blocks_in_use"] == 0


@gpu
def test_workers_fill_a_registered_arena():
    import torch

    arena = shared_arena(16 * MiB, cuda=True)
    assert arena.registered
    sizes = [123_456, 4096, 1]
    p, conn = _start("spawn", _fill_blocks, Fd(arena.fd), 21, sizes)
    out, _ = receive(conn, p)  # the worker asserts it is not registered there
    p.join(WAIT)
    for k, (index, nbytes, _pid) in enumerate(out):
        block = arena.adopt(index, nbytes)
        assert block.consumer_stream == "any"  # a fence over every stream of the device
        t = torch.from_dlpack(block)
        assert t.is_pinned()
        assert np.array_equal(t.to("cuda").cpu().numpy(), pattern(21, k, nbytes))
    del block, t
    torch.cuda.synchronize()
    arena.collect()
    assert arena.stats()["blocks_in_use"] == 0
