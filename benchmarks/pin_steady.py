"""pin_memory of one small batch in a long loop, window by window, beside
torch's one-thread pin in the same windows: whether the per-call time drifts
as the loop goes on (a machine warming up, blocks cycling because their
fences lag), which a single median hides.

    python benchmarks/pin_steady.py [--bytes 65536] [--windows 12]
        [--calls 10000]

Each window times --calls calls of fastpin.pin_memory(x), then as many of
x.pin_memory() with torch's threads set to 1 (what DataLoader's pin thread
runs), and prints both medians (us) and the distinct blocks fastpin's results
lay in (1: the freed block is reused at once).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastpin


def window(fn, calls: int) -> tuple:
    """(median us, distinct data pointers) over `calls` calls, each result dropped."""
    times, ptrs = [], set()
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        out = fn()
        times.append(time.perf_counter_ns() - t0)
        ptrs.add(out.data_ptr())
        del out
    return statistics.median(times) / 1e3, len(ptrs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=65536)
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--calls", type=int, default=10000)
    args = p.parse_args()
    g = torch.Generator().manual_seed(args.bytes)
    x = torch.randint(0, 256, (args.bytes,), dtype=torch.uint8, generator=g)
    if not torch.equal(fastpin.pin_memory(x), x):
        raise AssertionError("fastpin.pin_memory returned different data")
    cuda = fastpin.cuda_available() and torch.cuda.is_available()
    print(f"{args.bytes} bytes, {args.calls} calls a window; fence: {fastpin.cuda_status().fence}")
    threads = torch.get_num_threads()
    for w in range(args.windows):
        fast, blocks = window(lambda: fastpin.pin_memory(x), args.calls)
        line = f"  window {w:2d}: fastpin {fast:6.2f} us ({blocks} blocks)"
        if cuda:
            torch.set_num_threads(1)
            ref, _ = window(lambda: x.pin_memory(), args.calls)
            torch.set_num_threads(threads)
            line += f", torch pin 1 thread {ref:6.2f} us, ratio {ref / fast:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
