"""Loader.stats(): reading it makes (and page-locks) nothing, and every batch
that fell back is counted in the mode where it fell back."""
import gc

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _arena, _C

from conftest import assert_same, patterned

pytestmark = pytest.mark.timeout(120)


def expected(i):
    return patterned((16, 16), torch.float32, seed=i)


class Samples(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"x": expected(i), "i": i}


def check(batches):
    seen = []
    for b in batches:
        for x, i in zip(b["x"], b["i"].tolist()):
            assert_same(x, expected(i))
            seen.append(i)
    assert sorted(seen) == list(range(24))


@pytest.fixture
def no_default_arena(monkeypatch):
    """This process has made no default arena (the suite's own is put back after)."""
    monkeypatch.setattr(_arena, "_arenas", {})
    return _arena._arenas


@pytest.mark.parametrize("device", ["cpu", None])
def test_stats_makes_no_arena(device, no_default_arena):
    loader = fastpin.Loader(DataLoader(Samples(), batch_size=4), device=device)
    stats = loader.stats()
    assert not no_default_arena, "stats() made the default arena"
    assert stats["batches"] == 0 and stats["fallbacks"] == 0
    assert stats["pool_capacity"] == 0 and stats["pool_high_water"] == 0


def test_cpu_loader_stats_after_an_epoch_makes_no_arena(no_default_arena):
    loader = fastpin.Loader(DataLoader(Samples(), batch_size=4), device="cpu")
    check(loader)
    assert loader.stats()["batches"] == 6
    assert not no_default_arena


def test_host_mode_fallbacks_are_counted():
    # An arena smaller than one batch: every batch is pinned the ordinary way.
    arena = _C.Arena(4096, cuda=False)
    loader = fastpin.Loader(DataLoader(Samples(), batch_size=4), device=None, arena=arena)
    batches = list(loader)
    check(batches)
    assert loader.stats()["fallbacks"] == 6
    assert arena.stats()["blocks_in_use"] == 0
    del batches
    gc.collect()


def test_host_mode_counts_only_the_batches_that_fell_back():
    # Room for two batches: those kept alive fill it, the rest fall back.
    one = 4 * 16 * 16 * 4 + 8 * 4
    arena = _C.Arena(2 * _C.block_size(one), cuda=False)
    loader = fastpin.Loader(DataLoader(Samples(), batch_size=4), device=None, arena=arena, depth=1)
    batches = list(loader)
    check(batches)
    in_arena = sum(arena.base <= b["x"].data_ptr() < arena.base + arena.capacity for b in batches)
    assert 1 <= in_arena <= 2
    assert loader.stats()["fallbacks"] == 6 - in_arena


@pytest.mark.parametrize("device", ["cpu", None])
def test_no_pin_rate_when_nothing_was_pinned(device):
    # Bug: host_to_pinned_gbps was reported when nothing was pinned: 0.0 before the
    # first batch, and for a "cpu" Loader, which pins nothing, a rate of passing
    # batches through.
    loader = fastpin.Loader(DataLoader(Samples(), batch_size=4), device=device)
    assert loader.stats()["host_to_pinned_gbps"] is None
    check(loader)
    stats = loader.stats()
    assert stats["batches"] == 6
    if device == "cpu":
        assert stats["host_to_pinned_gbps"] is None
    else:
        assert stats["host_to_pinned_gbps"] > 0
