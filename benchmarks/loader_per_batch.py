"""Per-batch cost of fastpin.Loader on the CPU, in three parts.

1. The Loader's own cost: an epoch over a DataLoader of small batches
   (num_workers=0), the plain DataLoader's epoch beside it, in microseconds
   per batch (best of several epochs). Modes without a GPU: device="cpu"
   (pass through) and device=None (pinned on the host), with the producer
   thread (depth=2) and without (depth=0); then the same batches from a list,
   without a thread: the Loader's own per-batch cost alone.
2. Whether the producer thread pays where the source works in this process
   (num_workers=0, the only place the Loader keeps one): a dataset with real
   per-batch work (NumPy, --work-ms a batch) under a loop that waits for its
   "GPU" (--step-ms a batch, slept, as a host waiting on a CUDA sync does),
   with the thread (depth=2) and without (depth=0), ms per batch.
3. Main-process CPU per batch of zero-copy over DataLoader workers (every
   thread of this process, named, from /proc/self/task), for the bench's
   workload cases: host mode (device=None) as the Loader runs it (no thread:
   the consumer's next() adopts and unpacks), and device mode's Python-level
   cost with a CPU buffer standing in for the device one (the real step, its
   copy a memmove and no CUDA stream or event), with the budget it is held
   to (50 us + 3 us a leaf).

    python benchmarks/loader_per_batch.py [--part 1 2 3] [--workers 2]
"""
from __future__ import annotations

import argparse
import json
import time
import types

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from fastpin import _delivery
from fastpin.bench import workloads
from fastpin.bench.procfs import cpu_ns_by_name, threads


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


def part_own_cost(batches: int, epochs: int) -> None:
    dl = DataLoader(Small(batches * 4), batch_size=4)
    plain = epoch_us(dl, batches, epochs)
    print(f"plain DataLoader: {plain:.1f} us/batch")
    for device in ("cpu", None):
        for depth in (0, 2):
            us = epoch_us(fastpin.Loader(dl, device=device, depth=depth), batches, epochs)
            print(f"Loader(device={device!r}, depth={depth}): {us:.1f} us/batch "
                  f"(+{us - plain:.1f})")
    # The same batches from a list: the Loader's own cost, without the DataLoader's
    # (short epochs: more of them).
    listed = list(dl)
    for device in ("cpu", None):
        us = epoch_us(fastpin.Loader(listed, device=device, depth=0), batches, 4 * epochs)
        print(f"Loader(list, device={device!r}, depth=0): {us:.1f} us/batch")


class Working(Dataset):
    """Each sample: `work_ms` / batch_size of NumPy work (sorting, which
    releases the GIL for most of it, as decoding libraries do)."""

    def __init__(self, n: int, work_ms: float, batch_size: int):
        self.n, self.batch_size = n, batch_size
        # Calibrate the sort's size to the time asked for.
        size, spent = 1 << 14, 0.0
        while True:
            a = np.random.default_rng(0).random(size)
            t0 = time.perf_counter()
            np.sort(a)
            spent = time.perf_counter() - t0
            if spent * 1e3 * batch_size >= work_ms or size > 1 << 26:
                break
            size *= 2
        self.size = max(1024, int(size * work_ms / (spent * 1e3 * batch_size)))
        self.data = np.random.default_rng(1).random(self.size)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.from_numpy(np.sort(self.data + i)[:256].astype(np.float32))


def part_thread_pays(work_ms: float, step_ms: float, batches: int) -> None:
    ds = Working(batches * 8, work_ms, 8)
    dl = DataLoader(ds, batch_size=8)
    t0 = time.perf_counter()
    n = sum(1 for _ in zip(range(50), dl))
    work_ms = (time.perf_counter() - t0) * 1e3 / n  # as measured, not as asked
    print(f"num_workers=0, {work_ms:.2f} ms of work a batch in the dataset, the loop waiting "
          f"{step_ms} ms a batch for its GPU (slept):")
    for depth, what in ((2, "producer thread (depth=2)"), (0, "no thread (depth=0)")):
        loader = fastpin.Loader(dl, device=None, depth=depth)
        for _ in zip(range(5), loader):   # warm-up
            pass
        t0 = time.perf_counter()
        n = 0
        for _ in loader:
            time.sleep(step_ms / 1e3)
            n += 1
        ms = (time.perf_counter() - t0) * 1e3 / n
        print(f"  {what}: {ms:.2f} ms/batch (alone: work {work_ms:.2f}, step {step_ms}; "
              f"overlapped they take {max(work_ms, step_ms):.2f}, in turn {work_ms + step_ms:.2f})")


class CpuDevice(_delivery.CopyToDevice):
    """Device mode's step with the CPU standing in for the GPU: the buffer a
    block is copied into is host memory, no stream or event, and the copy is
    not made (it is the GPU's DMA engine's work, not this process's). What it
    measures is the step's Python-level cost (adoption, the one-block views,
    the record, the bookkeeping), not CUDA's calls."""

    def __init__(self, target, zero_copy=False):
        _delivery.PassThrough.__init__(self, target)
        self.torch, self.device, self.depth = torch, torch.device("cpu"), target.depth
        self.pin_objects = target.pin_objects
        self.staging = _delivery._Staging(target, zero_copy)
        self.pool = target.pool if zero_copy else None
        self.pinned = self.staging.copy_arena
        self.copy_stream = types.SimpleNamespace(cuda_stream=None)
        self.in_flight = []

    def on_copy_stream(self, prepare, batch):
        return prepare(batch)

    def issue(self, copies, keep):
        self.stats.count(sum(c[2] for c in copies))
        return None

    def deliver(self, item):
        return item[0]


def leaves_of(batch) -> int:
    if isinstance(batch, dict):
        return sum(leaves_of(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(leaves_of(v) for v in batch)
    return isinstance(batch, (torch.Tensor, np.ndarray))


def part_zero_copy(cases: list, workers: int, batches: int, copy_ms: float) -> list:
    rows = []
    for case in cases:
        w = workloads.CASES[case]
        dataset = w.make()
        make = w.factory(dataset, workers, batches + 10)
        rows.append(measure(make(False), case, "stock DataLoader (no pin)", batches, workers,
                            copy_ms))
        for mode in ("host", "device (CPU buffer)"):
            saved = _delivery.CopyToDevice
            if mode != "host":
                _delivery.CopyToDevice = CpuDevice
            try:
                loader = fastpin.Loader(make(False), device=None, zero_copy=True)
                if mode != "host":
                    # Device mode's step over the same Loader: its target, a device.
                    loader._target.device = torch.device("cuda")
                    loader._mode = _delivery.choose(loader._target, True)
                rows.append(measure(loader, case, mode, batches, workers, copy_ms))
            finally:
                _delivery.CopyToDevice = saved
    return rows


def measure(loader, case: str, mode: str, batches: int, workers: int, copy_ms: float) -> dict:
    it = iter(loader)
    nleaves = 0
    for k, batch in enumerate(it):
        if k == 10:
            # The workers run far ahead (the loop waits for its GPU): what is
            # counted is the main process's part alone.
            t0, before = time.perf_counter(), threads()
        if k == 0:
            nleaves = leaves_of(batch)
        del batch
        time.sleep(copy_ms / 1e3)
        if k == batches + 9:
            t1, after = time.perf_counter(), threads()
            break
    del it
    by = {n: ns / 1e3 for n, ns in cpu_ns_by_name(before, after).items()}
    total = sum(by.values()) / batches
    sleeping = copy_ms * 1e3  # the loop's sleep is not CPU
    return {"case": case, "mode": mode, "workers": workers, "leaves": nleaves,
            "cpu_us_per_batch": round(total, 1), "budget_us": 50 + 3 * nleaves,
            "wall_us_per_batch": round((t1 - t0) * 1e6 / batches - sleeping, 1),
            "threads_us_per_batch": {n: round(us / batches, 1) for n, us in sorted(by.items())
                                     if us / batches >= 0.5}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--work-ms", type=float, default=4.0)
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--case", action="append",
                        help="part 3's cases (default: token_windows, recsys, images_u8)")
    parser.add_argument("--zc-batches", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    if 1 in args.part:
        part_own_cost(args.batches, args.epochs)
    if 2 in args.part:
        part_thread_pays(args.work_ms, args.step_ms, 200)
    if 3 in args.part:
        # The loop "computes" 20 ms a batch: the workers are ahead, and only the
        # main process's own work is counted.
        rows = part_zero_copy(args.case or ["token_windows", "recsys", "images_u8"],
                              args.workers, args.zc_batches, 20.0)
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
