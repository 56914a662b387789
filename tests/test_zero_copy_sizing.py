"""Zero-copy's shared arena sizes itself: no capacity given, it grows to what
the DataLoader's workers have in flight for the batches they make, never past
its cap, and a full arena still falls back. CPU only (the memory is shared,
just not page-locked); the cap is lowered to keep the memory small."""
import gc
import logging
import multiprocessing
import os
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

import fastpin
from fastpin import _C, _runtime, _segments, _zerocopy

from conftest import assert_same, gpu, patterned
from test_loader_stats import no_default_arena  # noqa: F401 - a fixture
from test_zero_copy_reuse import nothing_left_behind  # noqa: F401 - a fixture

MB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def expected(i, numel):
    return patterned((numel,), torch.float32, seed=i)


class Samples(Dataset):
    def __init__(self, n, numel):
        self.n, self.numel = n, numel

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": expected(i, self.numel), "i": i}


def check(batches, n, numel):
    seen = []
    for b in batches:
        for x, i in zip(b["x"], b["i"].tolist()):
            assert_same(x, expected(i, numel))
            seen.append(i)
    assert sorted(seen) == list(range(n))


def batch_bytes(batch_size, numel):
    return _C.block_size(batch_size * numel * 4 + batch_size * 8 + 2 * _C.GRANULE)


@pytest.fixture
def small_memory(monkeypatch):
    """The default cap lowered to 64 MiB, and fastpin's default arena (what
    zero-copy used to make) to 8 MiB: 2 workers x 2 prefetched would have
    fitted batches of 2 MiB at most."""
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(64 * MB))
    old = fastpin._arena.get_capacity()
    fastpin.configure(capacity=8 * MB)
    yield 64 * MB
    fastpin.configure(capacity="auto" if old is None else old)


@pytest.mark.parametrize("method,persistent", [("fork", False), ("fork", True), ("spawn", False),
                                               ("spawn", True), ("forkserver", False)])
def test_default_settings_fit_batches_the_old_default_did_not(method, persistent, small_memory,
                                                              nothing_left_behind):
    numel = 3 * MB // 4 // 8       # 8 samples of 384 KiB: batches of 3 MiB
    dl = DataLoader(Samples(40, numel), batch_size=8, num_workers=2, prefetch_factor=2,
                    multiprocessing_context=method, persistent_workers=persistent)
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    assert loader.stats()["pool_capacity"] == 0     # nothing made before the first batch
    for _ in range(2):
        batches = list(loader)
        check(batches, 40, numel)
        assert all(_zerocopy._registry().get(loader.arena.token) is not None for _ in batches)
        del batches
    stats = loader.stats()
    assert stats["fallbacks"] == 0 and stats["worker_fallbacks"] == 0
    need = _zerocopy.capacity_for(dl, batch_bytes(8, numel), depth=2)
    assert need <= stats["pool_capacity"] <= small_memory
    assert stats["pool_capacity"] > 8 * MB
    assert len(loader._pool.segments) == 1          # sized once, for the whole run
    del loader, dl, stats


def arena_full_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "arena full" in r.getMessage()]


def test_first_batches_of_a_fast_dataset_never_fall_back_nor_say_the_arena_is_full(
        small_memory, no_default_arena, caplog, nothing_left_behind):
    # Samples already in memory: the second worker's first batch comes while
    # the first one's request grows the pool. A worker that had read the
    # segment list just before (many leaves make the time from there to its
    # own request long) used to fall back ("found the shared arena full", the
    # pool sized and empty), and the main process made its default arena to
    # pin that batch by copy.
    leaves, numel = 512, 200         # batches of 3.3 MB, the pool sized to 40 MB
    every = patterned((40, leaves, numel), torch.float32, seed=1)
    data = [{"x": list(every[i]), "i": i} for i in range(40)]
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        for run in range(24):        # a fresh Loader (an empty pool) each time
            dl = DataLoader(data, batch_size=8, num_workers=2)
            loader = fastpin.Loader(dl, device=None, zero_copy=True)
            seen = []
            for b in loader:
                for j, x in enumerate(b["x"]):
                    assert_same(x, every[b["i"], j])
                seen += b["i"].tolist()
            assert sorted(seen) == list(range(40))
            assert loader.stats()["fallbacks"] == 0, f"run {run}: {loader.stats()}"
            del loader, dl, b, x
    assert not arena_full_warnings(caplog)
    assert not no_default_arena, "the main process made its default arena"


def _stale_worker(monkeypatch):
    """Patches the forked workers inherit: worker 1, about to ask for room,
    stops (as if preempted) until another worker has had the pool grown since
    worker 1 last read the segment list; worker 0 asks only once worker 1 is
    there. Each wait is bounded: at worst the interleaving is not forced."""
    stale = multiprocessing.get_context("fork").Event()
    may_grow, ask = _segments._Directory.may_grow, _segments._Directory.ask

    def wait(ready, seconds=10.0):
        deadline = time.monotonic() + seconds
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.001)

    def slow_may_grow(self, need):
        if get_worker_info() is not None and get_worker_info().id == 1:
            seen = self.seen
            stale.set()
            wait(lambda: _segments._word(self.map, _segments._DIR_COUNT) > seen)
        return may_grow(self, need)

    def late_ask(self, need):
        if get_worker_info() is not None and get_worker_info().id == 0:
            wait(stale.is_set)
            stale.clear()
        return ask(self, need)

    monkeypatch.setattr(_segments._Directory, "may_grow", slow_may_grow)
    monkeypatch.setattr(_segments._Directory, "ask", late_ask)


@pytest.mark.parametrize("growing", [False, True])
def test_a_worker_whose_view_of_the_pool_is_stale_reads_it_again_before_it_falls_back(
        growing, monkeypatch, small_memory, no_default_arena, caplog, nothing_left_behind):
    # The interleaving the test above meets by chance, forced: another worker
    # grew the pool after this one read the segment list, at the first
    # segment (the list was empty) or at a later one (its segments are too
    # small for the batch). Either way the pool was already sized for it.
    _stale_worker(monkeypatch)
    small, large = 1024, 4 * MB // 4 // 8

    def numel(i):
        return large if growing and i >= 24 else small

    data = [{"x": expected(i, numel(i)), "i": i} for i in range(48)]
    dl = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        seen = []
        for b in loader:
            for x, i in zip(b["x"], b["i"].tolist()):
                assert_same(x, expected(i, numel(i)))
                seen.append(i)
    assert sorted(seen) == list(range(48))
    assert loader.stats()["fallbacks"] == 0, loader.stats()
    assert len(loader._pool.segments) == (2 if growing else 1)
    assert not arena_full_warnings(caplog)
    assert not no_default_arena, "the main process made its default arena"
    del loader, dl, b, x


def test_a_request_another_worker_overwrote_is_made_again(monkeypatch, small_memory,
                                                         nothing_left_behind):
    # Workers state their request with a plain read, then write: one asking
    # for a smaller block can overwrite a larger request before the main
    # process reads it. The worker that asked for more used to wait for
    # GROW_WAIT_S, then fall back; it states its request again instead.
    monkeypatch.setattr(_segments, "GROW_WAIT_S", 10.0)
    loader = fastpin.Loader(DataLoader(Samples(8, 1024), batch_size=4, num_workers=1),
                            device=None, zero_copy=True)
    pool = loader._pool
    view = _segments.directory_for(pool.directory, pool.carried, _zerocopy._attach)
    # Large enough that the segment made for the small request cannot hold it.
    small, large = _C.block_size(64 * 1024), _C.block_size(4 * MB)
    answers = []
    with pool.lock:                          # the main process is busy: it reads nothing yet
        asker = threading.Thread(target=lambda: answers.append(view.ask(large)))
        asker.start()
        deadline = time.monotonic() + 10
        while _segments._word(pool.view, _segments._DIR_WANTED) < large:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        _segments._set_word(pool.view, _segments._DIR_WANTED, small)   # the other worker
    asker.join(20)
    assert answers == [True]
    assert pool.capacity >= _zerocopy.capacity_for(loader.loader, large, loader.depth)
    assert view.refresh() and view.arenas[0].capacity >= large
    check(loader, 8, 1024)
    assert loader.stats()["fallbacks"] == 0
    del loader, pool, view


def test_no_workers_sizes_itself(small_memory, nothing_left_behind):
    numel = 2 * MB // 4 // 4
    loader = fastpin.Loader(DataLoader(Samples(20, numel), batch_size=4), device=None,
                            zero_copy=True)
    check(loader, 20, numel)
    stats = loader.stats()
    assert stats["fallbacks"] == 0 and 0 < stats["pool_capacity"] <= small_memory
    del loader, stats


def test_growing_batches_grow_the_arena(small_memory, nothing_left_behind):
    # Batches of 32 KiB, then of 4 MiB: more than the whole first segment
    # (10 small blocks, rounded up to 2 MiB), so they need a second.
    small, large = 1024, 4 * MB // 4 // 8

    class Growing(Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            return {"x": expected(i, small if i < 24 else large), "i": i}

    # One worker: its small batches ask first, then its large ones (two
    # workers may ask for the large one before the small one is served).
    dl = DataLoader(Growing(), batch_size=8, num_workers=1)
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    seen = []
    for b in loader:
        for x, i in zip(b["x"], b["i"].tolist()):
            assert_same(x, expected(i, small if i < 24 else large))
            seen.append(i)
    assert sorted(seen) == list(range(48))
    stats = loader.stats()
    assert stats["fallbacks"] == 0
    assert len(loader._pool.segments) == 2 and stats["pool_capacity"] <= small_memory
    del loader, dl, stats


def test_the_cap_is_never_exceeded_and_a_full_arena_falls_back(small_memory, caplog,
                                                               nothing_left_behind):
    numel = 3 * MB // 4 // 8
    dl = DataLoader(Samples(48, numel), batch_size=8, num_workers=2, prefetch_factor=2)
    cap = 4 * batch_bytes(8, numel)          # room for 4 of the 4 + 2 + 6 it wants
    loader = fastpin.Loader(dl, device=None, zero_copy=True, max_capacity=cap)
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        batches = list(loader)               # kept: the arena fills, the rest fall back
    check(batches, 48, numel)
    stats = loader.stats()
    assert 0 < stats["pool_capacity"] <= cap
    assert stats["fallbacks"] > 0 and stats["fallbacks"] == stats["worker_fallbacks"]
    assert any("max_capacity" in r.getMessage() for r in caplog.records)
    del batches, loader, dl, stats


def test_a_batch_over_the_cap_falls_back_at_once(small_memory, nothing_left_behind):
    numel = 2 * MB // 4 // 4
    dl = DataLoader(Samples(16, numel), batch_size=4, num_workers=2)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, max_capacity=MB)
    check(loader, 16, numel)
    stats = loader.stats()
    assert stats["fallbacks"] == 4 and stats["pool_capacity"] == 0
    del loader, dl, stats


def test_default_cap_follows_memory_and_the_environment(monkeypatch):
    monkeypatch.delenv("FASTPIN_ZERO_COPY_MAX_BYTES", raising=False)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < _zerocopy.default_cap(False) <= memory // 4
    assert _zerocopy.default_cap(True) <= memory // 4
    import resource

    quarter = _runtime.memory_bytes() // 4
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * MB, 8 * MB))
    assert _zerocopy.default_cap(True) == quarter      # a default limit: not for CUDA
    monkeypatch.setattr(resource, "getrlimit", lambda which: (4 << 30, 4 << 30))
    assert _zerocopy.default_cap(True) == min(quarter, 2 << 30)
    assert _zerocopy.default_cap(False) == quarter     # nothing page-locked: no limit
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(5 * MB))
    assert _zerocopy.default_cap(True) == 5 * MB
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="FASTPIN_ZERO_COPY_MAX_BYTES"):
        _zerocopy.default_cap(False)


def test_pool_goes_with_its_loader(small_memory, nothing_left_behind):
    numel = MB // 4 // 4
    loader = fastpin.Loader(DataLoader(Samples(8, numel), batch_size=4, num_workers=1),
                            device=None, zero_copy=True)
    check(loader, 8, numel)
    thread = loader._pool.thread
    del loader
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()



def test_a_pool_ended_after_its_grower_saw_it_gone_raises_nothing_and_writes_no_closed_fd():
    """The CI failure of 2026-12-02 ("Exception ignored in: <finalize object;
    dead>" in a test's teardown): the pool's weak reference dies before its
    finalizer runs, and the grower thread, waking in between, closed the
    directory's view and descriptors itself; the finalizer then wrote to the
    closed view (TypeError) and to a descriptor number that may by then be
    another file's. Here the finalizer is held back until the grower has had
    time to see the pool gone."""
    pool = _segments.Pool(lambda n: None, loader=None, depth=2, cap=64 * MB)
    thread, wake = pool.thread, pool.wake
    end = pool._finalizer.detach()   # (pool, func, args, kwargs): run by hand below
    assert end is not None
    func, args = end[1], end[2]
    del pool, end
    gc.collect()
    time.sleep(2.5)                  # the grower wakes at least once a second
    func(*args)                      # what the finalizer does: raised TypeError before
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(wake)               # closed, by the grower, after the finalizer woke it

@gpu
@pytest.mark.parametrize("device", ["cuda", None])
def test_self_sized_arena_on_the_gpu(device, small_memory, nothing_left_behind):
    # Segments are registered by the pool's thread; batches arrive exact, on
    # the GPU (device mode) or pinned in the arena (host mode), none by copy.
    numel = 3 * MB // 4 // 8
    dl = DataLoader(Samples(40, numel), batch_size=8, num_workers=2)
    for _ in range(2):                       # a new Loader every epoch
        loader = fastpin.Loader(dl, device=device, zero_copy=True)
        seen = []
        for b in loader:
            if device is None:
                assert b["x"].is_pinned()
            else:
                assert b["x"].is_cuda
            for x, i in zip(b["x"], b["i"].tolist()):
                assert_same(x.cpu(), expected(i, numel))
                seen.append(i)
        assert sorted(seen) == list(range(40))
        stats = loader.stats()
        assert stats["fallbacks"] == 0 and 0 < stats["pool_capacity"] <= small_memory
        assert loader.arena.registered
        del loader, b, x
    del dl


def _refused(creator, fd):
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize("staged", [False, True], ids=["one-stage", "staged"])
def test_segments_the_workers_cannot_open_fall_back_until_the_next_epoch(
        monkeypatch, small_memory, nothing_left_behind, staged):
    # Forked workers inherit the patch: /proc/<pid>/fd refused, as under a
    # hardened /proc. The first epoch falls back (never waits long), the next
    # epoch's workers carry the segment from the start. Grown in a first stage
    # and the rest, the pool has those two segments, no more.
    monkeypatch.setattr(_segments, "_open_segment", _refused)
    if staged:
        monkeypatch.setattr(_segments, "STAGE_MIN_BYTES", 2 * MB)
    numel = MB // 4 // 4
    dl = DataLoader(Samples(24, numel), batch_size=4, num_workers=2,
                    multiprocessing_context="fork")
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    check(loader, 24, numel)
    first = loader.stats()["fallbacks"]
    assert first == 6 and loader.stats()["pool_capacity"] > 0
    assert len(loader._pool.segments) == (2 if staged else 1)
    check(loader, 24, numel)
    assert loader.stats()["fallbacks"] == first
    del loader, dl


def test_stage_of_gives_an_empty_pool_a_first_stage_then_the_rest(monkeypatch):
    monkeypatch.setattr(_segments, "STAGE_MIN_BYTES", 8 * MB)
    # An empty pool: the least stage, or two blocks where those are more.
    assert _segments.stage_of(100 * MB, 0, 3 * MB, 0) == (8 * MB, False)
    assert _segments.stage_of(100 * MB, 0, 5 * MB, 0) == (10 * MB, False)
    # Then the rest at once; and any growth of a pool that holds something whole.
    assert _segments.stage_of(92 * MB, 8 * MB, 3 * MB, 1) == (92 * MB, True)
    # Small growth, or too few directory entries left for two: in one.
    assert _segments.stage_of(12 * MB, 0, 3 * MB, 0) == (12 * MB, True)
    last = _segments._MAX_SEGMENTS - 2
    assert _segments.stage_of(100 * MB, 0, 3 * MB, last) == (100 * MB, True)


def test_a_large_pool_grows_in_a_first_stage_then_the_rest(monkeypatch, small_memory,
                                                           nothing_left_behind):
    """On the H100 machine the first batch of 147 MiB (15 workers) came 1-1.5 s
    after stock's: the pool registered room for every batch in flight (6 GB)
    before it. A large pool now grows by a first stage of two blocks, listed
    for the workers as soon as it is made, then at once by the rest: every
    batch exact, none fallen back, the pool sized for the batches in flight."""
    monkeypatch.setattr(_segments, "STAGE_MIN_BYTES", 2 * MB)
    numel = MB // 4 // 4          # batches of 1 MiB
    dl = DataLoader(Samples(60, numel), batch_size=4, num_workers=2,
                    multiprocessing_context="fork")
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    check(loader, 60, numel)
    assert loader.stats()["fallbacks"] == 0
    caps = [a.capacity for a in reversed(loader._pool.segments)]   # oldest first
    block = batch_bytes(4, numel)
    whole = -(-_zerocopy.capacity_for(dl, block, loader.depth) // (2 * MB)) * 2 * MB
    first = -(-2 * block // (2 * MB)) * 2 * MB
    assert caps == [first, whole - first], (caps, whole)
    del loader, dl


class _Pending:
    """Stands for a segment with blocks the GPU still reads (CPU-only machine:
    no fences exist here to make real ones)."""

    def __init__(self, pending):
        self.pending = pending

    def stats(self):
        return {"blocks_pending": self.pending}


def test_a_worker_facing_blocks_the_gpu_still_reads_has_the_main_process_look(monkeypatch):
    """The protocol under the GPU test
    test_install.py::test_copies_queued_behind_the_gpu_wait_for_it_never_fall_back_for_good:
    a worker whose full pool holds pending blocks wakes the pool's thread, which
    collects (looks at the fences) and says so; with nothing pending, or past
    the deadline, the worker falls back at once."""
    looked = []
    monkeypatch.setattr(_segments.Pool, "collect", lambda self: looked.append(1))
    pool = _segments.Pool(lambda n: None, loader=None, depth=2, cap=64 * MB)
    _, dir_fd, wake, creator = pool.directory
    view = _segments._Directory(dir_fd, wake, creator, {}, None)
    try:
        view.arenas, view.seen = [_Pending(0)], 1
        assert not view.wait_for_frees(time.monotonic() + 5)        # nothing pending
        view.arenas = [_Pending(0), _Pending(3)]
        assert not view.wait_for_frees(time.monotonic() - 1)        # past the deadline
        before = len(looked)
        for _ in range(3):
            served = _segments._word(view.map, _segments._DIR_COLLECTED)
            assert view.wait_for_frees(time.monotonic() + 5)
            assert _segments._word(view.map, _segments._DIR_COLLECTED) > served
        assert len(looked) >= before + 3
    finally:
        view.map.close()
        del pool
        gc.collect()


class _LateFirst(Samples):
    """Samples whose first `late` batches (of `batch_size`) come a while after
    the others: the workers of later batches ask for room first."""

    def __init__(self, n, numel, batch_size, late):
        super().__init__(n, numel)
        self.first_late = [k * batch_size for k in range(late)]

    def __getitem__(self, i):
        if i in self.first_late:
            time.sleep(1.0)
        return super().__getitem__(i)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_first_stage_holds_the_first_batches_whichever_worker_asks_first(
        monkeypatch, small_memory, nothing_left_behind):
    """On the H100 machine the video case's second batch came 4.6 s after its
    first: the first stage's two blocks went to whichever workers asked first,
    and the worker of batch 1 (the loop takes batches in order) waited for the
    rest, 11 GB to register. While only the stage is listed it holds the
    first batch of as many workers as it has blocks for, in the order the
    loop takes them: here the worker of batch 2 asks first, and batches 0 and
    1 still lie in the stage."""
    monkeypatch.setattr(_segments, "STAGE_MIN_BYTES", 2 * MB)
    added = _segments.Pool._add

    def slow_rest(pool, arena):
        if pool.segments:
            time.sleep(1.5)   # the rest registers for a while, as several GB do
        added(pool, arena)

    monkeypatch.setattr(_segments.Pool, "_add", slow_rest)
    numel, batch_size, workers = 3 * MB // 2 // 4 // 4, 4, 3    # batches of 1.5 MiB
    dl = DataLoader(_LateFirst(48, numel, batch_size, 2), batch_size=batch_size,
                    num_workers=workers, prefetch_factor=1, multiprocessing_context="fork")
    loader = fastpin.Loader(dl, device=None, zero_copy=True)
    block = batch_bytes(batch_size, numel)
    seen, held = [], []
    for b in loader:    # each batch dropped before the next: the pool holds those in flight
        for x, i in zip(b["x"], b["i"].tolist()):
            assert_same(x, expected(i, numel))
            seen.append(i)
        stage = loader._pool.segments[-1]   # the oldest
        held.append(stage.base <= b["x"].data_ptr() < stage.base + stage.capacity)
    assert sorted(seen) == list(range(48))
    assert loader.stats()["fallbacks"] == 0
    assert stage.capacity // block == 2, stage.capacity
    assert held[:2] == [True, True], held
    del b, loader, dl
