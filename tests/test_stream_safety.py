"""Stream safety: a fastpin block is reused only after every copy from it that
was queued before its tensors died has finished, on any stream of its device,
named or not (a side stream the user made, an ExternalStream, a prefetcher's).

The race, made deterministic: a side stream is busy with a long kernel; on it,
a non_blocking copy from a pinned batch is queued behind the kernel; the batch
dies; a new batch with another pattern is pinned at once into an arena that
has room for one batch only, so it must take the same block. The copy must
still read the first pattern. Before the fence over the whole context, the
free event went on the default stream only, and 50 of 50 such copies read the
second pattern (H200, 2026-12-01).

The GPU tests run on the GPU machine (scripts/gpu.sh); the bookkeeping of graph
captures is tested on the CPU too."""
import ctypes
import gc
import random
import threading
import time

import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C
from conftest import patterned as patterned_tensor
from conftest import sleep_cycles

MB = 1 << 20
no_gpu = pytest.mark.skipif(not (fastpin.cuda_available() and torch.cuda.is_available()),
                            reason="needs a CUDA GPU")
needs_gpu = [pytest.mark.gpu, no_gpu]


def patterned(nbytes, seed):
    return patterned_tensor((nbytes,), torch.uint8, seed)


def sleep_ms(ms):
    """Queue a kernel of about `ms` milliseconds on the current stream."""
    torch.cuda._sleep(sleep_cycles(ms))


def race(pin, stream, reps=20, nbytes=4 * MB, kernel_ms=10):
    """How many of `reps` side-stream copies read a batch pinned after theirs
    died (see the module's docstring). `pin` must reuse the block at once."""
    corrupt = 0
    for i in range(reps):
        first, second = patterned(nbytes, 2 * i + 1), patterned(nbytes, 2 * i + 2)
        x = pin(first)
        with torch.cuda.stream(stream):
            sleep_ms(kernel_ms)
            y = x.to("cuda", non_blocking=True)
        del x
        again = pin(second)
        stream.synchronize()
        corrupt += not torch.equal(y.cpu(), first)
        assert torch.equal(again, second)
        del again, y
    return corrupt


@pytest.fixture
def one_batch_arena():
    """A page-locked arena with room for one 4 MB batch: every pin reuses its block."""
    return _C.Arena(4 * MB)


@pytest.fixture
def tight_default_arena():
    """The default arenas capped at `capacity` and waiting for room, restored after."""
    from fastpin import _arena

    saved = (_arena.get_capacity(), _arena.policy())

    def set_cap(capacity):
        fastpin.configure(capacity=capacity, on_full="wait", wait_timeout=30)

    yield set_cap
    capacity, policy = saved
    fastpin.configure(capacity="auto" if capacity is None else capacity, on_full=policy["on_full"],
                      wait_timeout=policy["wait_timeout"])


def _raw_stream():
    """A stream made with the driver, outside torch (an ExternalStream's kind)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    torch.cuda.init()
    assert cuda.cuStreamCreate(ctypes.byref(handle), 1) == 0  # CU_STREAM_NON_BLOCKING
    return cuda, handle


class TestSideStreamRace:
    pytestmark = needs_gpu

    def test_fence_kind(self):
        # "sync" where the driver lacks cuCtxRecordEvent, or under FASTPIN_FENCE=sync.
        import os

        want = "sync" if os.environ.get("FASTPIN_FENCE") == "sync" else "event"
        assert fastpin.cuda_status().fence == want

    def test_pin_memory_side_stream_unnamed(self, one_batch_arena):
        side = torch.cuda.Stream()
        assert race(lambda t: fastpin.pin_memory(t, arena=one_batch_arena), side) == 0

    def test_pin_memory_external_stream_unnamed(self, one_batch_arena):
        cuda, handle = _raw_stream()
        try:
            ext = torch.cuda.ExternalStream(handle.value)
            assert race(lambda t: fastpin.pin_memory(t, arena=one_batch_arena), ext) == 0
        finally:
            torch.cuda.synchronize()
            cuda.cuStreamDestroy_v2(handle)

    def test_default_arena_side_stream(self, tight_default_arena):
        tight_default_arena(4 * MB)
        assert race(fastpin.pin_memory, torch.cuda.Stream()) == 0

    def test_named_stream_still_works(self, one_batch_arena):
        side = torch.cuda.Stream()
        pin = lambda t: fastpin.pin_memory(t, arena=one_batch_arena, stream=side)  # noqa: E731
        assert race(pin, side) == 0


# ---- the DataLoader's pin thread (install) and Loader(device=None) -----------

class Images(torch.utils.data.Dataset):
    """Sample i: `n` bytes that depend on i and on each byte's position, as
    `shape` (flat by default)."""

    def __init__(self, count, n, shape=None):
        self.count, self.n, self.shape = count, n, shape or (n,)

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return expected(torch.tensor([i]), self.n)[0].view(self.shape), i


def expected(index, n, device="cpu"):
    """The samples `index` (a 1-D tensor) of Images, computed on `device`."""
    pos = torch.arange(n, device=device, dtype=torch.int64)
    return ((pos[None, :] * 7 + index.to(device)[:, None] * 131 + 3) % 251).to(torch.uint8)


def side_stream_epoch(batches, n, kernel_ms, hold_s, stream):
    """Copy each batch on `stream` behind a long kernel, drop it, give the pin
    thread time to pin the next into its block, then check the copy."""
    corrupt = count = 0
    # No enumerate(): its reused result tuple would keep the last batch alive.
    it = iter(batches)
    while True:
        try:
            x, index = next(it)
        except StopIteration:
            break
        count += 1
        index = index.clone()  # the labels share the images' block: keep none of it
        with torch.cuda.stream(stream):
            sleep_ms(kernel_ms)
            y = x.to("cuda", non_blocking=True)
        del x
        time.sleep(hold_s)  # the producer runs into the freed block meanwhile
        stream.synchronize()
        corrupt += not torch.equal(y.view(y.shape[0], -1), expected(index, n, "cuda"))
        del y
    return corrupt, count


class TestPinnedByFastpinThreads:
    pytestmark = needs_gpu

    N = 1 * MB
    BATCH = 4
    ONE = BATCH * N + 64 * 1024  # room for one batch (images and labels), not two

    def loader(self, workers=1):
        return torch.utils.data.DataLoader(Images(48, self.N), batch_size=self.BATCH,
                                           num_workers=workers, pin_memory=True)

    def install(self, zero_copy, tight_default_arena, monkeypatch):
        """install() as each kind of batch gets it, with room for about one batch,
        so the next must reuse its block: pinned by copy in the pin thread (into
        the default arena), or zero-copy (the workers' shared pool, capped)."""
        tight_default_arena(self.ONE)
        if zero_copy:
            monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(2 * self.ONE))
        fastpin.install(zero_copy=zero_copy)

    @pytest.mark.parametrize("zero_copy", [False, True])
    def test_install_pin_thread_side_stream(self, zero_copy, tight_default_arena, monkeypatch):
        self.install(zero_copy, tight_default_arena, monkeypatch)
        try:
            corrupt, n = side_stream_epoch(self.loader(), self.N, 100, 0.08, torch.cuda.Stream())
        finally:
            fastpin.uninstall()
        assert n == 12 and corrupt == 0

    @pytest.mark.parametrize("zero_copy", [False, True])
    def test_install_pin_thread_external_stream(self, zero_copy, tight_default_arena,
                                                monkeypatch):
        cuda, handle = _raw_stream()
        self.install(zero_copy, tight_default_arena, monkeypatch)
        try:
            ext = torch.cuda.ExternalStream(handle.value)
            corrupt, n = side_stream_epoch(self.loader(), self.N, 100, 0.08, ext)
        finally:
            fastpin.uninstall()
            torch.cuda.synchronize()
            cuda.cuStreamDestroy_v2(handle)
        assert n == 12 and corrupt == 0

    def test_loader_host_mode_side_stream(self, tight_default_arena):
        tight_default_arena(self.ONE)
        dl = torch.utils.data.DataLoader(Images(48, self.N), batch_size=self.BATCH, num_workers=1)
        # The copying Loader (zero-copy has its own test below), in the tight default arena.
        corrupt, n = side_stream_epoch(fastpin.Loader(dl, device=None, depth=1, zero_copy=False),
                                       self.N, 100, 0.08, torch.cuda.Stream())
        assert n == 12 and corrupt == 0

    def test_loader_host_mode_external_stream(self, tight_default_arena):
        tight_default_arena(self.ONE)
        cuda, handle = _raw_stream()
        try:
            ext = torch.cuda.ExternalStream(handle.value)
            dl = torch.utils.data.DataLoader(Images(48, self.N), batch_size=self.BATCH,
                                             num_workers=1)
            corrupt, n = side_stream_epoch(fastpin.Loader(dl, device=None, depth=1,
                                                          zero_copy=False), self.N, 100, 0.08, ext)
        finally:
            torch.cuda.synchronize()
            cuda.cuStreamDestroy_v2(handle)
        assert n == 12 and corrupt == 0

    def test_zero_copy_host_batches_side_stream(self):
        dl = torch.utils.data.DataLoader(Images(48, self.N), batch_size=self.BATCH,
                                         num_workers=1)
        # Room for about two batches: workers wait on blocks the main process frees.
        loader = fastpin.Loader(dl, device=None, depth=1, zero_copy=True,
                                capacity=3 * self.BATCH * self.N)
        corrupt, n = side_stream_epoch(loader, self.N, 100, 0.08, torch.cuda.Stream())
        assert n == 12 and corrupt == 0


@pytest.mark.gpu
@no_gpu
@pytest.mark.timeout(600)
def test_stress_timm_prefetcher_over_install(tight_default_arena):
    """install() under timm's PrefetchLoader (its own side stream), a small
    arena so blocks are reused all the time, random compute: 5,000 patterned
    batches, every one exact."""
    timm_loader = pytest.importorskip("timm.data.loader")
    n, batch = 3 * 32 * 32, 16
    # Room for 16 batches: more than the workers keep in flight (4 x 2) plus
    # the prefetcher's, so the pin thread never waits for a batch behind it.
    tight_default_arena(16 * (batch * n + 4096))
    ds = Images(5000 * batch, n, (3, 32, 32))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=4, pin_memory=True,
                                     persistent_workers=False)
    fastpin.install()
    rng = random.Random(12)
    corrupt = seen = 0
    try:
        # mean 0, std 1/255: timm multiplies both by 255, so x comes back as float(x).
        loader = timm_loader.PrefetchLoader(dl, mean=(0.0, 0.0, 0.0), std=(1 / 255,) * 3,
                                            channels=3, device=torch.device("cuda"))
        for x, index in loader:
            sleep_ms(rng.random() * 2)  # the step's compute, of random length
            got = x.view(x.shape[0], -1).round().to(torch.uint8)
            corrupt += not torch.equal(got, expected(index, n, "cuda"))
            seen += 1
    finally:
        fastpin.uninstall()
    assert seen == 5000 and corrupt == 0


# ---- graph captures ------------------------------------------------------------

def test_capture_count_brackets_captures():
    """capture_begin/capture_end nest and never go below zero."""
    base = _C.captures()
    _C.capture_begin()
    _C.capture_begin()
    assert _C.captures() == base + 2
    _C.capture_end()
    _C.capture_end()
    _C.capture_end()  # one too many: stays at zero
    assert _C.captures() == max(base - 1, 0)


def test_graph_wrapper_counts_only_captures_it_saw_begin():
    class Graph:
        def __init__(self, fail=False):
            self.fail = fail

        def capture_begin(self, *args, **kwargs):
            if self.fail:
                raise RuntimeError("capture_begin failed")

        def capture_end(self):
            pass

    from fastpin import _graphs

    _graphs._wrap(Graph)
    base = _C.captures()
    g = Graph()
    g.capture_begin()
    assert _C.captures() == base + 1
    g.capture_end()
    assert _C.captures() == base
    bad = Graph(fail=True)
    with pytest.raises(RuntimeError):
        bad.capture_begin()
    assert _C.captures() == base
    bad.capture_end()  # as torch.cuda.graph's __exit__ does after a failed begin
    assert _C.captures() == base


@pytest.mark.gpu
@no_gpu
def test_graph_capture_while_blocks_die():
    """A block freed while torch captures a CUDA graph must not break the
    capture (a context-wide fence would invalidate it); its fence is recorded
    once the capture ends, before the block is reused."""
    arena = _C.Arena(8 * MB)
    pinned = [fastpin.pin_memory(patterned(MB, k), arena=arena) for k in range(4)]
    static = torch.arange(1024, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        assert _C.captures() == 1
        out = static * 2 + 1
        del pinned[:2]  # freed during the capture: the fence is deferred
        gc.collect()
    assert _C.captures() == 0
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, static * 2 + 1)
    del pinned[:]
    torch.cuda.synchronize()
    # A ticket fence (FASTPIN_FENCE=sync) completes once its thread has synced
    # the context, a little after the GPU is idle: give it a few seconds.
    deadline = time.monotonic() + 5
    while True:
        arena.collect()
        if arena.stats()["blocks_in_use"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert arena.stats()["blocks_in_use"] == 0


@pytest.mark.gpu
@no_gpu
def test_deferred_fence_from_another_thread():
    """A free on another thread during a capture defers its fence too; the
    arena then says it is full rather than wait on a fence it cannot record
    yet, and once the capture is over the block is fenced and reused."""
    arena = _C.Arena(MB)
    holder = [fastpin.pin_memory(patterned(MB, 9), arena=arena)]
    _C.capture_begin()
    try:
        t = threading.Thread(target=holder.clear)  # the deleter runs there
        t.start()
        t.join()
        with pytest.raises(fastpin.ArenaFullError, match="graph capture"):
            arena.alloc(MB)
    finally:
        _C.capture_end()
    block = arena.alloc(MB)  # fenced now, then waited for
    assert block.nbytes == MB
