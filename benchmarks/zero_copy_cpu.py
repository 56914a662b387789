"""Main-process CPU per batch, zero-copy host mode against a plain DataLoader,
on any machine (no GPU needed): 64 uint8 images 3x64x64 a batch, 1 worker.

    PYTHONPATH=. python benchmarks/zero_copy_cpu.py
"""
import time

import torch
from torch.utils.data import DataLoader, RandomSampler

import fastpin
from fastpin.bench import _Images as Images  # the suite's in-memory image set


def run(zero_copy, batches=400):
    data = torch.randint(0, 256, (512, 3, 64, 64), dtype=torch.uint8)
    sampler = RandomSampler(Images(data), replacement=True, num_samples=64 * (batches + 20))
    dl = DataLoader(Images(data), batch_size=64, sampler=sampler, num_workers=1)
    loader = (fastpin.Loader(dl, device=None, zero_copy=True, capacity=64 << 20)
              if zero_copy else dl)
    it = iter(loader)
    for _ in range(10):
        next(it)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.process_time() - c0) / batches * 1e3, (time.perf_counter() - t0) / batches * 1e3


if __name__ == "__main__":
    for name, zc in (("DataLoader", False), ("fastpin.Loader(device=None, zero_copy=True)", True)):
        cpu, wall = run(zc)
        print(f"{name}: {cpu:.3f} ms main-process CPU, {wall:.3f} ms wall per batch")
