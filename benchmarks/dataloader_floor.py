"""The floor of any loader built on torch's DataLoader iterator: main-process
CPU per batch when the workers return a few bytes (no tensors, no fastpin),
with the sampler, batch size and random sampling of the zero-copy benchmark.
Whatever a loader adds (pinning, adoption, the copy) comes on top of this.

    python benchmarks/dataloader_floor.py [--workers 1 2 8 15] [--batches 2000]
"""
from __future__ import annotations

import argparse
import time

from torch.utils.data import DataLoader, Dataset, RandomSampler


class _Indices(Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        return i


def _tiny(samples):
    """What a zero-copy worker sends back, in size: a short descriptor."""
    return ("block", len(samples), sum(samples))


def floor(workers: int, batches: int, batch_size: int = 256, warmup: int = 50) -> tuple:
    """(main-process CPU ms, wall ms) per batch over `batches` batches."""
    ds = _Indices()
    sampler = RandomSampler(ds, replacement=True, num_samples=batch_size * (batches + warmup))
    it = iter(DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=_tiny,
                         num_workers=workers))
    for _ in range(warmup):
        next(it)
    n = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in it:
        n += 1
        if n == batches:
            break
    return (time.process_time() - c0) / n * 1e3, (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, default=2000)
    args = p.parse_args()
    print("DataLoader alone, batches of 256 indices, a descriptor back per batch:")
    for nw in args.workers:
        cpu, wall = floor(nw, args.batches)
        print(f"  {nw:3d} workers: main-process CPU {cpu:.3f} ms/batch, wall {wall:.3f} ms/batch")


if __name__ == "__main__":
    main()
