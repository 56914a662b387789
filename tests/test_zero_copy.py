"""Zero-copy mode on the CPU: DataLoader workers collate into the shared arena,
the main process adopts the blocks without copying. The arena is shared even
with no GPU, so everything but the DMA is tested here."""
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import fastpin
from conftest import process_state
from fastpin import _C

MB = 1 << 20
START_METHODS = ["fork", "spawn", "forkserver"]


def expected(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g)


class Images(Dataset):
    def __init__(self, n=96, kill_at=None):
        self.n, self.kill_at = n, kill_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.kill_at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"img": expected(i), "feat": torch.full((5,), i, dtype=torch.float64) + 0.5,
                "label": i}


class Stream(IterableDataset):
    def __init__(self, n=50):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        for i in range(wid, self.n, workers):
            yield {"img": expected(i), "feat": torch.full((5,), i, dtype=torch.float64) + 0.5,
                   "label": i}


def inside(t, arena):
    return arena.base <= t.data_ptr() < arena.base + arena.capacity


def check(batches, arena, n, in_arena=True):
    seen = []
    for b in batches:
        for img, feat, i in zip(b["img"], b["feat"], b["label"].tolist()):
            assert torch.equal(img, expected(i)), f"sample {i} differs"
            assert torch.equal(feat, torch.full((5,), i, dtype=torch.float64) + 0.5)
            seen.append(i)
        if in_arena:
            assert inside(b["img"], arena) and inside(b["label"], arena)
    assert sorted(seen) == list(range(n))
    return seen


def blocks_settle(arena, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        arena.collect()
        if arena.stats()["blocks_in_use"] == 0:
            return 0
        time.sleep(0.05)
    return arena.stats()["blocks_in_use"]


def holders(arena) -> str:
    """For a failure's message: who holds the blocks still in use (index, owner
    pid or 0 once adopted, that process's state), how many reclaim() frees
    then, and the threads still running."""
    owners = []
    for i in range(arena.stats()["max_blocks"]):
        try:
            pid = arena.owner(i)
        except ValueError:
            continue  # not allocated
        owners.append((i, pid, process_state(pid) if pid else "-"))
    return (f"blocks in use (index, owner, state): {owners}; reclaim() frees {arena.reclaim()}; "
            f"threads {[t.name for t in threading.enumerate()]}")


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_write_into_the_shared_arena(method, persistent):
    dl = DataLoader(Images(), batch_size=10, num_workers=2, multiprocessing_context=method,
                    persistent_workers=persistent)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=8 * MB)
    arena = loader.arena
    assert arena.fd >= 0
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == 10 and len(batches[-1]["label"]) == 6  # uneven last batch
        assert check(batches, arena, 96) == list(range(96))
        del batches
    stats = loader.stats()
    assert stats["worker_fallbacks"] == 0 and stats["fallbacks"] == 0
    assert blocks_settle(arena) == 0


def test_custom_collate_is_copied_in_the_worker():
    def collate(samples):
        return (torch.stack([s["img"] for s in samples]),
                np.array([s["label"] for s in samples], dtype=np.int32))

    dl = DataLoader(Images(40), batch_size=8, num_workers=2, collate_fn=collate)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for imgs, labels in loader:
        assert isinstance(labels, np.ndarray) and labels.dtype == np.int32
        for img, i in zip(imgs, labels.tolist()):
            assert torch.equal(img, expected(i))
        assert inside(imgs, loader.arena)


@pytest.mark.parametrize("in_order", [True, False])
def test_out_of_order_and_iterable_datasets(in_order):
    dl = DataLoader(Stream(), batch_size=7, num_workers=2, in_order=in_order)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    check(list(loader), loader.arena, 50)


def test_full_arena_falls_back_to_the_ordinary_path(caplog):
    # Room for about one batch: workers find it full and collate the usual way.
    dl = DataLoader(Images(), batch_size=16, num_workers=2, prefetch_factor=4)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=20_000, depth=4)
    with caplog.at_level("WARNING", logger="fastpin"):
        batches = list(loader)
    check(batches, loader.arena, 96, in_arena=False)
    stats = loader.stats()
    assert stats["worker_fallbacks"] > 0 and stats["fallbacks"] == stats["worker_fallbacks"]
    # Fallen-back batches are pinned elsewhere: they take no room the workers need.
    assert sum(not inside(b["img"], loader.arena) for b in batches) == stats["fallbacks"]
    # Said once, with a capacity that holds what is in flight: 2 workers x 4
    # prefetched, depth 4, and 6 more (one being copied, copies queued, slack),
    # each a block of one batch.
    advice = [r.getMessage() for r in caplog.records if "shared arena full" in r.getMessage()]
    assert len(advice) == 1
    batch_bytes = sum(x.numel() * x.element_size() for x in batches[0].values()
                      if isinstance(x, torch.Tensor))
    assert f"capacity={_C.block_size(batch_bytes) * (8 + 4 + 6)} " in advice[0]


def broken_epoch(dataset, batch_size: int) -> fastpin.Loader:
    """A zero-copy Loader over `dataset` whose first epoch broke after 3 batches."""
    dl = DataLoader(dataset, batch_size=batch_size, num_workers=2)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    return loader


def test_break_and_reiterate_leave_no_blocks():
    loader = broken_epoch(Images(), batch_size=8)
    check(list(loader), loader.arena, 96)
    assert blocks_settle(loader.arena) == 0, holders(loader.arena)


class SlowImages(Images):
    """Images that take a while each: a break finds the Loader's thread
    waiting inside the DataLoader, and the workers still collating."""

    def __getitem__(self, i):
        time.sleep(0.05)
        return super().__getitem__(i)


@pytest.mark.parametrize("attempt", range(3))
def test_a_break_without_another_epoch_leaves_no_blocks(attempt):
    """The batches the workers had shipped when the epoch broke come back once
    the workers are gone, with no further epoch to reclaim them."""
    loader = broken_epoch(SlowImages(), batch_size=4)
    assert blocks_settle(loader.arena) == 0, holders(loader.arena)


def test_killed_worker_raises_and_leaks_nothing():
    dl = DataLoader(Images(kill_at=45), batch_size=5, num_workers=2)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    arena = loader.arena
    with pytest.raises(RuntimeError, match="worker"):
        for batch in loader:
            del batch  # hold nothing: what stays in use must be a leak
    assert blocks_settle(arena) == 0, holders(arena)
    assert arena.is_valid()


def test_several_loaders_in_one_process():
    a = fastpin.Loader(DataLoader(Images(30), batch_size=6, num_workers=2), device=None,
                       zero_copy=True, capacity=2 * MB)
    b = fastpin.Loader(DataLoader(Images(40), batch_size=4, num_workers=2), device=None,
                       zero_copy=True, capacity=2 * MB)
    assert a.arena.token != b.arena.token
    for _ in range(2):
        check(list(a), a.arena, 30)
        check(list(b), b.arena, 40)


def test_no_workers_collates_in_the_main_process():
    loader = fastpin.Loader(DataLoader(Images(20), batch_size=4), device=None, zero_copy=True,
                            capacity=2 * MB)
    check(list(loader), loader.arena, 20)
    assert blocks_settle(loader.arena) == 0


def test_zero_copy_needs_a_dataloader():
    with pytest.raises(TypeError, match="DataLoader"):
        fastpin.Loader([1, 2], device=None, zero_copy=True)


def test_batches_outlive_the_loader():
    loader = fastpin.Loader(DataLoader(Images(24), batch_size=6, num_workers=2), device=None,
                            zero_copy=True, capacity=2 * MB)
    arena = loader.arena
    batches = list(loader)
    del loader
    gc.collect()
    check(batches, arena, 24)
    del batches
    assert blocks_settle(arena) == 0


# ---- leaves rebuilt as they were collated -----------------------------------------

POINT = np.dtype([("x", np.int32), ("y", np.float64)])


def point_samples(i):
    return np.array([(i, i + 0.5), (-i, i * 2.25)], dtype=POINT)


def collate_points(samples):
    return {"points": np.concatenate([s["points"] for s in samples]),
            "masked": np.ma.masked_array([s["label"] for s in samples],
                                         mask=[s["label"] % 2 == 0 for s in samples]),
            "img": torch.stack([s["img"] for s in samples])}


class Points(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"points": point_samples(i), "label": i, "img": expected(i)}


def test_zero_copy_structured_dtype_comes_back_as_void():
    dl = DataLoader(Points(), batch_size=6, num_workers=2, collate_fn=collate_points)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for k, batch in enumerate(loader):
        ids = range(6 * k, 6 * k + 6)
        assert batch["points"].dtype == POINT
        assert batch["points"].tobytes() == np.concatenate([point_samples(i) for i in ids]).tobytes()
        assert type(batch["masked"]) is np.ma.MaskedArray
        assert batch["masked"].mask.tolist() == [i % 2 == 0 for i in ids]
        assert inside(batch["img"], loader.arena)
    assert k == 3


def collate_nested(samples):
    return {"ragged": torch.nested.nested_tensor([torch.arange(s["label"] % 5 + 1) for s in samples]),
            "img": torch.stack([s["img"] for s in samples])}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_zero_copy_nested_tensor_fails_with_sizes_error():
    dl = DataLoader(Images(24), batch_size=6, num_workers=2, collate_fn=collate_nested)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for k, batch in enumerate(loader):
        ragged = batch["ragged"].unbind()
        assert [r.tolist() for r in ragged] == [list(range(i % 5 + 1)) for i in range(6 * k, 6 * k + 6)]
        assert inside(batch["img"], loader.arena)
    assert k == 3


def collate_grad(samples):
    return (torch.stack([s["feat"] for s in samples]).requires_grad_(),
            torch.stack([s["img"] for s in samples]))


def test_zero_copy_loses_requires_grad():
    dl = DataLoader(Images(24), batch_size=6, num_workers=2, collate_fn=collate_grad)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for feat, img in loader:
        assert feat.requires_grad and not img.requires_grad
        assert inside(feat, loader.arena)


def collate_channels_last(samples):
    return {"img": torch.stack([s["img"] for s in samples]).to(memory_format=torch.channels_last),
            "label": torch.tensor([s["label"] for s in samples])}


def test_zero_copy_channels_last_keeps_strides():
    dl = DataLoader(Images(24), batch_size=6, num_workers=2, collate_fn=collate_channels_last)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=4 * MB)
    for batch in loader:
        img = batch["img"]
        assert img.is_contiguous(memory_format=torch.channels_last) and inside(img, loader.arena)
        for x, i in zip(img, batch["label"].tolist()):
            assert torch.equal(x, expected(i))


def test_device_views_match_host_views():
    """Device mode's views of one copied block (here over a CPU tensor of the
    block's bytes) read what the host views read: contiguous and channels_last
    tensors, NumPy leaves, sub-word dtypes, requires_grad."""
    from fastpin import _leaves
    from fastpin._walk import flatten

    arena = _C.Arena(4 * MB, cuda=False)
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8, generator=g)
              .to(memory_format=torch.channels_last),
              torch.randn(7, 3, generator=g).requires_grad_(),
              np.arange(11, dtype=np.int16) * 3 - 7,
              torch.rand(9, generator=g) > 0.5,
              torch.randn(3, 4, generator=g, dtype=torch.float64).t()]
    plan = _leaves.Plan(leaves, keep_pinned=False)
    block, _ = arena.pin(plan.sources, 1)
    plan.fill(block)
    refs = [(offset, layout) for offset, layout in zip(plan.offsets, plan.layouts)]
    buffer = torch.from_dlpack(block.dlpack(0, (block.nbytes,), (1,), 1, 8, 1))
    views = _leaves.device_views(refs, buffer)
    for x, view, (offset, layout) in zip(leaves, views, refs):
        host = layout.host(block, offset)
        want = torch.from_numpy(x) if isinstance(x, np.ndarray) else x.detach()
        assert view.dtype == want.dtype and view.shape == want.shape
        assert view.stride() == (host.stride() if isinstance(host, torch.Tensor)
                                 else tuple(s // x.itemsize for s in host.strides))
        assert torch.equal(view, want)
    assert views[0].is_contiguous(memory_format=torch.channels_last)
    del views, buffer, block
    gc.collect()
    assert arena.is_valid()


class _Rows(Dataset):
    """1 MB patterned uint8 rows."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _thread_minor_faults() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])  # stat's field 10


def test_adoption_touches_no_page_of_the_batch_and_copies_nothing():
    """Issue 14's zero-copy CPU target: what the main process does for a batch
    must not depend on its bytes. Adopting a 16 MB batch that a forked worker
    wrote (4,096 pages this process never touched) and making its tensor
    reads none of them, and the tensor lies in the shared arena."""
    from conftest import patterned

    from fastpin import _zerocopy

    rows = patterned((48, MB), torch.uint8, 14)
    arena = _C.Arena(96 * MB, shared=True, cuda=False)
    pool = _zerocopy.Pool(None, loader=None, depth=1, cap=arena.capacity, arena=arena)
    dl = DataLoader(_Rows(rows), batch_size=16, num_workers=1, multiprocessing_context="fork",
                    prefetch_factor=1)
    view = _zerocopy.dataloader_view(dl, _zerocopy.wrap_collate(dl.collate_fn, pool))
    it = iter(view)
    time.sleep(1.0)  # let the worker write its batches before the count starts
    faults = []
    for first in (0, 16, 32):
        before = _thread_minor_faults()
        batch, adopted = _zerocopy.receive(_zerocopy.adopted(next(it)))
        faults.append(_thread_minor_faults() - before)
        assert adopted and inside(batch, arena)
        assert torch.equal(batch, rows[first:first + 16])  # read only after the count
        del batch
    del it
    # The page tables, the unpickler and the queue fault a few pages; a touch
    # or a copy of the batch would fault 4,096. The first batch is not
    # counted: its first calls import and allocate.
    assert max(faults[1:]) < 256, faults
    assert blocks_settle(arena) == 0
