"""Where zero-copy's time goes: the main process's CPU by thread and by step,
and each worker's time by step, for the suite's uint8 (or float32) image case.

    python benchmarks/profile_zero_copy.py --workers 8 15 [--batches 400]
        [--dtype uint8|float32] [--device cuda|host] [--no-prefault] [--sample] [--micro]

Per run it prints delivered GB/s, main-process CPU per batch split by thread
(/proc/self/task), the time per batch of each step the main process runs
(DataLoader's own next, adoption, the Loader's prepare, block_to_device and issue, the
consumer's next), and the workers' time per batch (fetch, collate, pack, the
rest) with their minor page faults. --sample adds a statistical profile of
the producer thread (its innermost frames, sampled every millisecond); it
costs CPU itself, so its run's figures are not comparable.
"""
from __future__ import annotations

import argparse
import collections
import functools
import multiprocessing as mp
import os
import resource
import sys
import threading
import time

import torch
from torch.utils.data import _utils
from torch.utils.data import dataloader as dl_mod

import fastpin
from fastpin import _adoption, _delivery, _loader, _zerocopy, bench
from fastpin.bench import procfs

_MAX_WORKERS = 64
_FIELDS = ("batches", "fetch_s", "collate_s", "pack_s", "minflt", "between_s")


class _Timers:
    """Main-process step timers: name -> [calls, wall seconds, thread CPU seconds]."""

    def __init__(self):
        self.lock = threading.Lock()
        self.data = collections.defaultdict(lambda: [0, 0.0, 0.0])

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                with self.lock:
                    entry = self.data[name]
                    entry[0] += 1
                    entry[1] += dt
                    entry[2] += dc
        return timed

    def reset(self):
        with self.lock:
            self.data.clear()


TIMERS = _Timers()
# Workers' accumulators, shared with the forked workers: one row per worker id.
WORKER = mp.Array("d", _MAX_WORKERS * len(_FIELDS), lock=False)


def _worker_slot():
    info = torch.utils.data.get_worker_info()
    return None if info is None else info.id * len(_FIELDS)


def _install_timers():
    """Wrap the steps; workers are forked after this, so they inherit it."""
    timers = TIMERS
    it_cls = dl_mod._MultiProcessingDataLoaderIter
    it_cls._next_data = timers.wrap("DataLoader next", it_cls._next_data)
    _adoption._adopt = timers.wrap("adopt (unpickle)", _adoption._adopt)
    _adoption.receive = timers.wrap("receive (from_dlpack)", _adoption.receive)
    _delivery.Adopt.prepare = timers.wrap("prepare (all)", _delivery.Adopt.prepare)
    _delivery.CopyToDevice.prepare = timers.wrap("to_device", _delivery.CopyToDevice.prepare)
    _delivery.CopyToDevice.issue = timers.wrap("issue (h2d, event)", _delivery.CopyToDevice.issue)
    _delivery.CopyToDevice.from_block = timers.wrap("block_to_device",
                                                 _delivery.CopyToDevice.from_block)
    _adoption.adopted = timers.wrap("adopted", _adoption.adopted)
    _loader._Epoch.__next__ = timers.wrap("consumer next", _loader._Epoch.__next__)

    fetch_cls = _utils.fetch._MapDatasetFetcher
    plain_fetch = fetch_cls.fetch
    plain_call = _zerocopy._WorkerCollate.__call__
    plain_pack = _zerocopy._pack
    last = {}

    def fetch(self, index):
        slot = _worker_slot()
        t0 = time.perf_counter()
        if slot is not None and "end" in last:
            WORKER[slot + 5] += t0 - last["end"]
        try:
            return plain_fetch(self, index)
        finally:
            if slot is not None:
                last["end"] = time.perf_counter()
                WORKER[slot + 0] += 1
                WORKER[slot + 1] += last["end"] - t0

    def call(self, samples):
        slot = _worker_slot()
        t0 = time.perf_counter()
        try:
            return plain_call(self, samples)
        finally:
            if slot is not None:
                WORKER[slot + 2] += time.perf_counter() - t0

    def pack(tree, arena, *args):
        slot = _worker_slot()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        try:
            return plain_pack(tree, arena, *args)
        finally:
            if slot is not None:
                WORKER[slot + 3] += time.perf_counter() - t0
                WORKER[slot + 4] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    fetch_cls.fetch = fetch
    _zerocopy._WorkerCollate.__call__ = call
    _zerocopy._pack = pack


def _thread_cpu() -> dict:
    """{tid: (name, cpu seconds)} for every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {tid: (names.get(tid, t.name), t.cpu_s) for tid, t in procfs.threads().items()}


class _Sampler(threading.Thread):
    """Samples the producer thread's innermost frames every `period` seconds."""

    def __init__(self, period=1e-3):
        super().__init__(name="sampler", daemon=True)
        self.period = period
        self.counts: collections.Counter = collections.Counter()
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(self.period):
            producer = next((t for t in threading.enumerate() if t.name == "fastpin-loader"), None)
            if producer is None:
                continue
            frame = sys._current_frames().get(producer.ident)
            chain = []
            while frame is not None and len(chain) < 4:
                code = frame.f_code
                chain.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
                frame = frame.f_back
            self.counts[" < ".join(chain)] += 1


def run(workers: int, batches: int, dtype: torch.dtype, device, prefault: bool,
        sample: bool, warmup: int = 20) -> None:
    _zerocopy.PREFAULT = prefault
    w = bench.CASES["images_u8" if dtype == torch.uint8 else "images_f32"]
    dataset = w.make()
    make = w.factory(dataset, workers, batches + warmup + 4)
    loader = make(False)
    capacity = -(-_zerocopy.capacity_for(loader, w.batch_bytes, depth=2) // bench.MB) * bench.MB
    floader = fastpin.Loader(loader, device=device, zero_copy=True, capacity=capacity)
    it = iter(floader)
    t_start = time.perf_counter()
    next(it)
    first = time.perf_counter() - t_start
    for _ in range(warmup):
        next(it)
    if device is not None:
        torch.cuda.synchronize()
    TIMERS.reset()
    for i in range(len(WORKER)):
        WORKER[i] = 0.0
    sampler = _Sampler() if sample else None
    cpu0, thr0 = time.process_time(), _thread_cpu()
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.start()
    nbytes = 0
    for _ in range(batches):
        batch = next(it)
        nbytes += sum(x.numel() * x.element_size() for x in batch)
    del batch
    if device is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    cpu, thr1 = time.process_time() - cpu0, _thread_cpu()
    if sampler is not None:
        sampler.done.set()
        sampler.join()
    stats = floader.stats()
    it.close()
    del it, floader, loader

    print(f"\n== {workers} workers, {dtype}, device {device}, prefault {prefault}: "
          f"{nbytes / wall / 1e9:.1f} GB/s, {batches / wall:.0f} batches/s, first batch "
          f"{first:.2f} s, main-process CPU {cpu / batches * 1e3:.3f} ms/batch, worker "
          f"fallbacks {stats['worker_fallbacks']}")
    by_name: collections.Counter = collections.Counter()
    for tid, (name, secs) in thr1.items():
        by_name[name] += secs - thr0.get(tid, (name, 0.0))[1]
    print("  main-process CPU by thread, ms/batch:")
    for name, secs in by_name.most_common():
        if secs > 0:
            print(f"    {name:32s} {secs / batches * 1e3:7.3f}")
    print("  main-process steps, ms/batch: wall, thread CPU (calls/batch):")
    for name, (calls, secs, cpu_s) in sorted(TIMERS.data.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:32s} {secs / batches * 1e3:7.3f} {cpu_s / batches * 1e3:7.3f}  "
              f"({calls / batches:.2f})")
    rows = [WORKER[i * len(_FIELDS):(i + 1) * len(_FIELDS)] for i in range(workers)]
    done = sum(r[0] for r in rows)
    if done:
        fetch, coll, pack, flt, between = (sum(r[k] for r in rows) for k in range(1, 6))
        print(f"  workers, per batch ({done:.0f} batches): fetch+collate {fetch / done * 1e3:.2f} ms "
              f"(getitem {(fetch - coll) / done * 1e3:.2f}, collate {coll / done * 1e3:.2f} of "
              f"which pack {pack / done * 1e3:.2f}), between batches {between / done * 1e3:.2f} ms, "
              f"minor faults in pack {flt / done:.0f}")
    if sampler is not None:
        total = sum(sampler.counts.values()) or 1
        print("  producer thread, sampled frames (share):")
        for chain, n in sampler.counts.most_common(15):
            print(f"    {n / total:6.1%}  {chain}")


def micro(nbytes: int = 38_537_216, reps: int = 300) -> None:
    """Thread CPU of each call the Loader's thread makes per zero-copy batch in
    device mode, in isolation: what the 'prepare' figure is made of."""
    from fastpin import _C

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    arena = _C.Arena(4 * _C.block_size(nbytes), shared=True)
    blocks = [arena.alloc(nbytes) for _ in range(2)]
    keep = []

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        c0 = time.thread_time()
        for _ in range(reps):
            fn()
        dc = time.thread_time() - c0
        torch.cuda.synchronize()
        keep.clear()
        print(f"    {name:44s} {dc / reps * 1e3:7.4f} ms")

    def empty():
        keep.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
        if len(keep) > 4:
            keep.pop(0)

    def context():
        with torch.cuda.stream(stream):
            pass

    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d():
        _C.h2d(arena, stream.cuda_stream, [(buffer.data_ptr(), blocks[0].ptr, nbytes, True)])

    def event():
        e = torch.cuda.Event(blocking=True)
        e.record(stream)
        keep.append(e)

    def views():  # the uint8 case: images, then 256 int64 labels
        buffer[:nbytes - 2048].view(256, 3, 224, 224)
        buffer[nbytes - 2048:].view(torch.int64)

    print(f"  per-call thread CPU, {nbytes / 1e6:.1f} MB batch:")
    timed("torch.cuda.stream(copy_stream) enter/exit", context)
    timed("torch.empty(batch bytes) on the GPU", empty)
    with torch.cuda.stream(stream):
        timed("torch.empty under the copy stream", empty)
    timed("_C.h2d, one pinned copy", h2d)
    timed("torch.cuda.Event(blocking) + record", event)
    timed("two leaf views of the buffer", views)
    timed("arena.collect()", arena.collect)
    timed("record_stream of the buffer", lambda: buffer.record_stream(torch.cuda.current_stream()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[8])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--dtype", choices=("uint8", "float32"), default="uint8")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "host")
    p.add_argument("--no-prefault", action="store_true")
    p.add_argument("--sample", action="store_true")
    p.add_argument("--micro", action="store_true",
                   help="also time each per-batch call of the Loader's thread alone (GPU)")
    args = p.parse_args()
    device = None if args.device == "host" else args.device
    _install_timers()
    for key in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{key}") as f:
                print(f"transparent_hugepage/{key}: {f.read().strip()}")
        except OSError:
            pass
    print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs")
    if args.micro and device is not None:
        micro()
    for nw in args.workers:
        run(nw, args.batches, getattr(torch, args.dtype), device, not args.no_prefault, args.sample)


if __name__ == "__main__":
    main()
