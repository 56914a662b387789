"""Zero-copy's main-process CPU per batch, thread by thread (fastpin's target:
fastpin's own share under 0.1 ms, the whole process under 0.35 ms, whatever the
batch's bytes and shape). Runs with or without a GPU:

    python benchmarks/zero_copy_cpu.py [--workers 2] [--batches 200]
        [--epochs 3] [--case images clips tokens recsys] [--device host cuda] [--pin-memory]
        [--delay S] [--json OUT]

Cases (in-memory datasets, every sample its own pattern, a DataLoader with
default settings but num_workers): uint8 images 3x224x224 with an int label,
batch 256 (2 leaves); float16 clips 3x16x112x112 with a label, batch 32 (38.5
MB, 2 leaves); int32 token windows of 4096 with a bool mask and a length,
batch 16 (0.33 MB, 3 leaves); a recommendation batch of 4096 rows, a dict of
50 tensors (40 int64 ids, 9 float32 x16 features, a label: 3.5 MB), made
whole by the dataset (batch_size=None). Each epoch is one `for b in
fastpin.Loader(dl, device=None|"cuda", zero_copy=True)`; its first --warmup
batches (and with them the self-sizing arena's growth) are not timed, nor are
the last few (the Loader's thread is still alive when the second reading is
taken). The consumer reads nothing.

Per thread of the main process, from /proc/self/task/<tid>: CPU time
(schedstat's run time in ns; stat's utime+stime in clock ticks beside it) and
minor faults and the times it was scheduled, grouped by thread: MainThread, the Loader's producer
(fastpin-loader), fastpin-copy (the C copy threads), fastpin-pool (the arena's
grower), DataLoader's pin thread, others (queue feeder threads, torch's own).
Python threads are matched by native_id, C threads by comm.

fastpin's own share: the CPU of fastpin's own threads (copy, pool), plus the
thread CPU (time.thread_time) that the producer and main threads spend in
fastpin code: the producer's whole CPU less the time inside the DataLoader
iterator's __next__, to which is added back the adoption inside it (_adopt,
called by unpickling the worker's descriptor), and the consumer's time inside
the Loader's __next__. Each of those is timed by wrapping the function with
time.thread_time (a wrapper costs about 1 us a call, counted in fastpin's share
where it wraps fastpin code). Median over the epochs.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import dataloader as dl_mod

import fastpin
from fastpin import _adoption, _loader, _zerocopy
from fastpin.bench import procfs


# ---- the cases ---------------------------------------------------------------

def _pattern(shape, dtype, seed: int) -> torch.Tensor:
    """Every element and every sample its own value (never zeros)."""
    n = 1
    for s in shape:
        n *= s
    x = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed * 40503) % 251 + 1
    if dtype.is_floating_point:
        return (x.to(torch.float32) / 7).to(dtype).reshape(shape)
    if dtype is torch.bool:
        return (x % 3 != 0).reshape(shape)
    return x.to(dtype).reshape(shape)


# Seconds each sample's read sleeps (--delay): a slower source, same bytes.
DELAY = 0.0


def _wait() -> None:
    if DELAY:
        time.sleep(DELAY)


class _Pairs(Dataset):
    """`distinct` patterned samples of one shape and dtype, with int labels."""

    def __init__(self, shape, dtype, distinct: int, length: int):
        self.data = _pattern((distinct, *shape), dtype, 1)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        _wait()
        return self.data[i % len(self.data)], i


class _Windows(Dataset):
    """Token windows of 4096 int32 with a bool mask and their length."""

    def __init__(self, distinct: int, length: int, window: int = 4096):
        self.tokens = _pattern((distinct, window), torch.int32, 2)
        self.mask = _pattern((distinct, window), torch.bool, 3)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        _wait()
        j = i % len(self.tokens)
        return {"tokens": self.tokens[j], "mask": self.mask[j], "length": 4096 - j}


class _Features(Dataset):
    """A recommendation batch read a batch at a time (the sampler yields index
    lists, batch_size=None): 40 int64 categorical ids, 9 dense float32 features
    of 16, a float label: a dict of 50 tensors (fastpin.bench's recsys case)."""

    SPARSE, DENSE = 40, 9

    def __init__(self, distinct: int, length: int, rows: int = 4096):
        self.sparse = _pattern((self.SPARSE, distinct), torch.int64, 4)
        self.dense = _pattern((self.DENSE, distinct, 16), torch.float32, 5)
        self.label = _pattern((distinct,), torch.float32, 6)
        self.rows, self.length = rows, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        _wait()
        idx = (torch.arange(self.rows) * 7 + i) % self.label.numel()
        out = {f"cat_{k}": self.sparse[k, idx] for k in range(self.SPARSE)}
        out.update({f"dense_{k}": self.dense[k, idx] for k in range(self.DENSE)})
        out["label"] = self.label[idx]
        return out


CASES = {
    # name: (batch size, dataset of `length` samples; None: of `length` batches)
    "images": (256, lambda n: _Pairs((3, 224, 224), torch.uint8, 384, n)),
    "clips": (32, lambda n: _Pairs((3, 16, 112, 112), torch.float16, 64, n)),
    "tokens": (16, lambda n: _Windows(256, n)),
    "recsys": (None, lambda n: _Features(1 << 14, n)),
}


# ---- per-thread CPU ------------------------------------------------------------

def _group(tid: int, comm: str, python_names: dict) -> str:
    name = python_names.get(tid)
    if name is None:
        if comm.startswith("fastpin-"):
            return comm
        return "others"
    if name == "MainThread":
        return "MainThread"
    if name.startswith("fastpin-"):
        return name
    if "pin_memory_loop" in name:
        return "DataLoader pin thread"
    return "others"


def _per_group(before: dict, after: dict, python_names: dict) -> tuple:
    """{group: [cpu s, ticks s, minflt, times scheduled]} over the threads alive
    at the end, and how many threads alive at the start were gone by then
    (their time is lost)."""
    groups: dict = {}
    for tid, now in after.items():
        start = before.get(tid, procfs.Thread(now.name, 0, 0.0, 0, 0))
        g = groups.setdefault(_group(tid, now.name, python_names), [0.0, 0.0, 0, 0])
        g[0] += (now.run_ns - start.run_ns) / 1e9
        g[1] += now.cpu_s - start.cpu_s
        g[2] += now.minflt - start.minflt
        g[3] += now.slices - start.slices
    return groups, sum(1 for tid in before if tid not in after)


# ---- fastpin's time inside the main and producer threads ---------------------

class _InFastpin:
    """Thread CPU spent in the wrapped functions, per thread name (nesting aware:
    time in an inner wrapped function is also given to its own key)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds: dict = {}

    def wrap(self, key: str, fn):
        # functools.wraps: the same qualified name, so pickle (the workers'
        # descriptor names _adopt) finds the wrapper where the function was.
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - c0
                name = (key, threading.current_thread().name)
                with self.lock:
                    self.seconds[name] = self.seconds.get(name, 0.0) + spent
        return timed

    def take(self) -> dict:
        with self.lock:
            out, self.seconds = self.seconds, {}
        return out


TIMED = _InFastpin()


def _install() -> None:
    """Wrap, before any worker is forked: the DataLoader iterator's __next__,
    adoption (what unpickling a worker's descriptor calls) and the Loader's."""
    it = dl_mod._MultiProcessingDataLoaderIter
    it.__next__ = TIMED.wrap("dataloader", it.__next__)
    _adoption._adopt = TIMED.wrap("adopt", _adoption._adopt)
    _loader._Epoch.__next__ = TIMED.wrap("loader", _loader._Epoch.__next__)


def _fastpin_share(groups: dict, timed: dict) -> float:
    """fastpin's own CPU seconds over the timed batches (see the module's text)."""
    own = sum(g[0] for name, g in groups.items()
              if name.startswith("fastpin-") and name != "fastpin-loader")
    producer = groups.get("fastpin-loader", [0.0])[0]
    producer -= timed.get(("dataloader", "fastpin-loader"), 0.0)
    producer += timed.get(("adopt", "fastpin-loader"), 0.0)
    return own + producer + timed.get(("loader", "MainThread"), 0.0)


# ---- one epoch -----------------------------------------------------------------

def epoch(case: str, device, workers: int, batches: int, warmup: int,
          pin_memory: bool = False) -> dict:
    batch_size, make = CASES[case]
    tail = 2 + 2 * workers   # batches left after the second reading
    n = warmup + batches + tail
    dl = DataLoader(make(n if batch_size is None else batch_size * n), batch_size=batch_size,
                    num_workers=workers, pin_memory=pin_memory)
    start = procfs.threads()
    loader = fastpin.Loader(dl, device=device, zero_copy=True)
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    TIMED.take()
    proc0, before = time.process_time(), procfs.threads()
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    wall = time.perf_counter() - t0
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    after, proc = procfs.threads(), time.process_time() - proc0
    timed = TIMED.take()
    for _ in it:
        pass
    groups, lost = _per_group(before, after, python_names)
    setup, _ = _per_group(start, before, python_names)
    stats = loader.stats()
    ms = 1e3 / batches
    return {
        "groups_ms": {name: g[0] * ms for name, g in groups.items()},
        "groups_ticks_ms": {name: g[1] * ms for name, g in groups.items()},
        "groups_minflt": {name: g[2] / batches for name, g in groups.items()},
        "groups_scheduled": {name: g[3] / batches for name, g in groups.items()},
        "total_ms": sum(g[0] for g in groups.values()) * ms,
        "process_time_ms": proc * ms,
        "fastpin_ms": _fastpin_share(groups, timed) * ms,
        "timed_ms": {f"{k}@{t}": v * ms for (k, t), v in timed.items()},
        "wall_ms": wall * ms,
        "threads_lost": lost,
        "fallbacks": stats["fallbacks"] + stats["worker_fallbacks"],
        # Once an epoch, not per batch: the Loader's start, the workers' start
        # and the arena's growth, through the warm-up batches.
        "setup_ms": {name: g[0] * 1e3 for name, g in setup.items()},
        "arena_mb": stats["pool_capacity"] / 1e6,
    }


def _median(runs: list) -> dict:
    """Each figure's median over the epochs (dicts of figures key by key)."""
    out: dict = {}
    for key, first in runs[0].items():
        if isinstance(first, dict):
            keys = sorted({k for r in runs for k in r[key]})
            out[key] = {k: statistics.median(r[key].get(k, 0) for r in runs) for k in keys}
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _print(case: str, mode: str, m: dict) -> None:
    print(f"{case:7s} {mode:5s} total {m['total_ms']:.3f} ms/batch "
          f"(process_time {m['process_time_ms']:.3f}), fastpin {m['fastpin_ms']:.3f}, "
          f"wall {m['wall_ms']:.3f}, fallbacks {m['fallbacks']:.0f}")
    setup = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["setup_ms"].items()) if v >= 0.05)
    print(f"    once an epoch (start, arena of {m['arena_mb']:.0f} MB, warm-up): {setup} ms")
    for name, v in sorted(m["groups_ms"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:22s} {v:8.3f} ms  ({m['groups_ticks_ms'][name]:.2f} by ticks, "
              f"{m['groups_minflt'][name]:.1f} minor faults, "
              f"scheduled {m['groups_scheduled'][name]:.1f} times)")
    for name, v in sorted(m["timed_ms"].items()):
        print(f"    in {name:19s} {v:8.3f} ms")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=200, help="timed batches an epoch")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--case", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--device", nargs="+", choices=("host", "cuda"), default=None,
                   help="default: host, and cuda where a GPU is present")
    p.add_argument("--pin-memory", action="store_true",
                   help="DataLoader(pin_memory=True): its pin thread runs too")
    p.add_argument("--delay", type=float, default=0.0,
                   help="seconds each sample's read sleeps in the worker: more time between "
                        "batches, the same bytes")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    global DELAY
    DELAY = args.delay
    modes = args.device or (["host", "cuda"] if torch.cuda.is_available() else ["host"])
    _install()
    print(f"fastpin from {os.path.dirname(fastpin.__file__)}; {args.workers} workers, "
          f"{args.batches} batches x {args.epochs} epochs; main-process CPU per batch")
    results = []
    for case in args.case:
        for mode in modes:
            runs = [epoch(case, None if mode == "host" else "cuda", args.workers,
                          args.batches, args.warmup, args.pin_memory)
                    for _ in range(args.epochs)]
            m = _median(runs)
            _print(case, mode, m)
            results.append({"case": case, "device": mode, "workers": args.workers,
                            "pin_memory": args.pin_memory, "delay": args.delay,
                            "batches": args.batches, "median": m, "epochs": runs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
