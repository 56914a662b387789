"""Where a device-delivered batch's main-thread time goes, in microseconds:
first the CUDA and torch primitives the delivery step calls, each timed alone
(a device allocation under the copy stream, fixed and varying sizes, with its
record_stream; the stream switch; an event's creation, record, wait and
query; two probes: pure Python work and a small allocation); then
install(device="cuda") over the bench's workload cases (--case, repeatable;
default tokens and images_f32), its steps wrapped in timers: each part's wall
time per batch, inclusive of the parts inside it and of the timers' own cost,
and the probes once a batch (outside next() and outside the timers: the same
work's time there against its time alone), beside every thread's CPU per
batch.

    python benchmarks/delivery_parts.py [--workers 15] [--batches 300] [--case tokens]
        [--json parts.json]

Needs a GPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import time

import torch

import fastpin
from fastpin import _C, _adoption, _ahead, _delivery, _segments
from fastpin.bench import workloads
from fastpin.bench.procfs import cpu_ns_by_name, threads

_clock = time.perf_counter


def per_call(fn, n: int) -> float:
    """Microseconds a call of fn(i), over n calls (after n // 10 unmeasured)."""
    for i in range(n // 10):
        fn(i)
    torch.cuda.synchronize()
    t0 = _clock()
    for i in range(n):
        fn(i)
    us = (_clock() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return round(us, 2)


def probes(device) -> tuple:
    """(pure Python work, one small device allocation): timed alone in
    primitives() and once a batch inside the loop, they say how much slower
    the same work runs there (other threads, the workers beside it)."""
    def python(i):
        return sum(range(200))

    def alloc(i):
        return torch.empty(4096, dtype=torch.uint8, device=device)

    return python, alloc


def primitives(n: int = 3000) -> dict:
    """The primitives of one delivery step, timed alone on the current GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    copy = torch.cuda.Stream(device)
    consumer = torch.cuda.current_stream(device)
    rng = random.Random(0)
    varying = [rng.randrange(400_000, 1_600_000) for _ in range(n + n // 10)]
    held: collections.deque = collections.deque()

    def alloc(size_of, rounded=False):
        def one(i):
            size = size_of(i)
            if rounded:
                size = -(-size // (2 << 20)) * (2 << 20)
            with torch.cuda.stream(copy):
                b = torch.empty(size, dtype=torch.uint8, device=device)
            b.record_stream(consumer)
            held.append(b)  # a few batches alive at once, as in a loop
            if len(held) > 4:
                held.popleft()
        return one

    def swap(i):
        prev = torch.cuda.current_stream(device)
        torch.cuda.set_stream(copy)
        torch.cuda.set_stream(prev)

    def context(i):
        with torch.cuda.device(device), torch.cuda.stream(copy):
            pass

    events = [torch.cuda.Event(blocking=True) for _ in range(64)]
    for e in events:
        e.record(copy)
    x = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    python, small = probes(device)
    out = {
        "probe_python": per_call(python, n),
        "probe_empty_4KiB": per_call(small, n),
        "empty_1MiB": per_call(alloc(lambda i: 1 << 20), n),
        "empty_0.4-1.6MB": per_call(alloc(lambda i: varying[i]), n),
        "empty_0.4-1.6MB_rounded_2MiB": per_call(alloc(lambda i: varying[i], True), n),
        "empty_147MiB": per_call(alloc(lambda i: 147 << 20), n // 10),
        "stream_context": per_call(context, n),
        "stream_swap": per_call(swap, n),
        "current_stream": per_call(lambda i: torch.cuda.current_stream(device), n),
        "event_new": per_call(lambda i: torch.cuda.Event(blocking=True), n),
        "event_record": per_call(lambda i: events[i % 64].record(copy), n),
        "wait_event": per_call(lambda i: consumer.wait_event(events[i % 64]), n),
        "event_query": per_call(lambda i: events[i % 64].query(), n),
        "record_stream": per_call(lambda i: x.record_stream(consumer), n),
    }
    held.clear()
    return out


class Timers:
    """Wall time and calls per name, from wrapped functions."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.on = False
        self.undo: list = []

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        seconds, calls = self.seconds, self.calls

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            t0 = _clock()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += _clock() - t0
                calls[name] += 1

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, original))

    def restore(self) -> None:
        for owner, attr, original in reversed(self.undo):
            setattr(owner, attr, original)
        self.undo.clear()


def parts(case: str, workers: int, batches: int) -> dict:
    from torch.utils.data import dataloader

    w = workloads.CASES[case]
    dataset = w.make()
    make = w.factory(dataset, workers, batches + 30)
    timers = Timers()
    for owner, attr, name in [
            (_ahead.Delivering, "_next_data", "next (all of it)"),
            (dataloader._MultiProcessingDataLoaderIter, "_next_data", "  receive (torch)"),
            (_ahead.Ready, "__call__", "  ready (poll)"),
            (_delivery.Adopt, "prepare_here", "  prepare_here"),
            (_delivery.Adopt, "prepare", "    prepare"),
            (_segments.Pool, "collect", "      pool.collect"),
            (_adoption, "adopted", "      adopted"),
            (_delivery.CopyToDevice, "from_block", "      from_block"),
            (torch, "empty", "        torch.empty"),
            (_adoption, "device_views", "        device_views"),
            (_delivery.CopyToDevice, "issue", "        issue"),
            (_C, "h2d", "          _C.h2d"),
            (_delivery.CopyToDevice, "deliver", "  deliver")]:
        timers.wrap(owner, attr, name)
    python, small = probes(torch.device("cuda", torch.cuda.current_device()))
    fastpin.install(device="cuda")
    try:
        it = iter(make(True))
        for k, batch in enumerate(it):
            if k == 20:
                torch.cuda.synchronize()
                timers.on = True
                t0, before = _clock(), threads()
            del batch
            if timers.on:
                timers.on = False  # the probe's allocation is not the step's
                for name, probe in (("probe_python", python), ("probe_empty_4KiB", small)):
                    p0 = _clock()
                    probe(k)
                    timers.seconds[name] += _clock() - p0
                timers.on = True
            if k == batches + 19:
                torch.cuda.synchronize()
                t1, after = _clock(), threads()
                timers.on = False
                break
        del it
    finally:
        fastpin.uninstall()
        timers.restore()
    cpu = {n: round(ns / 1e3 / batches, 1) for n, ns in cpu_ns_by_name(before, after).items()
           if ns / 1e3 / batches >= 1}
    return {"case": case, "workers": workers, "batches": batches,
            "us_per_batch": round((t1 - t0) * 1e6 / batches, 1),
            "cpu_us_per_batch": round(sum(cpu.values()), 1), "threads_us_per_batch": cpu,
            "parts_us_per_batch": {n: round(s * 1e6 / batches, 1)
                                   for n, s in timers.seconds.items()},
            "calls_per_batch": {n: round(c / batches, 2) for n, c in timers.calls.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--case", action="append", choices=sorted(workloads.CASES))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("delivery_parts.py needs a CUDA GPU")
    out = {"primitives_us": primitives()}
    print(json.dumps(out["primitives_us"], indent=1), flush=True)
    out["cases"] = []
    for case in args.case or ["tokens", "images_f32"]:
        row = parts(case, args.workers, args.batches)
        out["cases"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
