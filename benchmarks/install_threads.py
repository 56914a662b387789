"""Where install()'s main-process CPU goes, beside Loader(zero_copy): every
thread of this process by name (/proc/self/task), per batch, for the bench's
workload cases (--case, repeatable; default images_u8), each path delivering
to the GPU: install and zero_copy_host with .to(non_blocking=True) in the loop
as a training script does; zero_copy_cuda (Loader(dl, device="cuda")) and
install_device (install(device="cuda")) deliver there themselves, in the
loop's own next() (the .to() is a no-op). The line gives the batch's leaves
and the budget of main-process CPU a zero-copy device batch is held to
(50 us + 3 us a leaf). The path torch_floor is torch's own share of it: the
same DataLoader (workers, sampler, batch size) whose samples are their indices
and whose batch is one int, so the main process does nothing but torch's
per-batch protocol (sampler, index queue, result queue, __next__). The paths
stock (DataLoader(pin_memory=True), then .to()) and loader_copy
(Loader(dl, device="cuda", zero_copy=False), whose stats' seconds per batch are
given) show the copying path beside the stock one it replaces.

    python benchmarks/install_threads.py [--workers 15] [--batches 200] [--case images_u8]
        [--path install_device --path zero_copy_cuda]

Also says whether the install() batch's leaves are pinned as torch sees them
(is_pinned), how long the loop's .to() calls take on the CPU, and the shared
arena's capacity, high water and the workers' fallbacks.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fastpin
from fastpin.bench import workloads
from fastpin.bench.procfs import cpu_ns_by_name, threads


def tensors(batch) -> list:
    """The tensor leaves of a batch (a dict, list or tuple, nested)."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for x in batch for t in tensors(x)]
    return [batch] if isinstance(batch, torch.Tensor) else []


class Indices(torch.utils.data.Dataset):
    """Each sample is its index: a DataLoader over it does torch's work alone."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i


def floor_loader(w, dataset, workers: int, batches: int):
    """The case's DataLoader (sampler, batch size, workers) over Indices, each
    batch collated to one int (len): no tensor crosses, nothing is pinned."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    indices = Indices(len(dataset))
    sampler = RandomSampler(indices, replacement=True, num_samples=w.batch_size * batches,
                            generator=torch.Generator().manual_seed(0))
    if w.batched:
        return DataLoader(indices, sampler=BatchSampler(sampler, w.batch_size, True),
                          batch_size=None, num_workers=workers, collate_fn=len)
    return DataLoader(indices, batch_size=w.batch_size, sampler=sampler, collate_fn=len,
                      num_workers=workers, drop_last=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(path: str, case: str, workers: int, batches: int) -> dict:
    w = workloads.CASES[case]
    dataset = w.make()
    make = w.factory(dataset, workers, batches + 10)
    # Without a GPU (the CPU machine) the host paths run, and nothing is copied on.
    device = torch.device("cuda") if torch.cuda.is_available() else None
    if path == "torch_floor":
        source = floor_loader(w, dataset, workers, batches + 10)
    elif path == "install":
        fastpin.install()
        source = make(True)
    elif path == "install_device":
        fastpin.install(device="cuda")
        source = make(True)
    elif path == "stock":
        source = make(True)
    elif path == "loader_copy":
        source = fastpin.Loader(make(False), device=device, zero_copy=False)
    elif path == "zero_copy_host":
        source = fastpin.Loader(make(False), device=None, zero_copy=True)
    else:
        source = fastpin.Loader(make(False), device=device, zero_copy=True)
    it = iter(source)
    to_s, pinned, nleaves = 0.0, None, 0
    for k, batch in enumerate(it):
        if k == 10:
            sync()
            t0, before = time.perf_counter(), threads()
        leaves = tensors(batch)
        nleaves = nleaves or len(leaves)
        if leaves and not leaves[0].is_cuda and device is not None:
            if pinned is None:
                pinned = [x.is_pinned() for x in leaves]
            c0 = time.thread_time()
            leaves = [x.to(device, non_blocking=True) for x in leaves]
            if k >= 10:
                to_s += time.thread_time() - c0
        del batch, leaves
        if k == batches + 9:
            sync()
            t1, after = time.perf_counter(), threads()
            break
    if path in ("install", "install_device"):
        from fastpin._runtime import process

        pool = process.installed_pools[source][1]
        stats = pool.stats()
    elif path in ("torch_floor", "stock"):
        stats = {}
    else:
        stats = source.stats()
        seconds = {k: round(v * 1e3 / (batches + 10), 3) for k, v in stats.items()
                   if k.endswith("_seconds")}
        stats = {k: v for k, v in stats.items() if "pool" in k or k == "fallbacks"}
        stats["ms_per_batch"] = seconds
    del it, source
    if path in ("install", "install_device"):
        fastpin.uninstall()
    ms = {n: ns / 1e6 for n, ns in cpu_ns_by_name(before, after).items()}
    by_name = {n: round(v / batches, 3) for n, v in sorted(ms.items()) if v / batches >= 0.005}
    return {"path": path, "case": case, "workers": workers, "batches": batches,
            "leaves": nleaves, "budget_ms_per_batch": round((50 + 3 * nleaves) / 1e3, 3),
            "ms_per_batch": round((t1 - t0) * 1e3 / batches, 3),
            "cpu_ms_per_batch": round(sum(ms.values()) / batches, 3),
            "to_cpu_ms_per_batch": round(to_s * 1e3 / batches, 3), "is_pinned": pinned,
            "threads_ms_per_batch": by_name,
            "pool": {k: stats.get(k) for k in stats if k in ("capacity", "high_water", "fallbacks",
                                                              "pool_capacity", "pool_high_water",
                                                              "ms_per_batch")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--case", action="append", choices=sorted(workloads.CASES))
    parser.add_argument("--path", action="append",
                        choices=["install", "zero_copy_host", "zero_copy_cuda", "install_device",
                                 "torch_floor", "stock", "loader_copy"])
    parser.add_argument("--json", help="write the lines here too, as a list")
    args = parser.parse_args()
    rows = []
    for case in args.case or ["images_u8"]:
        for path in args.path or ["install", "zero_copy_host", "zero_copy_cuda", "install_device"]:
            rows.append(run(path, case, args.workers, args.batches))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
