"""What one fork() costs the main process, the way DataLoader starts a worker:
after importing torch, after CUDA is initialised, and with a pinned fastpin
arena registered too. Every path of `python -m fastpin.bench` starts its
workers this way, so this is the floor of its "first batch s" column.

    python benchmarks/fork_cost.py [--forks 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import fastpin
from fastpin import _C


def fork_ms(n: int) -> tuple:
    """(median, max) ms the parent spends in os.fork(), over n forks; each child
    exits at once."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append((time.perf_counter() - t0) * 1e3)
        os.waitpid(pid, 0)
    return statistics.median(times), max(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forks", type=int, default=15)
    args = p.parse_args()

    def show(label: str) -> None:
        med, top = fork_ms(args.forks)
        print(f"  {label:44s} median {med:8.1f} ms, max {top:8.1f} ms ({args.forks} forks)")

    print(f"fork() in the parent, {os.cpu_count()} CPUs, torch {torch.__version__}:")
    show("torch imported")
    data = torch.randint(0, 256, (1024, 3, 224, 224), dtype=torch.uint8)  # the bench's images
    show("+ 154 MB of images in memory")
    if not torch.cuda.is_available():
        print("  no GPU: the CUDA rows are not measured")
        return
    torch.zeros(1, device="cuda")
    show("+ CUDA initialised (one tensor on the GPU)")
    arena = _C.Arena(1 << 30, cuda=fastpin.cuda_available())
    show(f"+ a 1 GiB fastpin arena (registered: {arena.registered})")
    shared = _C.Arena(1 << 30, shared=True, cuda=fastpin.cuda_available())
    show(f"+ a 1 GiB shared (memfd) arena (registered: {shared.registered})")
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    show("+ 1 GiB pinned by torch (cudaHostAlloc)")
    del arena, shared, pinned, data


if __name__ == "__main__":
    main()
