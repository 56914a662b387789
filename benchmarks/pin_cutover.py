"""Where pin_memory's copy should change strategy: for each batch size, from a
cache-hot source (the same buffer every call) and a cache-cold one (rotating
over sources whose total is at least 4x the last-level cache, as a batch fresh
from a worker is), the median GB/s and the CPU-seconds per GB (every thread of
this process: /proc/self/task) of

    torch_pin_1      x.pin_memory(), torch.set_num_threads(1)
    torch_pin_n      x.pin_memory(), all of torch's threads
    torch_reuse_n    one torch.empty(n, pin_memory=True), then .copy_(x), all threads
                     (no allocation: not a pin, never taken as torch's best)
    memcpy_n         dst.copy_(x) into ordinary memory, all threads (the pin table's)
    memcpy_pool      _C.copy into ordinary memory on fastpin's pool (the pin table's)
    fp:<setting>     fastpin.pin_memory(x) under each candidate setting of
                     fastpin._pin.tune_copy: spin, cut-overs, streaming stores,
                     torch's copy_ (see SETTINGS)

Without a GPU the torch_pin columns time torch's own copy into a fresh tensor
(x.clone()) instead, and torch_reuse_n is left out. Every cell of a row takes
turns with the others in --rounds rounds, so a drifting machine moves them
alike; each cell's CPU window ends --settle-ms (or twice its spin) after its
last call, so threads that spin after the last call (fastpin's pool, torch's
OpenMP team) are counted. The run fits --max-seconds by giving each cell its
share of what is left. --recommend prints, for each size and source, the
fastest fastpin setting and the fastest that spends no more CPU per GB than
torch_pin_n, with their ratios to torch's best and to the best memcpy.

    PYTHONPATH=$PWD python benchmarks/pin_cutover.py [--quick] [--max-seconds 300]
        [--sizes 64K 1M ...] [--kinds hot cold] [--settings default spin100us ...]
        [--recommend] [--json FILE]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

import fastpin
from fastpin import _C, _pin
from fastpin.bench import procfs
from pin_parts import blocks_cycled  # beside this file: python puts its folder first on sys.path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = ["64K", "256K", "1M", "2M", "4M", "8M", "16M", "64M", "256M", "1G"]
QUICK_SIZES = ["64K", "256K", "1M", "4M", "16M", "64M"]
EVERY = (0, 1 << 40)  # a torch_copy range that takes every batch

# The candidate settings: knobs of fastpin._pin.tune_copy over the defaults this
# process started with (FASTPIN_COPY included).
SETTINGS = {
    "default": {},
    "spin20us": {"spin_ns": 20_000},
    "spin100us": {"spin_ns": 100_000},
    "spin500us": {"spin_ns": 500_000},
    # spinners share every batch, however small (the caller alone never)
    "spin100us_share": {"spin_ns": 100_000, "inline_spin": 0},
    # every batch goes to the pool, woken threads and all
    "pool": {"inline_max": 0, "inline_spin": 0},
    "spin100us_pool": {"spin_ns": 100_000, "inline_max": 0, "inline_spin": 0},
    "stream_off": {"streaming": False},
    # streaming from 4 MiB: the main process's default before it moved to half the LLC
    "stream_4m": {"stream_min": 4 * MiB},
    "spin100us_stream_off": {"spin_ns": 100_000, "streaming": False},
    "spin100us_stream_all": {"spin_ns": 100_000, "stream_min": 0},
    "torch_copy": {"torch_copy": EVERY},
    # the torch span filled through torch's copy_ (a Python call of it per
    # leaf), not by its OpenMP team directly; and the team in larger slices
    "copy_": {"team_grain": 0},
    "team_64k": {"team_grain": 64 * KiB},
    "team_128k": {"team_grain": 128 * KiB},
    # the span (torch's team) from 128 KiB, where torch's all-thread pin beat
    # one thread on a cold source
    "span_128k": {"torch_copy": (128 * KiB, 16 * MiB)},
    # the pool alone (no torch copy_), its threads spinning 100 us, every batch
    # shared: in chunks from 512 KiB, and from 64 KiB (with streaming stores off)
    "pool_spin": {"spin_ns": 100_000, "inline_max": 0, "inline_spin": 0, "torch_copy": None},
    "pool_spin_fine": {"spin_ns": 100_000, "inline_max": 0, "inline_spin": 0,
                       "chunk_min": 64 * KiB, "chunk_min_spin": 64 * KiB, "torch_copy": None},
    "pool_spin_fine_nostream": {"spin_ns": 100_000, "inline_max": 0, "inline_spin": 0,
                                "chunk_min": 64 * KiB, "chunk_min_spin": 64 * KiB,
                                "streaming": False, "torch_copy": None},
    # the same in chunks from 16 KiB
    "pool_spin_16k": {"spin_ns": 100_000, "inline_max": 0, "inline_spin": 0,
                      "chunk_min": 16 * KiB, "chunk_min_spin": 16 * KiB, "torch_copy": None},
}
QUICK_SETTINGS = ["default", "spin100us", "pool", "stream_off", "torch_copy"]


def parse_size(s: str) -> int:
    units = {"K": KiB, "M": MiB, "G": GiB}
    unit = units.get(s[-1:].upper())
    return int(float(s[:-1]) * unit) if unit else int(s)


def fmt_size(n: int) -> str:
    for unit, name in ((GiB, "G"), (MiB, "M"), (KiB, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


# ---- the machine ---------------------------------------------------------------

def llc_bytes() -> int:
    """The last-level caches this process's CPUs share (fastpin's own reading of
    sysfs, which places its streaming stores by it); 32 MiB where unreadable."""
    return _pin.llc_bytes() or 32 * MiB


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return 8 * GiB


# ---- timing -------------------------------------------------------------------------

def cpu_ns() -> dict:
    """{tid: CPU ns so far} of every thread of this process."""
    return {tid: t.run_ns for tid, t in procfs.threads().items()}


def cpu_since(before: dict) -> float:
    """CPU seconds of every thread since `before` (a thread born since counted from 0)."""
    return sum(ns - before.get(tid, 0) for tid, ns in cpu_ns().items()) / 1e9


class Cell:
    """One column of a row: fn() pins or copies the next source; knobs (of
    tune_copy) and torch threads are set around each of its turns."""

    def __init__(self, name: str, fn, threads: int, knobs: dict):
        self.name, self.fn, self.threads, self.knobs = name, fn, threads, knobs
        self.times: list = []
        self.cpu = 0.0   # seconds, every thread, from the first timed call to the end of the settle
        self.tail = 0.0  # of which after the last call (threads still spinning, then asleep)
        self.turns = 0

    def turn(self, defaults: dict, calls: int, seconds: float, warmup: int,
             settle_s: float) -> None:
        saved = torch.get_num_threads()
        _pin.tune_copy(**{**defaults, **self.knobs})
        torch.set_num_threads(self.threads)
        try:
            fn = self.fn
            for _ in range(warmup):
                fn()
            out = self.times
            before = cpu_ns()
            start = time.perf_counter()
            done = 0
            while done < calls or time.perf_counter() - start < seconds:
                t0 = time.perf_counter_ns()
                fn()
                out.append(time.perf_counter_ns() - t0)
                done += 1
            last = cpu_ns()
            time.sleep(max(settle_s, 2 * _C.get_spin() / 1e9))
            self.cpu += cpu_since(before)
            self.tail += cpu_since(last)
            self.turns += 1
        finally:
            torch.set_num_threads(saved)
            _pin.tune_copy(**defaults)

    def result(self, nbytes: int) -> dict:
        med = statistics.median(self.times) / 1e9
        gb = len(self.times) * nbytes / 1e9
        return {"gbps": round(nbytes / med / 1e9, 3), "cpu_s_per_gb": round(self.cpu / gb, 4),
                "calls": len(self.times), "median_us": round(med * 1e6, 2),
                # CPU after a turn's last call, a turn: what one batch costs beyond its
                # copy when batches come far apart (spinning threads), and the same
                # without it, per GB (back-to-back batches)
                "tail_cpu_ms": round(self.tail / self.turns * 1e3, 3),
                "cpu_s_per_gb_calls": round((self.cpu - self.tail) / gb, 4)}


def rotation(sources: list):
    """A function giving the sources in turn, forever."""
    return itertools.cycle(sources).__next__


def make_cells(nbytes: int, sources: list, settings: dict, gpu: bool, all_threads: int) -> list:
    nxt = rotation(sources)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # fault its pages in before timing
    cells = []
    if gpu:
        cells.append(Cell("torch_pin_1", lambda: nxt().pin_memory(), 1, {}))
        cells.append(Cell("torch_pin_n", lambda: nxt().pin_memory(), all_threads, {}))
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        cells.append(Cell("torch_reuse_n", lambda: pinned.copy_(nxt()), all_threads, {}))
    else:  # torch's own copy into a fresh tensor stands in for its pin
        cells.append(Cell("torch_pin_1", lambda: nxt().clone(), 1, {}))
        cells.append(Cell("torch_pin_n", lambda: nxt().clone(), all_threads, {}))
    cells.append(Cell("memcpy_n", lambda: dst.copy_(nxt()), all_threads, {}))
    dst_p = dst.data_ptr()
    addresses = rotation([s.data_ptr() for s in sources])
    cells.append(Cell("memcpy_pool", lambda: _C.copy(dst_p, addresses(), nbytes), all_threads,
                      {}))
    for name, knobs in settings.items():
        cells.append(Cell(f"fp:{name}", lambda: fastpin.pin_memory(nxt()), all_threads, knobs))
    return cells


def check(sources: list, settings: dict, defaults: dict, nbytes: int) -> None:
    """fastpin.pin_memory gives the source's bytes under every setting (below
    64 MiB; above, the default only: comparing a GB takes a while)."""
    names = settings if nbytes <= 64 * MiB else {"default": {}}
    for name, knobs in names.items():
        _pin.tune_copy(**{**defaults, **knobs})
        try:
            src = sources[-1]
            if not torch.equal(fastpin.pin_memory(src), src):
                raise AssertionError(f"fastpin.pin_memory under {name} gave other bytes "
                                     f"({nbytes} bytes)")
        finally:
            _pin.tune_copy(**defaults)


def distinct_blocks(sources: list, defaults: dict, calls: int = 200) -> int:
    """pin_parts.blocks_cycled at the defaults: 1 where the freed block is
    taken again at once, its lines still in cache."""
    _pin.tune_copy(**defaults)
    return blocks_cycled(sources[0], calls)


def measure_row(cells: list, nbytes: int, defaults: dict, seconds_per_cell: float,
                rounds: int, calls: int, settle_s: float) -> None:
    per_turn = seconds_per_cell / rounds
    # Warm-up calls: the first turn's fault pages in and grow the arena; a later
    # turn's one wakes the threads a cell's neighbours left asleep (not worth a
    # call past 64 MiB, whose copy dwarfs a wake).
    small = nbytes < 64 * MiB
    for r in range(rounds):
        for cell in cells:
            warmup = (3 if small else 1) if r == 0 else (1 if small else 0)
            cell.turn(defaults, calls, per_turn, warmup, settle_s)


# ---- the report ---------------------------------------------------------------------

def torch_best(cells: dict) -> tuple:
    """The faster of torch's two pins (torch_reuse_n copies into one held
    tensor: not a pin, shown beside them only)."""
    names = [n for n in ("torch_pin_1", "torch_pin_n") if n in cells]
    best = max(names, key=lambda n: cells[n]["gbps"])
    return best, cells[best]["gbps"]


def memcpy_best(cells: dict) -> float:
    return max(cells["memcpy_n"]["gbps"], cells["memcpy_pool"]["gbps"])


def recommend(row: dict) -> dict:
    cells = row["cells"]
    fp = {n[3:]: c for n, c in cells.items() if n.startswith("fp:")}
    tname, tbest = torch_best(cells)
    mbest = memcpy_best(cells)
    cpu_cap = cells["torch_pin_n"]["cpu_s_per_gb"]
    fastest = max(fp, key=lambda n: fp[n]["gbps"])
    frugal = [n for n in fp if fp[n]["cpu_s_per_gb"] <= cpu_cap]
    within = max(frugal, key=lambda n: fp[n]["gbps"]) if frugal else None

    def entry(name):
        if name is None:
            return None
        c = fp[name]
        return {"setting": name, "gbps": c["gbps"], "cpu_s_per_gb": c["cpu_s_per_gb"],
                "vs_torch_best": round(c["gbps"] / tbest, 3),
                "vs_memcpy_best": round(c["gbps"] / mbest, 3)}

    return {"bytes": row["bytes"], "kind": row["kind"], "torch_best": tname,
            "torch_best_gbps": tbest, "memcpy_best_gbps": mbest,
            "torch_pin_n_cpu_s_per_gb": cpu_cap, "fastest": entry(fastest),
            "fastest_within_torch_cpu": entry(within),
            "default": entry("default") if "default" in fp else None}


def print_table(rows: list, key: str, title: str) -> None:
    names = list(rows[0]["cells"])
    short = [n[3:] if n.startswith("fp:") else n for n in names]
    width = max(8, *(len(s) for s in short))
    print(f"\n{title}")
    print(f"{'size':>5} {'src':>4} " + " ".join(f"{s:>{width}}" for s in short))
    for row in rows:
        vals = [row["cells"][n][key] for n in names]
        print(f"{fmt_size(row['bytes']):>5} {row['kind']:>4} "
              + " ".join(f"{v:>{width}.{2 if key == 'gbps' else 3}f}" for v in vals))


def print_recommend(recs: list) -> None:
    print("\nRecommendation: fastest fastpin setting; fastest spending no more CPU/GB than "
          "torch_pin_n (ratios: to torch's best pin, to the best memcpy)")
    print(f"{'size':>5} {'src':>4} {'torch best':>20} {'fastest':>32} {'within torch CPU':>32}")
    for r in recs:
        def show(e):
            if e is None:
                return "-"
            return f"{e['setting']} {e['vs_torch_best']:.2f}x {e['vs_memcpy_best']:.2f}x"
        tb = f"{r['torch_best']} {r['torch_best_gbps']:.1f}"
        print(f"{fmt_size(r['bytes']):>5} {r['kind']:>4} {tb:>20} {show(r['fastest']):>32} "
              f"{show(r['fastest_within_torch_cpu']):>32}")


# ---- main ---------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=None)
    p.add_argument("--kinds", nargs="+", default=["hot", "cold"], choices=["hot", "cold"])
    p.add_argument("--settings", nargs="+", default=None, choices=list(SETTINGS))
    p.add_argument("--quick", action="store_true",
                   help=f"sizes {' '.join(QUICK_SIZES)}, settings {' '.join(QUICK_SETTINGS)}, "
                        "60 s unless --max-seconds")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="the whole run's budget (default 270; --quick 60); past it the rows "
                        "left are measured in one round of --calls calls")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="at least this many calls a cell a turn")
    p.add_argument("--settle-ms", type=float, default=15.0)
    p.add_argument("--cold-max-bytes", default="4G",
                   help="most memory for the cold sources (also at most a quarter of "
                        "MemAvailable)")
    p.add_argument("--recommend", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t_start = time.monotonic()
    budget = args.max_seconds if args.max_seconds is not None else (60 if args.quick else 270)
    sizes = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else SIZES))]
    names = args.settings or (QUICK_SETTINGS if args.quick else list(SETTINGS))
    settings = {n: SETTINGS[n] for n in names}

    gpu = fastpin.cuda_available() and torch.cuda.is_available()
    all_threads = torch.get_num_threads()
    _pin.settings.load()  # FASTPIN_STREAMING now, not in the middle of a cell
    defaults = {k: v for k, v in _pin.copy_tuning().items() if k in _pin.COPY_KEYS}
    llc = llc_bytes()
    cap = min(parse_size(args.cold_max_bytes), mem_available() // 4)
    pool_bytes = max(min(4 * llc, cap), max(sizes))
    # One allocation carved into sources: a size's hot source is its first
    # slice, its cold ones as many slices as make 4x the LLC (at least 2).
    base = torch.arange(pool_bytes // 8, dtype=torch.int64).view(torch.uint8)
    print(f"{os.cpu_count()} CPUs ({_C.cpu_count()} usable), torch threads {all_threads}, "
          f"fastpin pool {_C.get_threads()} threads ({_C.copy_tuning()['spinners']} may spin), "
          f"GPU {gpu}; LLC {llc / MiB:.0f} MiB, cold sources up to {pool_bytes / MiB:.0f} MiB; "
          f"defaults {defaults}; budget {budget:g} s")

    plan = []  # (nbytes, kind, sources)
    for n in sizes:
        for kind in args.kinds:
            # Cold: enough sources for 4x the LLC, as many as fit; one source (4x the
            # LLC alone, or all that fits) is the hot row again.
            needed = math.ceil(4 * llc / n)
            count = 1 if kind == "hot" or needed <= 1 else max(1, min(pool_bytes // n, needed))
            plan.append((n, kind, [base[i * n:(i + 1) * n] for i in range(count)]))
    ncells = len(plan) * (len(settings) + (5 if gpu else 4))

    rows, recs = [], []
    done_cells = 0
    hot_rows: dict = {}
    reduced = False
    for n, kind, sources in plan:
        if len(sources) == 1 and kind == "cold" and n in hot_rows:
            # One source is 4x the LLC: every call reads it from memory, hot or not.
            row = dict(hot_rows[n], kind="cold", same_as_hot=True)
            rows.append(row)
            recs.append(recommend(row))
            done_cells += len(row["cells"])
            continue
        check(sources, settings, defaults, n)
        cells = make_cells(n, sources, settings, gpu, all_threads)
        left = budget - (time.monotonic() - t_start)
        # A fifth of each share goes to warm-ups, settles and reading /proc.
        seconds_per_cell = max(0.0, left / max(1, ncells - done_cells)) * 0.8
        rounds, calls = args.rounds, args.calls
        if left <= 0:
            if not reduced:
                print(f"  over the budget of {budget:g} s: the rows left get one round of "
                      f"{args.calls} calls", flush=True)
            reduced = True
            rounds = 1
        measure_row(cells, n, defaults, seconds_per_cell, rounds, calls, args.settle_ms / 1e3)
        done_cells += len(cells)
        row = {"bytes": n, "kind": kind, "sources": len(sources),
               "source_bytes": len(sources) * n, "rounds": rounds,
               "default_blocks": distinct_blocks(sources, defaults),
               "cells": {c.name: c.result(n) for c in cells}}
        if kind == "hot":
            hot_rows[n] = row
        rows.append(row)
        recs.append(recommend(row))
        print(f"  {fmt_size(n)} {kind} ({len(sources)} sources; the default setting's "
              f"blocks over 200 calls: {row['default_blocks']}): "
              f"{time.monotonic() - t_start:.0f} s", flush=True)
        del cells
    elapsed = time.monotonic() - t_start
    print_table(rows, "gbps", "GB/s (median call)")
    print_table(rows, "cpu_s_per_gb", "CPU-seconds per GB, every thread of the process "
                "(a turn's calls and the settle after them)")
    print_table(rows, "tail_cpu_ms", "CPU-ms after a turn's last call (threads spinning on)")
    if args.recommend:
        print_recommend(recs)
    print(f"\n{elapsed:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "cpus": _C.cpu_count(), "torch_threads": all_threads,
                       "torch": torch.__version__, "python": sys.version.split()[0],
                       "fastpin_threads": _C.get_threads(),
                       "spinners": _C.copy_tuning()["spinners"], "llc_bytes": llc,
                       "defaults": defaults, "settings": settings, "rounds": args.rounds,
                       "budget_s": budget, "over_budget": reduced,
                       "elapsed_s": round(elapsed, 1), "rows": rows, "recommend": recs},
                      f, indent=1, default=list)


if __name__ == "__main__":
    main()
