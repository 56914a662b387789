"""When the first batches of a new DataLoader arrive under install() and
install(device="cuda"): seconds from making the iterator to each of the
first batches (0-3, then every tenth), with fastpin's own log of the shared
pool's growth stamped on the same clock, so a batch that waited for a
segment shows it; then the batches a second from the 20th on.

    python benchmarks/first_batches.py [--case images_f32 --case video] [--workers 15]
        [--batches 60]

The bench's workload cases (fastpin.bench.workloads), each a fresh
DataLoader per path; needs a GPU.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

import fastpin
from fastpin.bench import workloads


class _Since(logging.Formatter):
    """Log lines stamped with the seconds since `start[0]`."""

    def __init__(self, start: list):
        super().__init__()
        self.start = start

    def format(self, record: logging.LogRecord) -> str:
        return f"{time.perf_counter() - self.start[0]:8.3f}  {record.getMessage()}"


def run(case: str, device, workers: int, batches: int, start: list) -> None:
    w = workloads.CASES[case]
    dataset = w.make()
    if device is None:
        fastpin.install()
    else:
        fastpin.install(device=device)
    torch.cuda.synchronize()
    start[0] = time.perf_counter()
    it = iter(w.factory(dataset, workers, batches + 5)(True))
    stamps = []
    for k, batch in enumerate(it):
        torch.cuda.synchronize()
        stamps.append(time.perf_counter() - start[0])
        if k < 4 or k % 10 == 0:
            print(f"{stamps[-1]:8.3f}  batch {k}")
        del batch
        if k == batches:
            break
    rate = (batches - 20) / (stamps[batches] - stamps[20])
    print(f"== {case}, install({'' if device is None else 'device=' + repr(device)}): "
          f"first batch {stamps[0]:.3f} s, second {stamps[1]:.3f} s; batches 20-{batches} "
          f"at {rate:.1f} a second\n")
    del it
    fastpin.uninstall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=sorted(workloads.CASES),
                        help="a workload case (repeatable; default images_f32 and video)")
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--batches", type=int, default=60, help="batches to take (at least 30)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_batches.py: needs a CUDA GPU")
    start = [time.perf_counter()]
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Since(start))
    log = logging.getLogger("fastpin")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    for case in args.case or ["images_f32", "video"]:
        for device in (None, "cuda"):
            run(case, device, args.workers, max(args.batches, 30), start)


if __name__ == "__main__":
    main()
