"""The side-stream race, counted, and what a block's free costs.

    python benchmarks/stream_race.py [--reps 50]

Race: a side stream busy with a ~10 ms kernel; on it, `y = x.to("cuda",
non_blocking=True)` from a pinned 4 MB tensor; `del x`; pin a new batch with
another pattern at once into an arena with room for one batch; synchronise
the side stream; compare `y` with the first pattern. Counted for torch's own
pinning and for fastpin.pin_memory with no stream named.

Cost: the free of one block (the DLPack deleter's share: the fence, or the
event on one stream) and a whole pin_memory + free of a 64 KB batch, median
of repeated calls. Runs against whichever fastpin is importable, so the same
script measures an older checkout too (PYTHONPATH=that checkout)."""
from __future__ import annotations

import argparse
import json

import torch

import fastpin
from fastpin import _C
from pin_small import median_us  # beside this file: python puts its folder first on sys.path

MB = 1 << 20


def patterned(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def sleep_ms(ms, _cal=[]):
    if not _cal:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _cal.append(50_000_000 / start.elapsed_time(end))
    torch.cuda._sleep(int(_cal[0] * ms))


def race(pin, reps, nbytes=4 * MB):
    side = torch.cuda.Stream()
    corrupt = 0
    for i in range(reps):
        first, second = patterned(nbytes, 2 * i + 1), patterned(nbytes, 2 * i + 2)
        x = pin(first)
        with torch.cuda.stream(side):
            sleep_ms(10)
            y = x.to("cuda", non_blocking=True)
        del x
        again = pin(second)
        side.synchronize()
        corrupt += not torch.equal(y.cpu(), first)
        del again, y
    return corrupt


def free_cost(arena):
    """Median µs of allocating a 256-byte block that dies at once: the alloc,
    the free's event (the fence) and its retirement at the next alloc."""
    return median_us(lambda: arena.alloc(256))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.cuda.init()
    status = _C.cuda_status()
    result = {"fence": status.get("fence"),
              "driver_version": status["driver_version"]}

    result["torch_corrupt"] = race(lambda t: t.pin_memory(), args.reps)
    one = _C.Arena(4 * MB)
    result["fastpin_corrupt"] = race(lambda t: fastpin.pin_memory(t, arena=one), args.reps)
    result["reps"] = args.reps

    arena = _C.Arena(64 * MB)
    torch.cuda.synchronize()
    result["alloc_free_us"] = free_cost(arena)
    small = patterned(64 * 1024, 7)
    result["pin_free_64k_us"] = median_us(lambda: fastpin.pin_memory(small, arena=arena))
    # How many blocks that loop cycles through: one when each block's event
    # has completed by the next pin, more while fences are still in flight.
    seen = set()
    for _ in range(2000):
        seen.add(fastpin.pin_memory(small, arena=arena).data_ptr())
    result["pin_free_64k_blocks"] = len(seen)
    # One block's room: each pin waits for the previous free's fence, so this
    # is the pin plus the time a fence takes to complete on an idle GPU.
    one = _C.Arena(64 * 1024)
    result["pin_free_64k_one_block_us"] = median_us(lambda: fastpin.pin_memory(small, arena=one),
                                                    calls=500)
    result["torch_copy_64k_us"] = median_us(lambda: torch.empty_like(small).copy_(small))
    for key, value in result.items():
        print(f"{key:>20}: {value:.2f}" if isinstance(value, float) else f"{key:>20}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
