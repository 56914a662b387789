"""Every warning's advice names a knob that exists and would help. When the
driver refused to page-lock the shared arena, the Loader's warning about the
batches that then fell back said "raise max_capacity", which cannot help: the
pool was nowhere near its cap."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin

from conftest import assert_same, patterned

pytestmark = pytest.mark.timeout(120)
BATCH = 4


class Patterned(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return patterned((32, 32), torch.float32, seed=i)


def test_a_refused_registration_advises_the_locked_memory_limit(monkeypatch, caplog):
    from fastpin import _arena

    make = _arena.make_arena

    def refuse(nbytes, **kw):
        if kw.get("shared"):  # the shared arena's segments; the staging arena is made
            raise fastpin.CudaError(f"out of memory (registering {nbytes} bytes)")
        return make(nbytes, **kw)

    monkeypatch.setattr(_arena, "make_arena", refuse)
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=BATCH, num_workers=2), device=None)
    assert loader.zero_copy
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        for n, batch in enumerate(loader):
            ids = range(n * BATCH, (n + 1) * BATCH)
            assert_same(batch, torch.stack([patterned((32, 32), torch.float32, seed=i)
                                            for i in ids]))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned  # the refusal, then the first fallback
    for message in warned:
        assert "max_capacity" not in message and "capacity=" not in message, message
        assert "ulimit -l" in message, message
    assert loader.stats()["fallbacks"] == 4
