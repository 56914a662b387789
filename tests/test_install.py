"""fastpin.install() with a real DataLoader and its pin thread, and
fastpin.collate as a DataLoader collate_fn."""
from __future__ import annotations

import collections
import os
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils import pin_memory as torch_pin_module

import fastpin
from conftest import assert_same, in_arena, patterned, tensor_bytes

FORK_WARNING = "ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning"
WORKER_WARNING = "fastpin.collate in a DataLoader worker"
N_SAMPLES, BATCH = 40, 4


class PatternDataset(Dataset):
    """Map-style: item i is a dict of tensors whose patterns depend on i."""

    def __init__(self, n=N_SAMPLES, seed=0):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.seed * 100_000 + i * 10
        return {
            "image": patterned((3, 8, 8), torch.float32, s),
            "label": torch.tensor(i + 1),
            "tokens": patterned((6,), torch.int64, s + 1),
            "mask": patterned((6,), torch.bool, s + 2),
            "view": patterned((5, 4), torch.int16, s + 3).t(),   # non-contiguous sample
            "array": patterned((3,), np.float64, s + 4),
            "name": f"item-{i}",
        }


def expected_batches(ds, batch_size=BATCH):
    return [default_collate([ds[i] for i in range(b, min(b + batch_size, len(ds)))])
            for b in range(0, len(ds), batch_size)]


def assert_batch(out, ref):
    assert type(out) is dict and list(out) == list(ref)
    for key, value in ref.items():
        if isinstance(value, torch.Tensor):
            assert_same(out[key], value)
        else:
            assert out[key] == value, key


def tensor_leaves(batch):
    return [v for v in batch.values() if isinstance(v, torch.Tensor)]


@pytest.fixture
def installed():
    original = torch_pin_module.pin_memory
    fastpin.install()
    yield original
    fastpin.uninstall()
    assert torch_pin_module.pin_memory is original


# ---- install / uninstall ----------------------------------------------------

def test_install_uninstall_state():
    original = torch_pin_module.pin_memory
    assert original is not fastpin.pin_memory
    assert not fastpin.installed()
    try:
        fastpin.install()
        assert fastpin.installed()
        assert torch_pin_module.pin_memory is fastpin.pin_memory
        fastpin.install()                                   # idempotent
        assert fastpin.installed()
        assert torch_pin_module.pin_memory is fastpin.pin_memory
    finally:
        fastpin.uninstall()
    assert not fastpin.installed()
    assert torch_pin_module.pin_memory is original         # torch's own, not fastpin's
    fastpin.uninstall()                                     # harmless when not installed
    assert torch_pin_module.pin_memory is original


@pytest.mark.filterwarnings(FORK_WARNING)
def test_dataloader_pin_thread_goes_through_fastpin(accelerator, installed):
    ds = PatternDataset(seed=1)
    refs = expected_batches(ds)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    before = fastpin.stats()
    arena = fastpin.default_arena()
    n = 0
    for out, ref in zip(loader, refs, strict=True):
        assert_batch(out, ref)
        for t in tensor_leaves(out):
            assert in_arena(t, arena)                       # pinned by fastpin
        n += 1
    after = fastpin.stats()
    assert n == len(refs) == N_SAMPLES // BATCH
    assert after["batches"] >= before["batches"] + n
    assert after["leaves"] >= before["leaves"] + n * 6
    # A second epoch starts a new pin thread, through fastpin again.
    for out, ref in zip(loader, refs, strict=True):
        assert_batch(out, ref)
    assert fastpin.stats()["batches"] >= after["batches"] + n


def test_dataloader_single_process_goes_through_fastpin(accelerator, installed):
    ds = PatternDataset(n=12, seed=2)
    before = fastpin.stats()["batches"]
    loader = DataLoader(ds, batch_size=5, num_workers=0, pin_memory=True)
    for out, ref in zip(loader, expected_batches(ds, 5), strict=True):
        assert_batch(out, ref)
        assert all(in_arena(t, fastpin.default_arena()) for t in tensor_leaves(out))
    assert fastpin.stats()["batches"] == before + 3


def test_uninstall_takes_effect_in_existing_loader(accelerator):
    ds = PatternDataset(n=8, seed=3)
    loader = DataLoader(ds, batch_size=4, num_workers=0, pin_memory=True)
    fastpin.install()
    try:
        it = iter(loader)
        first = next(it)
        assert all(in_arena(t, fastpin.default_arena()) for t in tensor_leaves(first))
    finally:
        fastpin.uninstall()
    calls = []
    original = torch_pin_module.pin_memory
    # With fastpin gone, the loader calls whatever torch's module holds.
    torch_pin_module.pin_memory = lambda data, device=None: calls.append(1) or data
    try:
        second = next(it)
    finally:
        torch_pin_module.pin_memory = original
    assert calls == [1]
    assert_batch(second, expected_batches(ds)[1])


# ---- fastpin.collate ------------------------------------------------------------

def test_collate_matches_default_collate():
    samples = [
        {"x": patterned((2, 3), torch.float32, i), "n": np.int64(i + 1),
         "arr": patterned((4,), np.int32, 100 + i), "pair": (i + 1, f"s{i}"),
         "c": patterned((3,), torch.complex64, 200 + i).conj(),
         "nc": patterned((4, 3), torch.int16, 300 + i).t(), "f": float(i) + 0.5}
        for i in range(5)
    ]
    out = fastpin.collate(samples)
    ref = default_collate(samples)
    assert list(out) == list(ref)
    for key in ("x", "n", "arr", "nc", "f"):
        assert_same(out[key], ref[key])
    assert not out["c"].is_conj() and out["c"].shape == ref["c"].shape
    assert tensor_bytes(out["c"]) == tensor_bytes(ref["c"])        # the conjugate values
    assert out["pair"][1] == ref["pair"][1]
    assert_same(out["pair"][0], ref["pair"][0])
    arena = fastpin.default_arena()
    for key in ("x", "arr", "c", "nc"):
        assert in_arena(out[key], arena), key


def test_collate_drops_autograd():
    """Issue 26: samples that require grad collated to a pinned batch with
    requires_grad=False and no grad_fn. They go torch's way (the stack is
    recorded, as default_collate's); the ordinary leaves beside them are still
    stacked into the arena, and under no_grad the fast path takes them too."""
    ws = [patterned((3, 4), torch.float32, 50 + i).nan_to_num(0.5).requires_grad_()
          for i in range(4)]
    samples = [{"w": w, "x": patterned((5,), torch.int32, 60 + i)} for i, w in enumerate(ws)]
    out = fastpin.collate(samples)
    ref = default_collate(samples)
    assert out["w"].requires_grad and type(out["w"].grad_fn) is type(ref["w"].grad_fn)
    assert type(out["w"].grad_fn).__name__ == "StackBackward0"
    assert_same(out["w"].detach(), ref["w"].detach())
    assert_same(out["x"], ref["x"])
    assert in_arena(out["x"], fastpin.default_arena())
    weights = patterned((4, 3, 4), torch.float32, 70).nan_to_num(0.25)
    (out["w"] * weights).sum().backward()
    for i, w in enumerate(ws):                       # the gradient reaches each sample
        assert torch.equal(w.grad, weights[i])
    with torch.no_grad():
        plain = fastpin.collate(ws)
    assert not plain.requires_grad and plain.grad_fn is None
    assert in_arena(plain, fastpin.default_arena())
    assert torch.equal(plain, torch.stack([w.detach() for w in ws]))


def test_collate_in_dataloader_without_workers():
    ds = PatternDataset(seed=4)
    refs = expected_batches(ds)
    before = fastpin.stats()
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=fastpin.collate)
    stacked = 0
    for out, ref in zip(loader, refs, strict=True):
        assert_batch(out, ref)
        for t in tensor_leaves(out):
            assert in_arena(t, fastpin.default_arena())
            stacked += t.numel() * t.element_size()
    assert fastpin.stats()["bytes"] == before["bytes"] + stacked


def test_collate_counts_each_batch_once():
    """stats()['batches'] counts batches, as pin_memory does (one per call),
    not the tensors stacked in one."""
    samples = [{"a": patterned((3,), torch.int32, i), "b": patterned((2,), torch.int64, i)}
               for i in range(4)]
    before = fastpin.stats()["batches"]
    fastpin.collate(samples)
    fastpin.collate(samples)
    assert fastpin.stats()["batches"] == before + 2


def recording_collate(batch):
    """fastpin.collate, with what it warns recorded and sent back with the batch
    (a worker's warnings are otherwise lost, or raised there under -W error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fastpin.collate(batch)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out, messages, os.getpid()


@pytest.mark.filterwarnings(FORK_WARNING)
def test_collate_in_workers_warns_once_per_worker():
    ds = PatternDataset(seed=5)
    refs = expected_batches(ds)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=recording_collate)
    per_worker = collections.defaultdict(list)
    for (out, messages, pid), ref in zip(loader, refs, strict=True):
        assert pid != os.getpid()
        assert_batch(out, ref)
        for t in tensor_leaves(out):
            assert not in_arena(t, fastpin.default_arena())  # collated like default_collate
        per_worker[pid].extend(messages)
    assert len(per_worker) == 2
    for pid, messages in per_worker.items():
        assert len(messages) == 1, (pid, messages)
        assert WORKER_WARNING in messages[0]


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.filterwarnings(f"ignore:{WORKER_WARNING}:RuntimeWarning")
def test_collate_in_workers_collates_like_default():
    ds = PatternDataset(n=16, seed=6)
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=fastpin.collate)
    for out, ref in zip(loader, expected_batches(ds), strict=True):
        assert_batch(out, ref)


def test_collate_ignores_on_full():
    """fastpin.collate follows the on_full policy like pin_memory: with the
    default arena full of live batches it falls back (stacks the ordinary
    way, counted), waits, or raises, as configured."""
    samples = [{"x": patterned((2, 3), torch.float32, i), "n": torch.tensor(i + 1)}
               for i in range(4)]
    ref = default_collate(samples)
    arena = fastpin.default_arena()
    hold = arena.alloc(arena.capacity)           # a cap full of live batches
    try:
        before = fastpin.stats()["fallbacks"]
        out = fastpin.collate(samples)           # on_full="fallback", the default
        assert fastpin.stats()["fallbacks"] > before
        assert_same(out["x"], ref["x"])
        assert_same(out["n"], ref["n"])
        assert not in_arena(out["x"], arena)
        fastpin.configure(on_full="raise")
        with pytest.raises(fastpin.ArenaFullError):
            fastpin.collate(samples)
        fastpin.configure(on_full="wait", wait_timeout=0.1)
        with pytest.raises(fastpin.ArenaFullError, match="waited"):
            fastpin.collate(samples)
    finally:
        fastpin.configure(on_full="fallback", wait_timeout=10)
        del hold
    out = fastpin.collate(samples)
    assert in_arena(out["x"], arena)
    assert_same(out["x"], ref["x"])
