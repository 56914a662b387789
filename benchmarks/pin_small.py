"""Per-call cost of fastpin.pin_memory on small batches against a plain copy
(torch.empty_like(x).copy_(x)), on the CPU: the Python layer's share per batch
and per leaf (fastpin's targets: at most 1.3x at 64 KB, each extra leaf at
most 1.5 us). Median of many calls, one process; then the CPU time of
every thread of the process over all the calls (/proc/self/task/*/schedstat,
nanoseconds, grouped by thread name), per call, so copies handed to fastpin's
copy threads are counted too. The timed calls of every case and both paths
take turns (five rounds), so a drifting machine moves them alike.

    python benchmarks/pin_small.py [--calls N]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import fastpin
from fastpin.bench import procfs
from fastpin.bench.micro import interleaved


def call_times_ns(fn, calls: int) -> list:
    """Nanoseconds of each of `calls` calls of fn(), after a warm-up."""
    for _ in range(min(200, calls)):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return times


def median_us(fn, calls: int = 2000) -> float:
    """Median us of fn() over `calls` calls, after a warm-up."""
    return statistics.median(call_times_ns(fn, calls)) / 1e3


def thread_cpu_ns() -> collections.Counter:
    """CPU nanoseconds so far of every thread of this process, by thread name."""
    out: collections.Counter = collections.Counter()
    for thread in procfs.threads().values():
        out[thread.name] += thread.run_ns
    return out


def cpu_us_per_call(fn, calls: int) -> collections.Counter:
    """CPU microseconds per call of every thread, by name (after a warm-up)."""
    for _ in range(min(200, calls)):
        fn()
    before = thread_cpu_ns()
    for _ in range(calls):
        fn()
    after = thread_cpu_ns()
    after.subtract(before)
    return collections.Counter({k: v / calls / 1e3 for k, v in after.items() if v > 0})


def copy_batch(batch):
    if isinstance(batch, dict):
        return {k: torch.empty_like(v).copy_(v) for k, v in batch.items()}
    return torch.empty_like(batch).copy_(batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    arena = fastpin.default_arena()
    cases = [
        ("1 tensor, 4 KB", torch.arange(1024, dtype=torch.float32)),
        ("1 tensor, 64 KB", torch.arange(16384, dtype=torch.float32)),
        ("1 tensor, 1 MB", torch.arange(262144, dtype=torch.float32)),
        ("dict of 8 x 8 KB", {f"k{i}": torch.arange(2048, dtype=torch.float32) + i
                              for i in range(8)}),
        ("dict of 1 x 8 KB", {"k0": torch.arange(2048, dtype=torch.float32)}),
    ]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"arena {arena.capacity >> 20} MB, {args.calls} calls each, median")
    print(f"{'case':<20} {'copy us':>9} {'fastpin us':>11} {'ratio':>7}")
    fns = {}
    for name, batch in cases:
        fns[("copy", name)] = lambda batch=batch: copy_batch(batch)
        fns[("fastpin", name)] = lambda batch=batch: fastpin.pin_memory(batch)
    times = interleaved(fns, calls=args.calls, warmup=min(200, args.calls))
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    for name, _ in cases:
        base, fast = us[("copy", name)], us[("fastpin", name)]
        print(f"{name:<20} {base:9.2f} {fast:11.2f} {fast / base:7.2f}x")
    per_leaf = {path: (us[(path, "dict of 8 x 8 KB")] - us[(path, "dict of 1 x 8 KB")]) / 7
                for path in ("fastpin", "copy")}
    # The copy's own figure says how fast the machine ran this time: a shared
    # host's cores run some runs at half the speed of others.
    print(f"each extra 8 KB leaf: {per_leaf['fastpin']:.2f} us (the copy's: "
          f"{per_leaf['copy']:.2f} us, {per_leaf['fastpin'] / per_leaf['copy']:.2f}x)")
    print("\nCPU us per call, every thread of the process (by thread name)")
    print(f"{'case':<20} {'copy':>8} {'fastpin':>8}  fastpin by thread")
    for name, batch in cases:
        base = cpu_us_per_call(lambda: copy_batch(batch), args.calls)
        fast = cpu_us_per_call(lambda: fastpin.pin_memory(batch), args.calls)
        threads = ", ".join(f"{k} {v:.2f}" for k, v in fast.most_common())
        print(f"{name:<20} {sum(base.values()):8.2f} {sum(fast.values()):8.2f}  {threads}")


if __name__ == "__main__":
    main()
