"""fastpin.install() with a real DataLoader and its pin thread, and
fastpin.collate as a DataLoader collate_fn."""
from __future__ import annotations

import collections
import gc
import os
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.data._utils import pin_memory as torch_pin_module

import fastpin
from conftest import assert_same, gpu, in_arena, patterned, tensor_bytes

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
    """fastpin.install(zero_copy=False): the pin thread pins by copy."""
    original = torch_pin_module.pin_memory
    fastpin.install(zero_copy=False)
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
    way, counted), waits, or raises, as configured. (A fixed default arena: a
    self-sizing one is full only at its cap, tests/test_default_arena.py.)"""
    samples = [{"x": patterned((2, 3), torch.float32, i), "n": torch.tensor(i + 1)}
               for i in range(4)]
    ref = default_collate(samples)
    saved = fastpin._arena.get_capacity()
    fastpin.configure(capacity=1 << 20)
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
    try:
        out = fastpin.collate(samples)
        assert in_arena(out["x"], arena)
        assert_same(out["x"], ref["x"])
    finally:
        fastpin.configure(capacity="auto" if saved is None else saved)


# ---- zero-copy under install() --------------------------------------------------
#
# install() gives every DataLoader(pin_memory=True) with workers zero-copy
# collation. On this CPU machine torch turns pin_memory off (no pin thread):
# the batches are the adopted blocks' views as they are unpickled. Under the
# `accelerator` fixture the pin thread runs, and the installed pin function
# makes the views: the path a GPU takes, the memory just not page-locked.

import dataclasses
import subprocess
import sys
import tempfile
from typing import NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from fastpin import _zerocopy
from fastpin._runtime import process
from test_zero_copy import blocks_settle, holders
from test_index_queue import feeders
from test_zero_copy_reuse import nothing_left_behind, torch_2_11_exit_hook  # noqa: F401 - fixtures

NO_ACCELERATOR = "ignore:'pin_memory' argument is set as true but no accelerator:UserWarning"
pytestmark = [pytest.mark.filterwarnings(FORK_WARNING), pytest.mark.filterwarnings(NO_ACCELERATOR)]


@pytest.fixture
def zero_copy():
    """fastpin.install() with its defaults (zero-copy on); uninstalled after."""
    fastpin.install()
    yield
    fastpin.uninstall()


@pytest.fixture(params=["no pin thread", "pin thread"])
def pin_thread(request):
    """Both ways a zero-copy batch reaches the user: adopted as it is unpickled
    (no accelerator), or made into views by the pin thread."""
    if request.param == "pin thread":
        request.getfixturevalue("accelerator")
    return request.param == "pin thread"


def in_shared_arena(x) -> bool:
    ptr = x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data
    return any(a.base <= ptr < a.base + a.capacity for a in list(_zerocopy._registry().values()))


def pool_of(dl):
    return process.installed_pools[dl][1]


def seeded(ds, seed, **kw):
    """A DataLoader over `ds`, shuffled by a generator of `seed`."""
    return DataLoader(ds, batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(seed), **kw)


def stock_epochs(ds, seed, persistent):
    """What the stock DataLoader gives in its first two epochs for this seed:
    each iterator draws its workers' base seed from the generator, then the
    sampler's order (persistent workers: one iterator for both epochs)."""
    g = torch.Generator().manual_seed(seed)
    sampler = torch.utils.data.RandomSampler(ds, generator=g)
    epochs = []
    for epoch in range(2):
        if epoch == 0 or not persistent:
            torch.empty((), dtype=torch.int64).random_(generator=g)
        order = list(sampler)
        epochs.append([default_collate([ds[i] for i in order[b:b + BATCH]])
                       for b in range(0, len(order), BATCH)])
    return epochs


def check_zero_copy(batches, refs, dl):
    for out, ref in zip(batches, refs, strict=True):
        assert_batch(out, ref)
        assert all(in_shared_arena(t) for t in tensor_leaves(out))  # nothing copied here
    stats = pool_of(dl).stats()
    # Zero fallbacks; the self-sizing race (helper zcrace's fix) may add spurious ones.
    assert stats["fallbacks"] == 0, stats


@pytest.mark.parametrize("method,persistent", [("fork", False), ("fork", True), ("spawn", False),
                                               ("forkserver", True)])
def test_zero_copy_batches_exact_against_stock(method, persistent, pin_thread, zero_copy,
                                               nothing_left_behind):
    ds = PatternDataset(n=22, seed=7)                     # an uneven last batch
    dl = seeded(ds, 11, num_workers=2, pin_memory=True, multiprocessing_context=method,
                persistent_workers=persistent)
    for refs in stock_epochs(ds, 11, persistent):
        check_zero_copy(list(dl), refs, dl)
    assert dl.collate_fn is default_collate                 # the DataLoader as it was
    del dl


class NamedSample(NamedTuple):
    x: torch.Tensor
    ids: torch.Tensor
    tag: str


class Named(Dataset):
    def __len__(self):
        return 14

    def __getitem__(self, i):
        return NamedSample(patterned((2, 3), torch.float32, 500 + i),
                           patterned((4,), torch.int32, 600 + i), f"t{i}")


@dataclasses.dataclass
class Pair:
    image: torch.Tensor
    label: torch.Tensor


def collate_pair(samples):
    return {"pair": Pair(torch.stack([s.x for s in samples]), torch.stack([s.ids for s in samples])),
            "tags": [s.tag for s in samples],
            "array": np.stack([s.ids.numpy() for s in samples]).astype(np.int64) * 3}


def test_namedtuples_dataclasses_and_custom_collate(pin_thread, zero_copy):
    ds = Named()
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    refs = [default_collate([ds[i] for i in range(b, min(b + 4, 14))]) for b in range(0, 14, 4)]
    for out, ref in zip(dl, refs, strict=True):
        assert type(out) is NamedSample and out.tag == ref.tag
        assert_same(out.x, ref.x)
        assert_same(out.ids, ref.ids)
        assert in_shared_arena(out.x) and in_shared_arena(out.ids)
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True, collate_fn=collate_pair)
    refs = [collate_pair([ds[i] for i in range(b, min(b + 4, 14))]) for b in range(0, 14, 4)]
    for out, ref in zip(dl, refs, strict=True):
        assert type(out["pair"]) is Pair and out["tags"] == ref["tags"]
        assert_same(out["pair"].image, ref["pair"].image)
        assert_same(out["pair"].label, ref["pair"].label)
        assert_same(out["array"], ref["array"])
        assert all(in_shared_arena(x) for x in (out["pair"].image, out["pair"].label, out["array"]))
    assert dl.collate_fn is collate_pair


class SelfPinning:
    """torch's documented custom batch: pins itself (here: says it was asked)."""

    def __init__(self, samples):
        self.x = torch.stack([s.x for s in samples])
        self.asked = False

    def pin_memory(self):
        self.asked = True
        return self


@dataclasses.dataclass
class PinningPair:
    x: torch.Tensor
    asked: bool = False

    def pin_memory(self):
        return dataclasses.replace(self, asked=True)


def collate_self_pinning(samples):
    return {"custom": SelfPinning(samples), "pair": PinningPair(torch.stack([s.ids for s in samples])),
            "x": torch.stack([s.x for s in samples])}


def test_objects_with_their_own_pin_memory_are_asked(accelerator, zero_copy):
    """As torch's pin thread does: the object pins itself (fastpin does not walk
    into it, even a dataclass); the rest of the batch lies in the arena."""
    ds = Named()
    dl = DataLoader(ds, batch_size=5, num_workers=2, pin_memory=True,
                    collate_fn=collate_self_pinning)
    for k, out in enumerate(dl):
        ref = collate_self_pinning([ds[i] for i in range(5 * k, min(5 * k + 5, 14))])
        assert out["custom"].asked and out["pair"].asked
        assert_same(out["custom"].x, ref["custom"].x)
        assert_same(out["pair"].x, ref["pair"].x)
        assert_same(out["x"], ref["x"])
        assert in_shared_arena(out["x"]) and not in_shared_arena(out["custom"].x)
    assert k == 2


class Stream(IterableDataset):
    """Each worker yields its share, an uneven count per worker."""

    def __iter__(self):
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(wid, 23, workers):
            yield {"x": patterned((3, 2), torch.float64, 900 + i), "i": i}


@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_dataset_uneven_last_batches(in_order, pin_thread):
    stock = list(DataLoader(Stream(), batch_size=5, num_workers=2, in_order=in_order))
    fastpin.install()
    try:
        dl = DataLoader(Stream(), batch_size=5, num_workers=2, in_order=in_order, pin_memory=True)
        got = list(dl)
        key = lambda b: b["i"].tolist()  # noqa: E731
        if in_order:
            assert [len(b["i"]) for b in got] == [len(b["i"]) for b in stock]
        for out, ref in zip(sorted(got, key=key), sorted(stock, key=key), strict=True):
            assert_same(out["x"], ref["x"])
            assert_same(out["i"], ref["i"])
            assert in_shared_arena(out["x"])
    finally:
        fastpin.uninstall()


def tagging_init(worker_id):
    get_worker_info().dataset.seed = 40 + worker_id


def test_made_before_install_subclass_and_worker_init_fn(pin_thread):
    class MyLoader(DataLoader):
        pass

    ds = PatternDataset(n=12, seed=0)
    dl = MyLoader(ds, batch_size=3, num_workers=2, pin_memory=True, worker_init_fn=tagging_init)
    refs = list(dl) if not pin_thread else None
    fastpin.install()
    try:
        got = list(dl)
        # Each worker's samples carry its seed: worker_init_fn ran in each.
        ref_by_worker = {w: expected_batches(PatternDataset(n=12, seed=40 + w), 3) for w in (0, 1)}
        for k, out in enumerate(got):
            assert_batch(out, ref_by_worker[k % 2][k])
            assert all(in_shared_arena(t) for t in tensor_leaves(out))
            if refs is not None:
                assert_batch(out, refs[k])
    finally:
        fastpin.uninstall()


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stateful_dataloader(pin_thread, zero_copy, monkeypatch):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    if pin_thread and not fastpin.cuda_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # its pin thread asks
    ds = PatternDataset(n=20, seed=8)
    refs = expected_batches(ds)
    dl = stateful.StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    first = [next(it), next(it)]
    state = dl.state_dict()
    for out, ref in zip(first, refs[:2]):
        assert_batch(out, ref)
        assert all(in_shared_arena(t) for t in tensor_leaves(out))
    del it
    resumed = stateful.StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    resumed.load_state_dict(state)
    rest = list(resumed)
    for k, (out, ref) in enumerate(zip(rest, refs[2:], strict=True)):
        assert_batch(out, ref)
        assert all(in_shared_arena(t) for t in tensor_leaves(out)), (k, pool_of(resumed).stats()["fallbacks"])


def test_uninstall_mid_epoch_then_plain_iteration(accelerator):
    """The epoch in flight finishes as it began (its workers' collate_fn and
    pool are its own; after uninstall() torch's pin function asks the batch
    for its views); the next one is stock."""
    ds = PatternDataset(n=24, seed=9)
    refs = expected_batches(ds)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    fastpin.install()
    it = iter(dl)
    got = [next(it), next(it)]
    arenas = list(pool_of(dl).segments)  # in_shared_arena's, while batches are checked
    fastpin.uninstall()
    got += list(it)
    for out, ref in zip(got, refs, strict=True):
        assert_batch(out, ref)
        assert all(in_shared_arena(t) for t in tensor_leaves(out))
    del it, got, arenas


def test_plain_iteration_after_uninstall():
    ds = PatternDataset(n=12, seed=10)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    fastpin.install()
    try:
        first = list(dl)
        arenas = list(pool_of(dl).segments)  # in_shared_arena's, while batches are checked
    finally:
        fastpin.uninstall()
    assert dl not in process.installed_pools
    it = iter(dl)
    assert it._collate_fn is default_collate
    for a, b, ref in zip(first, it, expected_batches(ds), strict=True):
        assert_batch(a, ref)
        assert_batch(b, ref)
        assert not any(in_shared_arena(t) for t in tensor_leaves(b))
        assert all(in_shared_arena(t) for t in tensor_leaves(a))


def test_train_and_validation_loaders_at_once(pin_thread, zero_copy):
    train_ds, val_ds = PatternDataset(n=16, seed=11), PatternDataset(n=10, seed=12)
    train = DataLoader(train_ds, batch_size=4, num_workers=2, pin_memory=True)
    val = DataLoader(val_ds, batch_size=5, num_workers=1, pin_memory=True)
    val_it = iter(val)
    for out, ref in zip(train, expected_batches(train_ds, 4), strict=True):
        assert_batch(out, ref)
        v = next(val_it, None)
        if v is not None:
            assert all(in_shared_arena(t) for t in tensor_leaves(v))
    assert pool_of(train) is not pool_of(val)
    check_zero_copy(list(val), expected_batches(val_ds, 5), val)


def test_no_workers_and_pin_memory_false_untouched(accelerator, zero_copy):
    ds = PatternDataset(n=8, seed=13)
    for dl in (DataLoader(ds, batch_size=4, num_workers=0, pin_memory=True),
               DataLoader(ds, batch_size=4, num_workers=2, pin_memory=False)):
        it = iter(dl)
        assert it._collate_fn is default_collate
        for out, ref in zip(it, expected_batches(ds), strict=True):
            assert_batch(out, ref)
            assert not any(in_shared_arena(t) for t in tensor_leaves(out))
        assert dl not in process.installed_pools


def test_install_zero_copy_false_copies(accelerator):
    ds = PatternDataset(n=8, seed=14)
    fastpin.install(zero_copy=False)
    try:
        dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
        for out, ref in zip(dl, expected_batches(ds), strict=True):
            assert_batch(out, ref)
            assert all(in_arena(t, fastpin.default_arena()) for t in tensor_leaves(out))
    finally:
        fastpin.uninstall()


class Killing(PatternDataset):
    """Kills its worker at sample 13, once the worker's queue thread has sent
    its earlier batches: a worker killed in the middle of that send holds the
    result queue's lock forever (stock DataLoader: the pin thread then fails
    with EOFError, or the queue thread of the main process hangs on the lock,
    holding the queue's pipe; not fastpin's to test)."""

    def __getitem__(self, i):
        if i == 13 and get_worker_info() is not None:
            import time

            time.sleep(0.3)
            os.kill(os.getpid(), 9)
        return super().__getitem__(i)


def shm_entries():
    """/dev/shm's entries, but multiprocessing's named semaphores (sem.*), which
    any process on the machine makes and unlinks."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


def assert_released(arenas, shm):
    """Every block of `arenas` is back (their iterators gone), and nothing new
    is in /dev/shm."""
    for arena in arenas:
        assert blocks_settle(arena) == 0, holders(arena)
    assert shm_entries() <= shm


def test_killed_worker_leaks_nothing(pin_thread, zero_copy, nothing_left_behind):
    shm = shm_entries()
    dl = DataLoader(Killing(n=32, seed=15), batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    with pytest.raises(RuntimeError, match="worker"):
        for batch in it:
            del batch
    arenas = list(pool_of(dl).segments)
    del it
    assert_released(arenas, shm)
    del dl, arenas


@pytest.mark.parametrize("persistent", [False, True])
def test_break_leaks_nothing(persistent, pin_thread, zero_copy, nothing_left_behind):
    shm = shm_entries()
    ds = PatternDataset(n=40, seed=16)
    dl = DataLoader(ds, batch_size=2, num_workers=2, pin_memory=True, persistent_workers=persistent)
    for k, batch in enumerate(dl):
        if k == 2:
            break
    del batch
    check_zero_copy(list(dl), expected_batches(ds, 2), dl)  # and the next epoch is whole
    for k, batch in enumerate(dl):
        if k == 1:
            break
    del batch
    arenas = list(pool_of(dl).segments)
    del dl
    assert_released(arenas, shm)
    del arenas


def test_persistent_workers_held_at_exit_leave_no_pipes(pin_thread, zero_copy,
                                                       torch_2_11_exit_hook, nothing_left_behind):
    """torch 2.11 and before hold each persistent worker of an iterator with
    pin_memory (on a GPU) until the interpreter exits, and with it the two pipe
    ends its Popen keeps: a DataLoader made per epoch, or one for validation
    made anew each time, would leave two descriptors a worker each time."""
    for seed in (18, 19):
        ds = PatternDataset(n=12, seed=seed)
        dl = DataLoader(ds, batch_size=2, num_workers=2, pin_memory=True, persistent_workers=True)
        for _ in range(2):
            check_zero_copy(list(dl), expected_batches(ds, 2), dl)
        del dl
    assert len(torch_2_11_exit_hook) == 4


@pytest.mark.parametrize("persistent", [False, True])
def test_end_with_the_result_queue_lock_lost(persistent, pin_thread, zero_copy,
                                             nothing_left_behind):
    """A worker that dies while it writes into the result queue (killed, or
    leaving with its feeder thread mid-write) leaves the queue's write lock
    held for ever. At the iterator's end torch wakes its pin thread with a
    message put from the main process, through a feeder thread that takes
    that lock: it would wait there for good, holding both ends of the pipe.
    Here the test holds the lock, as the dead worker would."""
    before = feeders()
    dl = DataLoader(PatternDataset(n=40, seed=17), batch_size=2, num_workers=2,
                    pin_memory=True, persistent_workers=persistent)
    it = iter(dl)
    batch = next(it)
    assert_batch(batch, expected_batches(dl.dataset, 2)[0])
    lock = it._worker_result_queue._wlock
    assert lock.acquire(timeout=30)
    try:
        del it, batch, dl  # persistent workers end with their DataLoader
        gc.collect()
        assert feeders() <= before, "a feeder thread waits on the lost lock"
    finally:
        lock.release()  # lets a waiting feeder go, so a failure leaves no thread


EXIT_SCRIPT = """
import sys, torch, fastpin
from torch.utils.data import DataLoader, Dataset
class D(Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return torch.arange(20_000, dtype=torch.int64) * (i + 3)
fastpin.install()
dl = DataLoader(D(), batch_size=4, num_workers=2, pin_memory=True,
                persistent_workers=sys.argv[1] == "persistent")
held = []
for k, b in enumerate(dl):
    assert torch.equal(b[1], torch.arange(20_000, dtype=torch.int64) * (4 * k + 4))
    held.append(b)
    if k == 3:
        break
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind", ["plain", "persistent"])
def test_interpreter_exit_under_install(kind):
    """Exit with batches held and the epoch broken: a clean exit, no traceback,
    nothing left in /dev/shm."""
    shm = shm_entries()
    home = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
    env = dict(os.environ, PYTHONPATH=home + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-W", NO_ACCELERATOR.replace("ignore:", "ignore:", 1),
                        "-c", EXIT_SCRIPT, kind], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tempfile.gettempdir())
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    assert shm_entries() <= shm


def test_a_refused_registration_warns_once_and_copies(monkeypatch, caplog, zero_copy):
    """The driver refuses to page-lock the arena (a small memlock limit): one
    warning, the batches come the ordinary way, exact; never an error."""
    from fastpin import _arena

    def refuse(nbytes, **kw):
        raise fastpin.CudaError(f"out of memory (registering {nbytes} bytes)")

    monkeypatch.setattr(_arena, "make_arena", refuse)
    ds = PatternDataset(n=16, seed=17)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    with caplog.at_level("WARNING", logger="fastpin"):
        for _ in range(2):
            for out, ref in zip(dl, expected_batches(ds), strict=True):
                assert_batch(out, ref)
                assert not any(in_shared_arena(t) for t in tensor_leaves(out))
    warned = [r.getMessage() for r in caplog.records if "could not add" in r.getMessage()]
    assert len(warned) == 1, warned
    assert pool_of(dl).stats()["fallbacks"] >= 4


# ---- the zero_copy defaults ------------------------------------------------------

def test_loader_takes_zero_copy_where_it_applies():
    ds = PatternDataset(n=8, seed=18)
    with_workers = DataLoader(ds, batch_size=4, num_workers=2)
    assert fastpin.Loader(with_workers, device=None).zero_copy
    assert not fastpin.Loader(with_workers, device=None, zero_copy=False).zero_copy
    assert not fastpin.Loader(DataLoader(ds, batch_size=4), device=None).zero_copy
    assert not fastpin.Loader([ds[0], ds[1]], device=None).zero_copy
    assert not fastpin.Loader(iter([ds[0]]), device=None).zero_copy
    loader = fastpin.Loader(with_workers, device=None)
    for out, ref in zip(loader, expected_batches(ds), strict=True):
        assert_batch(out, ref)
        assert all(in_shared_arena(t) for t in tensor_leaves(out))
    assert loader.stats()["worker_fallbacks"] == 0


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_copying_loader_under_install_copies(accelerator, installed):
    """Loader(zero_copy=False) opts its DataLoader's workers out of worker-side
    collation under install() too: install()'s hook leaves the Loader's own
    iterators to it."""
    ds = PatternDataset(n=16, seed=19)
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    loader = fastpin.Loader(dl, device=None, zero_copy=False)
    for out, ref in zip(loader, expected_batches(ds), strict=True):
        assert_batch(out, ref)
        assert not any(in_shared_arena(t) for t in tensor_leaves(out))
    assert fastpin._runtime.process.installed_pools.get(dl) is None


def test_zero_copy_environment_opt_out():
    script = (
        "import torch, fastpin, warnings\n"
        "from torch.utils.data import DataLoader\n"
        "warnings.simplefilter('ignore')\n"
        "dl = DataLoader([torch.arange(3)] * 4, batch_size=2, num_workers=1, pin_memory=True)\n"
        "fastpin.install()\n"
        "print(fastpin.Loader(dl, device=None).zero_copy, type(iter(dl)._collate_fn).__name__)\n")
    home = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
    for value, want in (("0", "False function"), ("1", "True _WorkerCollate")):
        env = dict(os.environ, FASTPIN_ZERO_COPY=value,
                   PYTHONPATH=home + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=120, env=env, cwd=tempfile.gettempdir())
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == want.split(), (value, r.stdout)


class Frames(Dataset):
    """uint8 frames of 1 MiB, each its own pattern."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return patterned((1 << 20,), torch.uint8, 900 + i)


@gpu
def test_copies_queued_behind_the_gpu_wait_for_it_never_fall_back_for_good(zero_copy):
    """The H200 bench of 2026-12-02: under install(), uint8 images delivered 13.5
    GB/s where Loader(zero_copy) gave 51.7. A consumer that queues its
    .to(non_blocking=True) copies ahead of the GPU holds blocks the main process
    freed but the GPU still reads (fenced, pending); only the main process can
    see those fences pass, and it looked only when a zero-copy batch arrived.
    So a worker that found the pool full of them fell back, the fallen-back
    batches let nobody look, and every later batch fell back too. Workers now
    ask the main process to look, and wait for the GPU rather than fall back."""
    ds = Frames()
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    torch.cuda._sleep(2_000_000_000)     # about a second: every copy below queues behind it
    on_gpu = [batch.to("cuda", non_blocking=True) for batch in dl]  # each host batch dies here
    torch.cuda.synchronize()
    for k, batch in enumerate(on_gpu):
        for j in range(4):
            assert torch.equal(batch[j].cpu(), ds[4 * k + j]), (k, j)
    assert pool_of(dl).stats()["fallbacks"] == 0
