"""Never stale, under load: thousands of batches through every Loader mode on
the GPU, with a random amount of GPU compute before each batch is read and
batches kept alive for random spans, in arenas small enough that every block
and staging chunk is reused hundreds of times.

Each batch is checked on the GPU, on the consumer's stream, after its random
compute: a checksum kernel reads it there, and batches held back are read
again when they are let go. A block or chunk reused while the consumer's
stream still had to read it, a device tensor whose memory the caching
allocator handed to the next copy, or a copy that read a block a worker was
still writing, changes a checksum. The checksums are compared with the host
once, at the end, so no host synchronisation hides a race.
"""
import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import fastpin
from fastpin import _C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (fastpin.cuda_available() and torch.cuda.is_available()),
                       reason="needs a CUDA GPU"),
]

BATCHES = 2500
BATCH_SIZE = 8
MB = 1 << 20
_WEIGHTS = (torch.arange(1 << 17, dtype=torch.int64) % 1021) + 1


def _sample_len(batch: int) -> int:
    """Bytes of each sample of batch `batch`: from 64 B to 128 KiB, so batches
    range from 512 B to 1 MiB and blocks of every size class are reused."""
    return 64 * (1 + (batch * 2654435761) % 2048)


class _Samples(Dataset):
    """Sample i of batch i // BATCH_SIZE: bytes that differ per element, sample and batch."""

    def __len__(self):
        return BATCHES * BATCH_SIZE

    def __getitem__(self, i):
        b = i // BATCH_SIZE
        g = torch.Generator().manual_seed(i)
        n = _sample_len(b)
        return {"x": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
                "y": torch.randint(-2**40, 2**40, (3,), generator=g), "i": i}


class _Batches(Sampler):
    """Whole batches (their samples share a shape) in a seeded random order."""

    def __init__(self, seed):
        self.order = list(range(BATCHES))
        random.Random(seed).shuffle(self.order)

    def __len__(self):
        return BATCHES

    def __iter__(self):
        for b in self.order:
            yield list(range(b * BATCH_SIZE, (b + 1) * BATCH_SIZE))


def _checksum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One int64 over the batch, on whatever device it is: weighted by position
    within each sample and by sample, so a shifted or swapped sample shows."""
    rows = x.to(torch.int64)
    w = _WEIGHTS[: rows.shape[1]].to(rows.device)
    by_sample = (rows * w).sum(1) + (y * torch.arange(1, 4, device=y.device)).sum(1)
    return (by_sample * torch.arange(1, len(by_sample) + 1, device=x.device)).sum()


def _expected(dataset: _Samples, b: int) -> int:
    samples = [dataset[i] for i in range(b * BATCH_SIZE, (b + 1) * BATCH_SIZE)]
    x = torch.stack([s["x"] for s in samples])
    y = torch.stack([s["y"] for s in samples])
    return int(_checksum(x, y))


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device,zero_copy", [
    ("cuda", False), ("cuda", True), (None, False), (None, True),
], ids=["device-copy", "device-zero-copy", "host-copy", "host-zero-copy"])
def test_thousands_of_batches_never_stale(device, zero_copy):
    seed = 1000 + 10 * (device is None) + zero_copy
    rng = random.Random(seed)
    dataset = _Samples()
    dl = DataLoader(dataset, batch_sampler=_Batches(seed), num_workers=4)
    # Small arenas: blocks and staging chunks come round again every few batches.
    if zero_copy:
        loader = fastpin.Loader(dl, device=device, zero_copy=True, capacity=12 * MB)
    else:
        loader = fastpin.Loader(dl, device=device, arena=_C.Arena(6 * MB))
    cycles = _cycles_per_ms()
    sums, order = [], []     # checksums on the GPU, and the batch each one checks
    held: list = []          # (release step, batch index, x, y), kept alive on purpose
    for step, batch in enumerate(loader):
        x, y = batch["x"], batch["y"]
        b = int(batch["i"][0]) // BATCH_SIZE
        if device is None:
            assert x.is_pinned()
            x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        # A random amount of compute before the batch is read: copies of the
        # next batches run meanwhile.
        torch.cuda._sleep(int(rng.choice((0, 0.05, 0.2, 1.0)) * cycles))
        sums.append(_checksum(x, y))
        order.append(b)
        if rng.random() < 0.2:
            held.append((step + rng.randint(1, 40), b, batch["x"], batch["y"]))
        del batch, x, y
        # Let held batches go at random; read each once more first.
        for entry in [h for h in held if h[0] <= step]:
            held.remove(entry)
            _, hb, hx, hy = entry
            if device is None:
                hx, hy = hx.to("cuda", non_blocking=True), hy.to("cuda", non_blocking=True)
            sums.append(_checksum(hx, hy))
            order.append(hb)
            del entry, hx, hy
    for _, hb, hx, hy in held:
        if device is None:
            hx, hy = hx.to("cuda", non_blocking=True), hy.to("cuda", non_blocking=True)
        sums.append(_checksum(hx, hy))
        order.append(hb)
    held.clear()
    got = torch.stack(sums).cpu().tolist()
    assert sorted(set(order)) == list(range(BATCHES)), "batches lost or repeated"
    want = {b: _expected(dataset, b) for b in set(order)}
    stale = [(b, g) for b, g in zip(order, got) if g != want[b]]
    assert not stale, f"{len(stale)} of {len(got)} reads saw stale data, first: batch {stale[0][0]}"
    stats = loader.stats()
    assert stats["batches"] == BATCHES
    del loader
    torch.cuda.synchronize()
