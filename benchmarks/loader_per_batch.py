"""Per-batch cost of fastpin.Loader on the CPU: an epoch over a DataLoader of
small batches (num_workers=0), the plain DataLoader's epoch beside it, in
microseconds per batch (median of several epochs, one process). The Loader's
own share is the difference. Modes without a GPU: device="cpu" (pass
through) and device=None (pinned on the host), each with a thread (depth=2)
and without (depth=0); then the same batches from a list, without a thread:
the Loader's own per-batch cost alone.

    python benchmarks/loader_per_batch.py [--batches N] [--epochs N]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

import fastpin


class Small(Dataset):
    def __init__(self, n: int):
        self.x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": i}


def epoch_us(loader, batches: int, epochs: int) -> float:
    for _ in loader:  # warm-up (the arena, the thread)
        pass
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter_ns()
        for _ in loader:
            pass
        times.append((time.perf_counter_ns() - t0) / batches / 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=7)
    args = parser.parse_args()
    dl = DataLoader(Small(args.batches * 4), batch_size=4)
    plain = epoch_us(dl, args.batches, args.epochs)
    print(f"plain DataLoader: {plain:.1f} us/batch")
    for device in ("cpu", None):
        for depth in (0, 2):
            us = epoch_us(fastpin.Loader(dl, device=device, depth=depth), args.batches, args.epochs)
            print(f"Loader(device={device!r}, depth={depth}): {us:.1f} us/batch "
                  f"(+{us - plain:.1f})")
    # The same batches from a list: the Loader's own cost, without the DataLoader's
    # (short epochs: more of them).
    batches = list(dl)
    for device in ("cpu", None):
        us = epoch_us(fastpin.Loader(batches, device=device, depth=0), args.batches,
                      4 * args.epochs)
        print(f"Loader(list, device={device!r}, depth=0): {us:.1f} us/batch")


if __name__ == "__main__":
    main()
