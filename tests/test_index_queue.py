"""The index queues of the DataLoader iterators fastpin makes or is installed
into: each message is written into the worker's pipe by the thread that puts
it, where the pipe has room for all of it, instead of waking a feeder thread
per batch (torch's multiprocessing.Queue); what cannot be written at once goes
through the feeder, in order, and nothing blocks."""
from __future__ import annotations

import multiprocessing
import multiprocessing.reduction
import os
import queue
import struct
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _queues

FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"


class Indexed(Dataset):
    """Item i: a tensor whose values depend on i and their position."""

    def __init__(self, n: int = 96):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.arange(16, dtype=torch.int64) * 1000 + i


def feeders() -> set:
    return {t for t in threading.enumerate() if t.name == "QueueFeederThread"}


def expected(batch: int, n: int = 96) -> list:
    return [torch.stack([Indexed(n)[i] for i in range(k, min(k + batch, n))])
            for k in range(0, n, batch)]


@pytest.fixture
def installed():
    fastpin.install()
    yield
    fastpin.uninstall()


def _iterate(loader) -> tuple:
    """(batches, the iterator's index queues, feeder threads started meanwhile)."""
    before = feeders()
    it = iter(loader)
    out = [b["x"] if isinstance(b, dict) else b for b in it]
    return out, list(getattr(getattr(it, "_iterator", it), "_index_queues", [])), feeders() - before


def _assert_batches(out: list, batch: int, n: int = 96) -> None:
    want = expected(batch, n)
    assert len(out) == len(want)
    for got, ref in zip(out, want):
        assert torch.equal(got.cpu(), ref)


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.filterwarnings("ignore:.*pin_memory.*no accelerator:UserWarning")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_an_installed_iterator_sends_indices_without_a_feeder_thread(installed, method):
    loader = DataLoader(Indexed(), batch_size=8, num_workers=2, pin_memory=True,
                        multiprocessing_context=method)
    it = iter(loader)
    before = feeders()
    out = list(it)
    _assert_batches(out, 8)
    assert it._index_queues and all(q._thread is None for q in it._index_queues)
    assert not feeders() - before


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_loader_sends_indices_without_a_feeder_thread(zero_copy):
    loader = DataLoader(Indexed(), batch_size=8, num_workers=2)
    before = feeders()
    out = list(fastpin.Loader(loader, device=None, zero_copy=zero_copy))
    _assert_batches(out, 8)
    assert not feeders() - before


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.filterwarnings("ignore:.*pin_memory.*no accelerator:UserWarning")
def test_indices_longer_than_a_pipe_go_through_the_feeder_in_order(installed):
    # 20,000 indices a batch pickle to about 80 KB, more than a pipe holds.
    n = 60_000
    loader = DataLoader(Indexed(n), batch_size=20_000, num_workers=2, pin_memory=True,
                        persistent_workers=True)
    for _ in range(2):
        _assert_batches(list(loader), 20_000, n)


@pytest.mark.filterwarnings(FORK_WARNING)
def test_plain_iteration_keeps_torchs_queues():
    loader = DataLoader(Indexed(), batch_size=8, num_workers=2)
    it = iter(loader)
    _assert_batches(list(it), 8)
    assert all(type(q) is not _queues.IndexQueue for q in it._index_queues)


def test_a_full_pipe_never_blocks_and_order_holds():
    q = multiprocessing.get_context("fork").Queue()
    q.cancel_join_thread()
    q.__class__ = _queues.IndexQueue
    messages = [(k, list(range(k % 7 * 300))) for k in range(400)]  # about 700 KB in all
    done = threading.Event()

    def put_all():
        for m in messages:
            q.put(m)
        done.set()

    threading.Thread(target=put_all, daemon=True).start()
    # Nobody reads yet: the pipe fills, and the rest must go to the feeder.
    assert done.wait(60), "put() blocked on a full pipe"
    assert q._thread is not None
    assert [q.get(timeout=10) for _ in messages] == messages
    q.close()


# ---- result queues: the main process only wakes their reader -----------------

def result_queue():
    q = multiprocessing.get_context("fork").Queue()
    q.__class__ = _queues.ResultQueue
    return q


def test_a_wake_up_reaches_the_reader_without_a_feeder_thread():
    q, before = result_queue(), feeders()
    q.put((None, None))
    assert q.get(timeout=10) == (None, None)  # and the queue's count of messages holds
    q.put((7, "x"))
    assert q.get(timeout=10) == (7, "x")
    assert feeders() <= before
    q.close()
    assert q._reader.closed and q._writer.closed  # no feeder to close them


def test_no_wake_up_while_a_writer_holds_the_lock():
    """A worker writing wakes the reader itself; one that died holding the lock
    leaves it held for good, and waiting on it would never end."""
    q, before = result_queue(), feeders()
    assert q._wlock.acquire(timeout=10)
    try:
        assert not _queues.wake(q, None)
        q.put((None, None))  # returns at once, starts nothing
        assert feeders() <= before
        assert not q._reader.poll(0.2)
    finally:
        q._wlock.release()
    assert _queues.wake(q, ("next", 1))  # the lock free again
    assert q.get(timeout=10) == ("next", 1)
    q.close()


def test_no_wake_up_into_a_full_pipe():
    """The reader of a full pipe has plenty to read: wake() never blocks there,
    and what is in the pipe stays whole."""
    q = result_queue()
    fd = os.open(f"/proc/self/fd/{q._writer.fileno()}", os.O_WRONLY | os.O_NONBLOCK)
    messages = []
    try:
        # Fill it as workers would, one whole message a write: messages of 1 KB,
        # then of the wake-up's own size, until not one more fits.
        for size in (1000, None):
            while True:
                m = None if size is None else (len(messages), bytes([len(messages) % 251]) * size)
                data = multiprocessing.reduction.ForkingPickler.dumps(m)
                q._sem.acquire()
                try:
                    os.write(fd, struct.pack("!i", len(data)) + bytes(data))
                except BlockingIOError:
                    q._sem.release()
                    break
                messages.append(m)
    finally:
        os.close(fd)
    before, done = feeders(), threading.Event()
    assert not _queues.wake(q, None)
    threading.Thread(target=lambda: (q.put((None, None)), done.set()), daemon=True).start()
    assert done.wait(10), "put() blocked on a full pipe"
    assert feeders() <= before
    assert [q.get(timeout=10) for _ in messages] == messages
    assert not q._reader.poll(0.2)
    q.close()


def test_without_proc_a_wake_up_goes_only_into_an_empty_pipe(monkeypatch):
    """Where /proc/self/fd cannot be opened, the pipe's room is not known but
    when it is empty."""
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(_queues.os, "open", no_proc)
    q = result_queue()
    assert _queues.wake(q, ("first", 1))
    assert not _queues.wake(q, ("second", 2))  # one message unread
    assert q.get(timeout=10) == ("first", 1)
    assert _queues.wake(q, ("third", 3))
    assert q.get(timeout=10) == ("third", 3)
    assert not q._reader.poll(0.2)
    q.close()


def test_get_with_a_timeout_as_multiprocessing_has_it():
    """torch's get(timeout=...) on the result queue: every message in order,
    from a writer in another process, then Empty once none comes."""
    q = result_queue()
    messages = [(k, bytes([k % 251]) * (k * 37 % 5000)) for k in range(300)]

    def write_all():
        for m in messages:
            with q._wlock:
                q._sem.acquire()
                q._writer.send_bytes(multiprocessing.reduction.ForkingPickler.dumps(m))

    writer = multiprocessing.get_context("fork").Process(target=write_all)
    writer.start()
    try:
        assert [q.get(timeout=30) for _ in messages] == messages
    finally:
        writer.join(30)
    assert writer.exitcode == 0
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    with pytest.raises(queue.Empty):
        q.get(False)  # multiprocessing's own path
    q.close()


def test_a_wake_up_too_large_for_one_atomic_write_is_refused():
    q = result_queue()
    with pytest.raises(ValueError, match="wake-up message"):
        _queues.wake(q, b"x" * 5000)
    q.close()
