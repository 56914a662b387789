"""The index queues of the DataLoader iterators fastpin makes or is installed
into: each message is written into the worker's pipe by the thread that puts
it, where the pipe has room for all of it, instead of waking a feeder thread
per batch (torch's multiprocessing.Queue); what cannot be written at once goes
through the feeder, in order, and nothing blocks."""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _install

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
    assert all(type(q) is not _install.IndexQueue for q in it._index_queues)


def test_a_full_pipe_never_blocks_and_order_holds():
    q = multiprocessing.get_context("fork").Queue()
    q.cancel_join_thread()
    q.__class__ = _install.IndexQueue
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
