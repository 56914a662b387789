"""The delivery engine on the CPU: Ahead (the consumer-side driver) with a fake
step, the Loader's choice of thread or none, and install(device=...) over real
DataLoader workers with the CPU standing in for the GPU (FakeCopy: the
device buffer is host memory, the copy a memmove, no stream), so that the
hook, the zero-copy adoption, the one-block device views, the ordering and
the ends run here exactly as they run on a GPU. The GPU's own half is in
tests/test_delivery_gpu.py."""
from __future__ import annotations

import collections
import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import types
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils import pin_memory as torch_pin_module

import fastpin
from fastpin import _ahead, _delivery, _install
from conftest import assert_same, workers_gone
from test_install import (
    FORK_WARNING, NO_ACCELERATOR, BATCH, Named, PatternDataset, assert_batch, collate_pair,
    expected_batches, in_shared_arena, seeded, stock_epochs, tensor_leaves,
)
from test_zero_copy_reuse import nothing_left_behind  # noqa: F401 - a fixture

pytestmark = [pytest.mark.filterwarnings(FORK_WARNING), pytest.mark.filterwarnings(NO_ACCELERATOR)]


# ---- Ahead, with a fake step ------------------------------------------------------

class Step:
    """A step that records what it prepared and delivered, in order."""

    def __init__(self, fail_on=None):
        self.log: list = []
        self.fail_on = fail_on
        self.stats = _delivery.Stats()

    def prepare_here(self, batch):
        if batch == self.fail_on:
            raise ValueError(f"prepare {batch}")
        self.log.append(("prepare", batch if type(batch) is int else "object"))
        return ("item", batch)

    def deliver(self, item):
        self.log.append(("deliver", item[1] if type(item[1]) is int else "object"))
        return item[1]


def source(items, errors=()):
    """pull() over `items`; an item in `errors` raises instead of being given."""
    it = iter(items)

    def pull():
        x = next(it)
        if x in errors:
            raise KeyError(x)
        return x
    return pull


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_ahead_order_and_depth(depth):
    step = Step()
    ahead = _ahead.Ahead(step, depth)
    pull = source(range(8))
    got = []
    for k in range(8):
        got.append(ahead.next(pull))
        # Batch k is handed over once batch k + depth is prepared (fewer at the end).
        prepared = [b for what, b in step.log if what == "prepare"]
        assert prepared == list(range(min(k + depth, 7) + 1))
        assert step.log[-1] == ("deliver", k)
        assert len(ahead.pending) == min(depth, 7 - k)
    assert got == list(range(8))
    with pytest.raises(StopIteration):
        ahead.next(pull)


def test_ahead_takes_batches_ahead_only_while_they_are_ready():
    step = Step()
    ahead = _ahead.Ahead(step, 3)
    pull = source(range(6))
    there = [False]
    assert ahead.next(pull, lambda: there[0]) == 0     # the one it needs, then no waiting
    assert not ahead.pending
    there[0] = True
    assert ahead.next(pull, lambda: there[0]) == 1
    assert [b for _, b in ahead.pending] == [2, 3, 4]
    there[0] = False
    assert [ahead.next(pull, lambda: there[0]) for _ in range(4)] == [2, 3, 4, 5]
    with pytest.raises(StopIteration):
        ahead.next(pull, lambda: there[0])


class ShortOfRoom(Step):
    """A step whose arena has room for `room` prepared batches: one ahead that
    finds none raises NoRoomAhead, as PinHost does under on_full="wait"."""

    def __init__(self, room):
        super().__init__()
        self.room = room

    def prepare_here(self, batch):
        held = sum(1 for kind, _ in self.log if kind == "prepare") - self.handed
        if held >= self.room:
            assert _ahead.preparing_ahead.get(), "waited for room only the caller would free"
            raise _ahead.NoRoomAhead(lambda: super(ShortOfRoom, self).prepare_here(batch))
        return super().prepare_here(batch)

    handed = 0

    def deliver(self, item):
        self.handed += 1
        return super().deliver(item)


def test_ahead_batch_without_room_waits_for_its_turn():
    step = ShortOfRoom(room=1)
    ahead = _ahead.Ahead(step, 2)
    pull = source(range(5))
    assert ahead.next(pull) == 0
    # 1 was taken but found no room: kept unprepared, and nothing after it taken.
    assert len(ahead.pending) == 1 and step.log[-1] == ("deliver", 0)
    assert [ahead.next(pull) for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(StopIteration):
        ahead.next(pull)
    prepared = [b for kind, b in step.log if kind == "prepare"]
    assert prepared == [0, 1, 2, 3, 4]


def test_ahead_ctrl_c_while_a_batch_waits_for_room_keeps_it():
    step = ShortOfRoom(room=1)
    ahead = _ahead.Ahead(step, 1)
    pull = source(range(3))
    assert ahead.next(pull) == 0          # 1 is kept, unprepared
    later, tries = ahead.pending[0].prepare, []

    def interrupted_once():               # Ctrl-C while it waits for room
        tries.append(1)
        if len(tries) == 1:
            raise KeyboardInterrupt
        return later()

    ahead.pending[0].prepare = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        ahead.next(pull)
    assert [ahead.next(pull) for _ in range(2)] == [1, 2]


def test_ahead_source_errors_come_in_their_turn():
    step = Step()
    ahead = _ahead.Ahead(step, 2)
    pull = source(range(6), errors={3})
    assert [ahead.next(pull) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="3"):
        ahead.next(pull)
    # The source goes on after its error, as a DataLoader whose worker raised does.
    assert [ahead.next(pull) for _ in range(2)] == [4, 5]
    with pytest.raises(StopIteration):
        ahead.next(pull)


def test_ahead_prepare_errors_come_in_their_turn():
    step = Step(fail_on=2)
    ahead = _ahead.Ahead(step, 3)
    pull = source(range(5))
    assert [ahead.next(pull) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="prepare 2"):
        ahead.next(pull)
    assert [ahead.next(pull) for _ in range(2)] == [3, 4]


def test_ahead_after_the_end_starts_afresh():
    """A persistent DataLoader iterator's next epoch: its end, then more batches."""
    step = Step()
    ahead = _ahead.Ahead(step, 2)
    epochs = iter([[0, 1, 2], [10, 11]])
    current = iter(next(epochs))

    def pull():
        return next(current)

    assert [ahead.next(pull) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(StopIteration):
        ahead.next(pull)
    with pytest.raises(StopIteration):
        ahead.next(pull)  # the source says so again
    current = iter(next(epochs))
    assert [ahead.next(pull) for _ in range(2)] == [10, 11]


def test_ahead_ctrl_c_is_raised_at_once_and_keeps_what_is_prepared():
    step = Step()
    ahead = _ahead.Ahead(step, 2)
    calls = []

    def pull():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return len(calls)

    with pytest.raises(KeyboardInterrupt):
        ahead.next(pull)
    assert len(ahead.pending) == 1  # batch 1, prepared before Ctrl-C
    assert ahead.next(pull) == 1


def test_ahead_clear_drops_prepared_batches():
    class Big:
        pass

    step = Step()
    ahead = _ahead.Ahead(step, 3)
    made = collections.deque(Big() for _ in range(6))
    refs = [weakref.ref(b) for b in made]
    pull = made.popleft  # holds only those not taken yet
    first = ahead.next(pull)
    assert len(ahead.pending) == 3
    ahead.clear()
    gc.collect()
    assert [r() is None for r in refs] == [False, True, True, True, False, False]
    assert first is refs[0]()


def test_ahead_counts_time():
    step = Step()
    ahead = _ahead.Ahead(step, 1, step.stats)

    def pull():
        time.sleep(0.01)
        return 1

    ahead.next(pull)
    assert step.stats.wait_seconds >= 0.015  # two pulls before the first batch


# ---- the Loader: a thread only where the source works in this process -------------

def loader_threads():
    return [t for t in threading.enumerate() if t.name == "fastpin-loader"]


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"x": torch.full((4,), i, dtype=torch.int32)}


@pytest.mark.parametrize("device,zero_copy", [("cpu", False), (None, False), (None, True)])
def test_loader_over_workers_runs_no_thread(device, zero_copy):
    dl = DataLoader(Slow(), batch_size=4, num_workers=2)
    loader = fastpin.Loader(dl, device=device, zero_copy=zero_copy)
    before = len(loader_threads())
    got = []
    for batch in loader:
        assert len(loader_threads()) == before
        got.append(batch["x"][:, 0].tolist())
    assert got == [[4 * k + j for j in range(4)] for k in range(6)]


def test_loader_without_workers_keeps_its_thread():
    dl = DataLoader(Slow(), batch_size=4)
    loader = fastpin.Loader(dl, device="cpu")
    it = iter(loader)
    next(it)
    assert loader_threads()
    del it


# ---- install(device=...) with the CPU standing in for the GPU ---------------------

class FakeCopy(_delivery.CopyToDevice):
    """CopyToDevice with host memory for the device: the buffer a zero-copy
    block is copied into is a CPU tensor, the copy a memmove made when issued,
    the event None. Everything else (adoption, the one-block views, leaves
    outside the block, objects that pin themselves, the order, the ends) is
    the real step's."""

    made: list = []  # every FakeCopy, for the tests to look at
    counts = collections.Counter()  # blocks (batches copied as one block), delivered

    def __init__(self, target, zero_copy=False):
        _delivery.PassThrough.__init__(self, target)
        self.torch = torch
        self.device = torch.device("cpu")
        self.depth = target.depth
        self.pin_objects = target.pin_objects
        self.staging = _delivery._Staging(target, zero_copy)
        self.pool = target.pool if zero_copy else None
        self.pinned = self.staging.copy_arena
        self.copy_stream = types.SimpleNamespace(cuda_stream=None)
        self.in_flight = []
        FakeCopy.made.append(weakref.ref(self))

    def on_copy_stream(self, prepare, batch):
        return prepare(batch)

    def from_block(self, batch):
        out = super().from_block(batch)
        FakeCopy.counts["blocks"] += out is not None
        return out

    def issue(self, copies, keep):
        for dst, src, nbytes, _ in copies:
            ctypes.memmove(dst, src, nbytes)
        self.stats.count(sum(c[2] for c in copies))
        return None

    def deliver(self, item):
        FakeCopy.counts["delivered"] += 1
        return item[0]


@pytest.fixture
def fake_device(monkeypatch, accelerator):
    """install(device="cuda") on this CPU machine, FakeCopy its step; the
    DataLoader would run a pin thread (accelerator), which it must not."""
    monkeypatch.setattr(_delivery, "CopyToDevice", FakeCopy)
    monkeypatch.setattr(_install, "_check_gpu", lambda device: None)
    monkeypatch.setattr(_install, "_current_device", lambda: 0)
    FakeCopy.made.clear()
    FakeCopy.counts.clear()
    fastpin.install(device="cuda")
    yield
    fastpin.uninstall()


def steps():
    return [s() for s in FakeCopy.made if s() is not None]


def check_delivered(batches, refs):
    for out, ref in zip(batches, refs, strict=True):
        assert_batch(out, ref)
        # Copied out of the shared arena: nothing handed over lies in it.
        assert not any(in_shared_arena(t) for t in tensor_leaves(out))


@pytest.mark.parametrize("method,persistent", [("fork", False), ("fork", True), ("spawn", False),
                                               ("forkserver", True)])
def test_install_device_exact_against_stock(method, persistent, fake_device, nothing_left_behind):
    ds = PatternDataset(n=22, seed=7)                     # an uneven last batch
    dl = seeded(ds, 11, num_workers=2, pin_memory=True, multiprocessing_context=method,
                persistent_workers=persistent)
    for refs in stock_epochs(ds, 11, persistent):
        it = iter(dl)
        assert not hasattr(it, "_pin_memory_thread") and isinstance(it, _ahead.Delivering)
        check_delivered(list(it), refs)
        del it
    assert FakeCopy.counts["blocks"] == 2 * 6  # every batch as one block: no worker fell back
    assert dl.collate_fn is default_collate
    del dl


def test_install_device_hands_over_depth_ahead(fake_device):
    ds = PatternDataset(n=40, seed=3)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    refs = expected_batches(ds)
    for k, ref in enumerate(refs):
        assert_batch(next(it), ref)
        # Prepared ahead: what had arrived, up to the depth.
        assert len(it._fastpin_ahead.pending) <= min(_install._DEPTH, len(refs) - 1 - k)
    with pytest.raises(StopIteration):
        next(it)
    assert FakeCopy.counts["delivered"] == len(refs)


def test_install_device_named_structures_and_custom_collate(fake_device):
    ds = Named()
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True, collate_fn=collate_pair)
    refs = [collate_pair([ds[i] for i in range(b, min(b + 4, len(ds)))]) for b in range(0, len(ds), 4)]
    got = list(dl)
    for out, ref in zip(got, refs, strict=True):
        assert type(out["pair"]) is type(ref["pair"])
        assert_same(out["pair"].image, ref["pair"].image)
        assert_same(out["pair"].label, ref["pair"].label)
        assert out["tags"] == ref["tags"]
        assert type(out["array"]) is np.ndarray or isinstance(out["array"], torch.Tensor)
        np.testing.assert_array_equal(np.asarray(out["array"]), ref["array"])
    dl = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    for out, ref in zip(dl, [default_collate([ds[i] for i in range(b, min(b + 4, len(ds)))])
                             for b in range(0, len(ds), 4)], strict=True):
        assert type(out).__name__ == "NamedSample"
        assert_same(out.x, ref.x)
        assert_same(out.ids, ref.ids)
        assert out.tag == ref.tag


class SelfPinning:
    pinned = 0

    def __init__(self, value):
        self.value = value

    def pin_memory(self):
        SelfPinning.pinned += 1
        return SelfPinning(self.value + 1000)


class WithObjects(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


def collate_objects(samples):
    return {"x": torch.tensor(samples), "obj": SelfPinning(sum(samples))}


def test_install_device_asks_objects_to_pin_themselves(fake_device):
    SelfPinning.pinned = 0
    dl = DataLoader(WithObjects(), batch_size=4, num_workers=2, pin_memory=True,
                    collate_fn=collate_objects)
    got = list(dl)
    assert [b["obj"].value for b in got] == [1006, 1022]
    assert SelfPinning.pinned == 2  # in this process, as the pin thread would
    assert [b["x"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]


class Shards(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        n = 7 if info.id == 0 else 5                 # uneven: last batches short
        for i in range(n):
            yield {"x": torch.full((3,), 100 * info.id + i, dtype=torch.int64)}


@pytest.mark.parametrize("in_order", [True, False])
def test_install_device_iterable_uneven_and_out_of_order(in_order, fake_device):
    dl = DataLoader(Shards(), batch_size=3, num_workers=2, pin_memory=True, in_order=in_order)
    plain = DataLoader(Shards(), batch_size=3, num_workers=2, in_order=in_order)  # stock
    stock = sorted(tuple(b["x"][:, 0].tolist()) for b in plain)
    got = sorted(tuple(b["x"][:, 0].tolist()) for b in dl)
    assert got == stock and len(got) == 5


class Hang(torch.utils.data.Dataset):
    """Sample 0 arrives; every later one hangs its worker."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i > 0:
            time.sleep(10 ** 6)
        return torch.full((4,), 7, dtype=torch.int32)


class Gated(torch.utils.data.Dataset):
    """Sample 0 at once; every later one once the file `gate` exists."""

    def __init__(self, gate):
        self.gate = str(gate)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        while i > 0 and not os.path.exists(self.gate):
            time.sleep(0.01)
        return torch.arange(4, dtype=torch.int32) + 10 * i


def wait_until(predicate, seconds=30.0) -> bool:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_batch_ready_says_what_has_arrived(tmp_path):
    it = iter(DataLoader(Gated(tmp_path / "gate"), batch_size=1, num_workers=1))
    ready = _ahead.Ready()
    assert wait_until(lambda: ready(it))        # batch 0 came
    assert next(it).tolist() == [[0, 1, 2, 3]]
    time.sleep(0.3)
    assert not ready(it) and not _ahead.batch_ready(it)  # the worker waits at the gate
    (tmp_path / "gate").touch()
    assert wait_until(lambda: ready(it))
    assert next(it).tolist() == [[10, 11, 12, 13]]
    it._shutdown_workers()                      # its queue closed: next() says why
    assert ready(it)


@pytest.fixture
def one_batch_default_arena():
    """The default arena with room for about one batch, waiting for room."""
    from fastpin import _arena

    saved = (_arena.get_capacity(), _arena.policy())
    fastpin.configure(capacity=4 * 64 * 1024 + 64 * 1024, on_full="wait", wait_timeout=5)
    yield
    capacity, policy = saved
    fastpin.configure(capacity="auto" if capacity is None else capacity, on_full=policy["on_full"],
                      wait_timeout=policy["wait_timeout"])


class Bytes(torch.utils.data.Dataset):
    """Sample i: 64 KB that depend on i and on each byte's position."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return ((torch.arange(64 * 1024) * 7 + i * 131 + 3) % 251).to(torch.uint8)


@pytest.mark.parametrize("depth", [1, 2])
def test_loader_reading_ahead_never_waits_for_room_it_holds(depth, one_batch_default_arena):
    # Bug: with room for one batch and on_full="wait", the consumer's own
    # next() pinned the batch ahead while the one to hand over held the room,
    # waited for it (wait_timeout) and raised ArenaFullError: only that same
    # thread could have freed it. The batch ahead now waits for its turn.
    dl = DataLoader(Bytes(), batch_size=4, num_workers=1)
    it = iter(fastpin.Loader(dl, device=None, depth=depth, zero_copy=False))
    seen = 0
    t0 = time.monotonic()
    while True:
        try:
            x = next(it)
        except StopIteration:
            break
        want = torch.stack([Bytes()[i] for i in range(4 * seen, 4 * seen + 4)])
        assert torch.equal(x, want) and x.is_pinned() == torch.cuda.is_available()
        seen += 1
        del x  # the room is free again for the next batch
    assert seen == 6 and time.monotonic() - t0 < 5


def test_install_device_hands_over_what_arrived_while_workers_hang(fake_device):
    # Bug: the first next() took `depth` batches beyond the first before it
    # handed that one over, and waited forever on a hung worker.
    dl = DataLoader(Hang(), batch_size=1, num_workers=2, pin_memory=True)
    it = iter(dl)
    assert next(it).tolist() == [[7, 7, 7, 7]]
    workers = list(it._workers)
    del it
    assert workers_gone(workers)


def test_install_device_break_leaks_nothing(fake_device, nothing_left_behind):
    dl = DataLoader(PatternDataset(n=40), batch_size=BATCH, num_workers=2, pin_memory=True)
    for _ in range(3):
        it = iter(dl)
        next(it)
        step = weakref.ref(it._fastpin_ahead.step)
        workers = list(it._workers)
        del it  # no cycle: gone at once, its workers shut down, its batches dropped
        assert step() is None
        assert workers_gone(workers)
    for _ in dl:
        break
    gc.collect()
    assert not [s for s in steps() if s.in_flight]


def test_install_device_shutdown_drops_what_is_ahead(fake_device):
    dl = DataLoader(PatternDataset(n=40), batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    next(it)
    time.sleep(1.0)  # the workers' next batches arrive: the next next() takes them ahead
    next(it)
    assert it._fastpin_ahead.pending
    it._shutdown_workers()
    assert not it._fastpin_ahead.pending
    del it


def test_install_device_persistent_new_epoch_mid_epoch(fake_device):
    ds = PatternDataset(n=24, seed=5)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True, persistent_workers=True)
    refs = expected_batches(ds)
    it = iter(dl)
    assert_batch(next(it), refs[0])
    # A new epoch while batches of the old one are prepared ahead: none leaks into it.
    check_delivered(list(iter(dl)), refs)
    check_delivered(list(iter(dl)), refs)
    del it, dl


def test_install_device_killed_worker(fake_device, nothing_left_behind):
    dl = DataLoader(PatternDataset(n=400), batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    next(it)
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exited unexpectedly|killed by signal"):
        for _ in range(200):
            next(it)
    del it, dl


def test_install_device_uninstall_mid_epoch_and_two_loaders(fake_device):
    train_ds, val_ds = PatternDataset(n=24, seed=1), PatternDataset(n=16, seed=2)
    train = DataLoader(train_ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    val = DataLoader(val_ds, batch_size=BATCH, num_workers=1, pin_memory=True)
    t_refs, v_refs = expected_batches(train_ds), expected_batches(val_ds)
    it = iter(train)
    assert_batch(next(it), t_refs[0])
    check_delivered(list(val), v_refs)           # alive at once with the train epoch
    fastpin.uninstall()
    check_delivered(list(it), t_refs[1:])        # the epoch finishes as it began
    stock = iter(train)   # stock again: its own pin thread (which cannot pin on a CPU)
    assert not isinstance(stock, _ahead.Delivering) and hasattr(stock, "_pin_memory_thread")
    del stock
    fastpin.install(device="cuda")  # for the fixture's uninstall


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_install_device_stateful_dataloader_resumes_exactly(fake_device):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = PatternDataset(n=20, seed=8)
    refs = expected_batches(ds)
    dl = stateful.StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    it = iter(dl)
    assert isinstance(it, _ahead.Delivering)
    first = [next(it), next(it)]
    state = dl.state_dict()
    check_delivered(first, refs[:2])
    del it
    resumed = stateful.StatefulDataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    resumed.load_state_dict(state)
    check_delivered(list(resumed), refs[2:])


def test_install_device_without_zero_copy(fake_device):
    fastpin.install(zero_copy=False, device="cuda")
    ds = PatternDataset(n=12, seed=4)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2, pin_memory=True)
    for out, ref in zip(dl, expected_batches(ds), strict=True):
        assert_batch(out, ref)
    assert FakeCopy.counts["delivered"] == 3
    assert FakeCopy.counts["blocks"] == 0


def test_install_device_leaves_other_loaders_alone(fake_device):
    ds = PatternDataset(n=8)
    for dl in (DataLoader(ds, batch_size=4, num_workers=2),           # pin_memory=False
               DataLoader(ds, batch_size=4, pin_memory=True)):        # no workers
        it = iter(dl)
        assert not isinstance(it, _ahead.Delivering)
        for out, ref in zip(it, expected_batches(ds, 4), strict=True):
            assert_batch(out, ref)


# ---- without a GPU ----------------------------------------------------------------

no_gpu_here = pytest.mark.skipif(fastpin.cuda_available() and torch.cuda.is_available(),
                                 reason="a GPU is here")


@no_gpu_here
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda")])
def test_install_device_without_a_gpu_fails_at_once(device):
    reason = fastpin.cuda_status().reason
    with pytest.raises(RuntimeError, match="no usable CUDA GPU") as info:
        fastpin.install(device=device)
    assert reason in str(info.value)
    assert not fastpin.installed()


def test_install_device_bad_arguments():
    with pytest.raises(ValueError, match="CUDA GPU"):
        fastpin.install(device="cpu")
    with pytest.raises(TypeError, match="device"):
        fastpin.install(device=1.5)
    assert not fastpin.installed()


@no_gpu_here
def test_install_device_from_the_environment():
    code = ("import fastpin\n"
            "try:\n    fastpin.install()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "FASTPIN_INSTALL_DEVICE": "cuda"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "refused: fastpin.install(device='cuda'): no usable CUDA GPU" in out.stdout, out.stderr
    env["FASTPIN_INSTALL_DEVICE"] = "gpu"
    out = subprocess.run([sys.executable, "-c", "import fastpin"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "FASTPIN_INSTALL_DEVICE='gpu'" in out.stderr


# ---- the copying Loader over workers: torch's pin thread receives and pins -------

@pytest.fixture
def pin_thread_path(monkeypatch, accelerator):
    """A copying Loader (zero_copy=False, device=None) over a DataLoader with
    workers takes the pin-thread path as on a GPU (on this machine, where
    nothing is pinned, DataLoader runs its pin thread for the accelerator
    fixture); the thread of every batch's pin_received call recorded."""
    monkeypatch.setattr(fastpin.Loader, "_pins_in_thread", lambda self: True)
    calls = []
    original = _delivery.PinHost.pin_received

    def pin_received(self, batch):
        if batch is not None:  # persistent workers' resume markers carry None
            calls.append(threading.current_thread())
        return original(self, batch)

    monkeypatch.setattr(_delivery.PinHost, "pin_received", pin_received)
    yield calls
    gc.collect()


@pytest.mark.parametrize("method,persistent", [("fork", False), ("fork", True),
                                               ("forkserver", True)])
def test_copying_loader_pins_in_the_dataloaders_pin_thread(method, persistent, pin_thread_path,
                                                           nothing_left_behind):
    original = torch_pin_module.pin_memory
    ds = PatternDataset(n=22, seed=7)                     # an uneven last batch
    dl = seeded(ds, 11, num_workers=2, multiprocessing_context=method,
                persistent_workers=persistent)            # pin_memory=False, as given
    loader = fastpin.Loader(dl, device=None, zero_copy=False)
    for refs in stock_epochs(ds, 11, persistent):
        it = iter(loader)
        got = [next(it)]
        assert torch_pin_module.pin_memory is _install._dispatch  # while the epoch runs
        got += list(it)
        for out, ref in zip(got, refs, strict=True):
            assert_batch(out, ref)
    del it
    main = threading.current_thread()
    # Every batch of both epochs pinned in the DataLoader's own pin thread.
    assert len(pin_thread_path) == 2 * len(refs) and main not in pin_thread_path
    assert len(set(pin_thread_path)) == (1 if persistent else 2)
    assert dl.pin_memory is False and dl.collate_fn is default_collate  # the user's, untouched
    del loader, got, out, dl
    gc.collect()
    # Every pin thread gone with its iterator: torch's own pin function is back.
    deadline = time.monotonic() + 10
    while _install._pinners and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not _install._pinners and torch_pin_module.pin_memory is original


def test_pin_thread_dispatch_keeps_install_and_other_threads_as_they_were(pin_thread_path):
    module = torch_pin_module
    original = module.pin_memory
    fastpin.install(zero_copy=False)
    try:
        assert module.pin_memory is fastpin.pin_memory
        dl = DataLoader(PatternDataset(n=16, seed=3), batch_size=BATCH, num_workers=2)
        it = iter(fastpin.Loader(dl, device=None, zero_copy=False))
        first = next(it)
        assert module.pin_memory is _install._dispatch
        # Any other thread (a plain DataLoader's pin thread, this one) pins where
        # it did before: through fastpin.pin_memory while install() is on.
        x = torch.arange(1024, dtype=torch.float32)
        assert torch.equal(module.pin_memory(x), x)
        fastpin.uninstall()
        assert module.pin_memory is _install._dispatch  # the Loader's thread still served
        rest = list(it)
        assert 1 + len(rest) == 4 and len(pin_thread_path) == 4
        del it, first, rest
        deadline = time.monotonic() + 10
        while _install._pinners and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert module.pin_memory is original
        fastpin.install(zero_copy=False)
        assert module.pin_memory is fastpin.pin_memory
    finally:
        fastpin.uninstall()
    assert module.pin_memory is original


def test_copying_loader_pin_thread_leaves_when_a_worker_hangs(pin_thread_path):
    """The pin thread receives; a hung worker never holds back what arrived, and
    dropping the epoch shuts the workers and that thread down, as stock does."""
    module = torch_pin_module
    original = module.pin_memory
    dl = DataLoader(Hang(), batch_size=1, num_workers=2)
    it = iter(fastpin.Loader(dl, device=None, zero_copy=False))
    assert next(it).tolist() == [[7, 7, 7, 7]]
    source = it.producer.source
    workers, pin_thread = list(source._workers), source._pin_memory_thread
    del it, source
    gc.collect()
    assert workers_gone(workers)
    pin_thread.join(10)
    assert not pin_thread.is_alive()
    gc.collect()
    assert not _install._pinners and module.pin_memory is original


def test_copying_loader_pins_batches_that_reach_its_pin_thread_before_it_is_named(
        pin_thread_path, monkeypatch):
    """The view's iterator starts its pin thread before the Loader can name it:
    a batch that gets there first waits to be named, and is pinned the
    Loader's way (it went to torch's pin function, which fails where there is
    no accelerator, as on this machine)."""
    serve = _install.serve_pin_thread

    def late(it, pinner):
        time.sleep(0.5)  # the workers' first batches reach the pin thread meanwhile
        serve(it, pinner)

    monkeypatch.setattr(_install, "serve_pin_thread", late)
    ds = PatternDataset(n=16, seed=5)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=2)
    got = list(fastpin.Loader(dl, device=None, zero_copy=False))
    for out, ref in zip(got, expected_batches(ds), strict=True):
        assert_batch(out, ref)
    assert len(pin_thread_path) == len(got)
