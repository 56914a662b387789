"""The default arena sizing itself: float32 batches of 154 MB (256 images of
3x224x224), `live` of them held at once as DataLoader's pin thread holds its
workers' batches (8 workers x prefetch 2: 16; 15 workers: 30). Prints the
fallbacks, the warnings, what the arena holds at the end and the seconds of the
slowest pin_memory call (a growth: page-locking a new segment).

    python benchmarks/default_arena_growth.py LIVE [BATCHES]
"""
import collections
import logging
import sys
import time

import torch

import fastpin


def main() -> None:
    live = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("fastpin").addHandler(Keep(level=logging.WARNING))
    src = torch.arange(256 * 3 * 224 * 224, dtype=torch.float32)
    held = collections.deque(maxlen=live)
    slowest, t0 = 0.0, time.perf_counter()
    for i in range(n):
        src[i] = -i  # each batch differs
        t = time.perf_counter()
        out = fastpin.pin_memory(src)
        slowest = max(slowest, time.perf_counter() - t)
        if out[i] != -i or out[-1] != src[-1]:
            raise AssertionError(f"batch {i} came back different")
        held.append(out)
    wall = time.perf_counter() - t0
    arena, stats = fastpin.default_arena(), fastpin.stats()
    print(f"live={live} batches={n} fallbacks={stats['fallbacks']} warnings={len(warnings)} "
          f"arena={type(arena).__name__} capacity_MiB={arena.capacity >> 20} "
          f"segments={stats['arena'].get('segments', 1)} slowest_call_s={slowest:.2f} "
          f"wall_s={wall:.1f}")
    for w in warnings:
        print("  warning:", w[:120])


if __name__ == "__main__":
    main()
