"""install(): a batch a worker cannot place in the shared pool (full: the loop
keeps its batches) goes the ordinary way, and is counted in fastpin.stats()
and warned about once, with the pool's size, what holds it and the fix. The
count lived only in the pool, and nothing was said."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _zerocopy
from fastpin._runtime import process

from conftest import assert_same, patterned

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings(
    "ignore:.pin_memory. argument is set as true but no accelerator:UserWarning")]
BATCH, SAMPLES = 4, 80
SHAPE = (64, 1024)   # 256 KiB a sample, 1 MiB a batch


class Patterned(Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return patterned(SHAPE, torch.float32, seed=i)


@pytest.fixture
def installed_small(monkeypatch):
    # A pool that grows to 4 MiB at most: the loop below keeps every batch.
    monkeypatch.setenv("FASTPIN_ZERO_COPY_MAX_BYTES", str(4 << 20))
    fastpin.install()
    yield
    fastpin.uninstall()


def test_install_fallbacks_are_counted_and_warned_once(installed_small, caplog):
    dl = DataLoader(Patterned(), batch_size=BATCH, num_workers=2, pin_memory=True)
    before = fastpin.stats()["fallbacks"]
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        kept = list(dl)   # every batch alive at once: the pool fills
        pool = process.installed_pools[dl][1]
        fell_back = pool.stats()["fallbacks"]
        assert fell_back > 0, "the test needs batches that fall back"
        for n, batch in enumerate(kept):
            ids = range(n * BATCH, (n + 1) * BATCH)
            assert_same(batch, torch.stack([patterned(SHAPE, torch.float32, seed=i) for i in ids]))
        assert fastpin.stats()["fallbacks"] - before == fell_back
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    full = [m for m in warned if "full" in m]
    assert len(full) == 1, warned
    assert str(pool.capacity) in full[0] or f"{pool.capacity / 1e6:.0f} MB" in full[0], full[0]
    assert "FASTPIN_ZERO_COPY_MAX_BYTES" in full[0], full[0]
    del kept
