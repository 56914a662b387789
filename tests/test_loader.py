"""fastpin.Loader on the CPU: pass-through and pinned-host modes with a real
DataLoader, epochs, break, exceptions, stats. GPU behaviour: test_gpu.py."""
import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin


class Patterned(Dataset):
    """Samples that differ per element and per index."""

    def __init__(self, n=64, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randint(-1000, 1000, (3, 5), generator=g), "i": i}


def expected(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(-1000, 1000, (3, 5), generator=g)


def check_epoch(batches, batch_size=4, n=64):
    seen = []
    for batch in batches:
        for row, i in zip(batch["x"], batch["i"].tolist()):
            assert torch.equal(row, expected(i))
            seen.append(i)
    assert seen == list(range(n))


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "fastpin-loader" and t.is_alive()]


def wait_for_no_loader_threads(timeout=10):
    deadline = time.monotonic() + timeout
    while loader_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return loader_threads()


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_exact(device, workers):
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=4, num_workers=workers), device=device)
    assert len(loader) == 16
    for _ in range(3):
        check_epoch(loader)
    assert loader.stats()["batches"] == 48
    assert not wait_for_no_loader_threads()


# Issue 26 item 2: two Loaders over one DataLoader with persistent workers both
# iterated its one persistent iterator: zip() of them gave 0 pairs an epoch, or
# KeyError: 0. Each Loader now has workers of its own, as with zero_copy=True.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", ["cpu", None])
def test_two_loaders_over_one_dataloader_with_persistent_workers(device):
    dl = DataLoader(Patterned(), batch_size=4, num_workers=2, persistent_workers=True)
    check_epoch(dl)
    own = dl._iterator  # the DataLoader's own persistent workers: never the Loaders'
    a, b = fastpin.Loader(dl, device=device), fastpin.Loader(dl, device=device)
    for _ in range(3):
        pairs = list(zip(a, b))
        assert len(pairs) == 16
        check_epoch(first for first, _ in pairs)
        check_epoch(second for _, second in pairs)
        check_epoch(dl)  # plain iteration, between and beside the Loaders' epochs
        assert dl._iterator is own
    del pairs, a, b
    assert not wait_for_no_loader_threads()


def test_pinned_host_mode_goes_through_the_arena():
    arena = fastpin._C.Arena(1 << 20, cuda=False)
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=8), device=None, arena=arena)
    batches = list(loader)
    assert arena.stats()["blocks_in_use"] == len(batches)
    check_epoch(batches, n=64)
    del batches
    gc.collect()
    assert arena.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_break_mid_epoch_leaves_nothing_running(depth):
    arena = fastpin._C.Arena(1 << 20, cuda=False)
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=4, num_workers=2),
                            device=None, depth=depth, arena=arena)
    for k, batch in enumerate(loader):
        if k == 3:
            break
    del batch
    assert not wait_for_no_loader_threads()
    gc.collect()
    assert arena.stats()["blocks_in_use"] == 0
    check_epoch(loader)  # and the next epoch starts afresh


def test_new_epoch_ends_the_previous_one():
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=4), device="cpu")
    first = iter(loader)
    next(first)
    check_epoch(loader)
    with pytest.raises(StopIteration):
        next(first)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_exception_keeps_its_type(workers):
    loader = fastpin.Loader(DataLoader(Patterned(fail_at=21), batch_size=4, num_workers=workers),
                            device="cpu")
    got = []
    with pytest.raises(KeyError, match="sample 21 is broken") as info:
        for batch in loader:
            got.extend(batch["i"].tolist())
    assert got == list(range(20))
    if workers == 0:
        # The original traceback: it reaches back into the dataset's code.
        assert any(entry.name == "__getitem__" for entry in info.traceback)
    assert not wait_for_no_loader_threads()


def test_iterable_of_plain_batches_and_nesting():
    batches = [(torch.arange(i, i + 6).view(2, 3), {"name": f"b{i}", "y": [torch.tensor(i)]})
               for i in range(5)]
    out = list(fastpin.Loader(batches, device=None))
    for (x, meta), (ox, ometa) in zip(batches, out):
        assert isinstance(ox, torch.Tensor) and torch.equal(ox, x)
        assert ometa["name"] == meta["name"] and torch.equal(ometa["y"][0], meta["y"][0])


def test_cuda_without_gpu_is_a_clear_error():
    if fastpin.cuda_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        fastpin.Loader([], device="cuda")


def test_bad_arguments():
    with pytest.raises(ValueError, match="depth"):
        fastpin.Loader([], device="cpu", depth=-1)
    with pytest.raises(ValueError, match="cuda and cpu"):
        fastpin.Loader([], device="meta")


def test_stats_fields():
    loader = fastpin.Loader(DataLoader(Patterned(), batch_size=16), device=None)
    list(loader)
    s = loader.stats()
    assert s["batches"] == 4
    assert s["bytes"] == 64 * (15 * 8 + 8)
    assert s["consumer_wait_s"] >= 0 and s["host_to_pinned_gbps"] > 0
    assert s["pool_high_water"] > 0 and s["fallbacks"] == 0


def test_device_copy_sources_by_leaf_type(tmp_path):
    """What the Loader's copy to a device sends for each leaf type (the
    handlers' device_source; the copy itself needs a GPU): CPU tensors
    contiguous and resolved, arrays as tensors over their data (memmaps too),
    object and masked arrays left as they are."""
    import numpy as np
    from fastpin import _leaves
    from conftest import patterned

    t = patterned((4, 6), torch.float32, 1)
    assert _leaves.device_source(t) is t
    nc = _leaves.device_source(t.t())
    assert nc.is_contiguous() and torch.equal(nc, t.t())
    c = patterned((3,), torch.complex64, 2).conj()
    assert not _leaves.device_source(c).is_conj() and torch.equal(_leaves.device_source(c), c)
    a = patterned((5, 2), np.int16, 3)[:, ::-1]
    assert torch.equal(_leaves.device_source(a), torch.from_numpy(a.copy()))
    mm = np.memmap(tmp_path / "m", dtype=np.int32, mode="w+", shape=(6,))
    mm[:] = patterned((6,), np.int32, 4)
    assert torch.equal(_leaves.device_source(mm), torch.from_numpy(np.array(mm)))
    assert _leaves.device_source(np.array([object()], dtype=object)) is None
    assert _leaves.device_source(np.ma.masked_array([1, 2], mask=[0, 1])) is None
