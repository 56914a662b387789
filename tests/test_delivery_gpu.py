"""The delivery engine on a GPU: install(device="cuda") and Loader(device) give
every batch exact against stock, on the device, ready on the consumer's
stream and whole for every other stream; nothing is left behind (device
memory, blocks, descriptors, threads) however the iterator ends. The same
engine without a GPU is tested in tests/test_delivery.py."""
from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import fastpin
from fastpin import _ahead
from conftest import assert_same, open_cuda, sleep_cycles, workers_gone
from test_install import (
    FORK_WARNING, BATCH, Named, PatternDataset, collate_pair, expected_batches, seeded,
    stock_epochs,
)
from test_stream_safety import Images, expected
from test_zero_copy_reuse import nothing_left_behind  # noqa: F401 - a fixture

gpu_here = fastpin.cuda_available() and torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings(FORK_WARNING),
              pytest.mark.skipif(not gpu_here, reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True, scope="module")
def cuda_ready():
    open_cuda()  # the driver's own descriptors, before any test counts them


def on_gpu(batch):
    """Every tensor leaf of `batch` on the GPU, and .to() of it a no-op."""
    leaves = [v for v in (batch.values() if isinstance(batch, dict) else batch)
              if isinstance(v, torch.Tensor)]
    assert leaves and all(t.is_cuda for t in leaves)
    assert all(t.to("cuda", non_blocking=True) is t for t in leaves)


def assert_batch_gpu(out, ref):
    assert type(out) is dict and list(out) == list(ref)
    on_gpu(out)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert_same(out[key].cpu(), value)
        elif isinstance(value, np.ndarray):
            np.testing.assert_array_equal(out[key].cpu().numpy(), value)
        else:
            assert out[key] == value, key


@pytest.fixture(params=["install", "loader", "loader_copy"])
def delivered(request):
    """A function dl -> the iterable of its batches on the GPU, by install(device),
    by Loader(device) or by the copying Loader (whose view of a DataLoader with
    workers has the pin thread pin each batch into fastpin's arena)."""
    if request.param == "install":
        fastpin.install(device="cuda")
        yield lambda dl: dl
        fastpin.uninstall()
    elif request.param == "loader":
        yield lambda dl: fastpin.Loader(dl, device="cuda")
    else:
        yield lambda dl: fastpin.Loader(dl, device="cuda", zero_copy=False)


def settled_memory(baseline, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        torch.cuda.synchronize()
        if torch.cuda.memory_allocated() <= baseline:
            return True
        time.sleep(0.05)
    return False


# ---- exact against stock ----------------------------------------------------------

@pytest.mark.parametrize("method,persistent", [("fork", False), ("fork", True), ("spawn", False),
                                               ("forkserver", True)])
def test_exact_against_stock(method, persistent, delivered, nothing_left_behind):
    ds = PatternDataset(n=22, seed=7)
    dl = seeded(ds, 11, num_workers=2, pin_memory=True, multiprocessing_context=method,
                persistent_workers=persistent)
    source = delivered(dl)
    for refs in stock_epochs(ds, 11, persistent):
        for out, ref in zip(source, refs, strict=True):
            assert_batch_gpu(out, ref)
    del source, dl


def test_structures_and_custom_collate(delivered):
    ds = Named()
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True, collate_fn=collate_pair)
    refs = [collate_pair([ds[i] for i in range(b, min(b + 4, len(ds)))])
            for b in range(0, len(ds), 4)]
    for out, ref in zip(delivered(dl), refs, strict=True):
        assert type(out["pair"]) is type(ref["pair"]) and out["pair"].image.is_cuda
        assert_same(out["pair"].image.cpu(), ref["pair"].image)
        assert_same(out["pair"].label.cpu(), ref["pair"].label)
        assert out["tags"] == ref["tags"]
        np.testing.assert_array_equal(out["array"].cpu().numpy(), ref["array"])


@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_uneven_last_batches(in_order, delivered):
    from test_delivery import Shards

    dl = DataLoader(Shards(), batch_size=3, num_workers=2, pin_memory=True, in_order=in_order)
    stock = sorted(tuple(b["x"][:, 0].tolist())
                   for b in DataLoader(Shards(), batch_size=3, num_workers=2, in_order=in_order))
    got = []
    for b in delivered(dl):
        assert b["x"].is_cuda
        got.append(tuple(b["x"][:, 0].tolist()))
    assert sorted(got) == stock


def test_install_objects_pin_themselves():
    from test_delivery import SelfPinning, WithObjects, collate_objects

    SelfPinning.pinned = 0
    fastpin.install(device="cuda")
    try:
        dl = DataLoader(WithObjects(), batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=collate_objects)
        got = list(dl)
    finally:
        fastpin.uninstall()
    assert [b["obj"].value for b in got] == [1006, 1022] and SelfPinning.pinned == 2
    assert all(b["x"].is_cuda for b in got)


def test_install_current_device_when_the_iterator_is_made():
    fastpin.install(device="cuda")
    try:
        it = iter(DataLoader(PatternDataset(n=8), batch_size=4, num_workers=1, pin_memory=True))
        assert it._fastpin_ahead.step.inner.device == torch.device("cuda",
                                                                   torch.cuda.current_device())
        del it
    finally:
        fastpin.uninstall()


# ---- stream safety ----------------------------------------------------------------

N, PER = 3 * 32 * 32, 16


def small_pool(monkeypatch):
    """A shared arena with room for a few batches: blocks are reused at once."""
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(24 * (PER * N + 4096)))


def image_loader(count, workers=4):
    return DataLoader(Images(count * PER, N, (3, 32, 32)), batch_size=PER, num_workers=workers,
                      pin_memory=True)


def side_stream_prefetcher(source):
    """timm's PrefetchLoader: each batch normalised on a side stream that does not
    wait on the current stream (its .to() a no-op for a batch on the GPU), the
    current stream made to wait on the side stream before the batch is used."""
    stream = torch.cuda.Stream()
    first, current = True, None
    for x, index in source:
        with torch.cuda.stream(stream):
            nxt = (x.to("cuda", non_blocking=True).float() + 0.0, index.to("cuda", non_blocking=True))
        if not first:
            yield current
        first = False
        torch.cuda.current_stream().wait_stream(stream)
        current = nxt
    if not first:
        yield current


@pytest.mark.timeout(600)
def test_side_stream_prefetcher_on_top(delivered, monkeypatch):
    small_pool(monkeypatch)
    rng = random.Random(3)
    corrupt = seen = 0
    for x, index in side_stream_prefetcher(delivered(image_loader(3000))):
        torch.cuda._sleep(sleep_cycles(rng.random() * 2))
        got = x.view(x.shape[0], -1).round().to(torch.uint8)
        corrupt += not torch.equal(got, expected(index, N, "cuda"))
        seen += 1
    assert seen == 3000 and corrupt == 0


def test_external_stream_consumer(delivered, monkeypatch):
    import ctypes

    small_pool(monkeypatch)
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    torch.cuda.init()
    assert cuda.cuStreamCreate(ctypes.byref(handle), 1) == 0
    corrupt = seen = 0
    try:
        ext = torch.cuda.ExternalStream(handle.value)
        with torch.cuda.stream(ext):
            for x, index in delivered(image_loader(500)):
                torch.cuda._sleep(sleep_cycles(1))
                corrupt += not torch.equal(x.view(x.shape[0], -1), expected(index, N, "cuda"))
                seen += 1
                del x, index   # freed while the next copies are in flight
    finally:
        torch.cuda.synchronize()
        cuda.cuStreamDestroy_v2(handle)
    assert seen == 500 and corrupt == 0


def test_loop_switches_its_current_stream(delivered, monkeypatch):
    small_pool(monkeypatch)
    streams = [torch.cuda.Stream() for _ in range(3)]
    rng = random.Random(5)
    corrupt = seen = 0
    it = iter(delivered(image_loader(1000)))
    while True:
        stream = rng.choice(streams + [torch.cuda.default_stream()])
        with torch.cuda.stream(stream):
            try:
                x, index = next(it)
            except StopIteration:
                break
            torch.cuda._sleep(sleep_cycles(rng.random()))
            corrupt += not torch.equal(x.view(x.shape[0], -1), expected(index, N, "cuda"))
            seen += 1
            del x, index
    assert seen == 1000 and corrupt == 0


# ---- nothing left behind ------------------------------------------------------------

@pytest.mark.parametrize("end", ["stop", "del", "break", "shutdown"])
def test_device_memory_returned(end, nothing_left_behind):
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    fastpin.install(device="cuda")
    try:
        dl = image_loader(40, workers=2)
        batch_bytes = PER * N + PER * 8
        it = iter(dl)
        x, index = next(it)
        # Held: the batch handed over and those prepared ahead (depth 2), each a
        # whole block of the caching allocator's rounding.
        assert torch.cuda.memory_allocated() - baseline <= 4 * (batch_bytes + (2 << 20))
        del x, index
        if end == "stop":
            for last in it:
                pass
            del last  # the loop's name holds the last batch
        elif end == "del":
            del it
        elif end == "break":
            for last in it:
                break
            del last
            it = None
            gc.collect()
        else:
            it._shutdown_workers()
            assert not it._fastpin_ahead.pending
        assert settled_memory(baseline)
        it = None
    finally:
        fastpin.uninstall()
    assert not [t for t in threading.enumerate() if t.name.startswith("fastpin-loader")]


def test_killed_worker(nothing_left_behind):
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    fastpin.install(device="cuda")
    try:
        dl = image_loader(400, workers=2)
        it = iter(dl)
        next(it)
        os.kill(it._workers[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited unexpectedly|killed by signal"):
            for _ in range(400):
                next(it)
        del it
        assert settled_memory(baseline)
    finally:
        fastpin.uninstall()


def test_ctrl_c_while_waiting():
    """Ctrl-C in next() while the workers are slow: raised at once, and the
    iterator, dropped, leaves nothing behind."""
    import _thread

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    fastpin.install(device="cuda")
    try:
        it = iter(DataLoader(SlowImages(), batch_size=4, num_workers=2, pin_memory=True))
        next(it)
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in range(100):
                next(it)
        workers = list(it._workers)
        del it
        assert workers_gone(workers)
        assert settled_memory(baseline)
    finally:
        fastpin.uninstall()


class SlowImages(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.2)
        return torch.full((1024,), i, dtype=torch.int32)


def test_interpreter_exit_mid_epoch():
    code = textwrap.dedent("""
        import torch, fastpin
        from torch.utils.data import DataLoader, Dataset
        class D(Dataset):
            def __len__(self): return 10_000
            def __getitem__(self, i): return torch.full((3, 64, 64), i % 251, dtype=torch.uint8)
        fastpin.install(device="cuda")
        dl = DataLoader(D(), batch_size=64, num_workers=4, pin_memory=True)
        it = iter(dl)
        for k, b in enumerate(it):
            assert b.is_cuda
            if k == 20:
                break
        print("ok", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_uninstall_mid_epoch_and_two_loaders():
    train_ds, val_ds = PatternDataset(n=24, seed=1), PatternDataset(n=16, seed=2)
    fastpin.install(device="cuda")
    try:
        train = DataLoader(train_ds, batch_size=BATCH, num_workers=2, pin_memory=True)
        val = DataLoader(val_ds, batch_size=BATCH, num_workers=1, pin_memory=True)
        it = iter(train)
        refs = expected_batches(train_ds)
        assert_batch_gpu(next(it), refs[0])
        for out, ref in zip(val, expected_batches(val_ds), strict=True):
            assert_batch_gpu(out, ref)
    finally:
        fastpin.uninstall()
    for out, ref in zip(it, refs[1:], strict=True):
        assert_batch_gpu(out, ref)
    stock = next(iter(train))
    assert not stock["image"].is_cuda and stock["image"].is_pinned()


def test_stock_default_collate_unchanged():
    fastpin.install(device="cuda")
    try:
        dl = DataLoader(PatternDataset(n=8), batch_size=4, num_workers=1, pin_memory=True)
        list(dl)
        assert dl.collate_fn is default_collate
        it = iter(dl)
        assert isinstance(it, _ahead.Delivering)
        del it
    finally:
        fastpin.uninstall()
