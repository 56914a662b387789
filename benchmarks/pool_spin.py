"""The copy pool with spinning workers: for each size and each
_C.set_spin value, the median us of one fastpin.pin_memory(x) call and of one
_C.copy between two buffers (the pool alone), and beside it the CPU seconds
per GB copied of every thread of this process (/proc/self/task: the caller,
the pool's threads, spinning or not, and any other), so what spinning saves
in time shows next to what it burns. With a GPU, torch's own pin
(x.pin_memory(), all of torch's threads) is timed alongside.

    python benchmarks/pool_spin.py [--sizes 256K 512K 1M ...]
        [--spins 0 20000 100000] [--calls 200] [--rounds 3] [--json FILE]

Every case takes turns with the others in --rounds rounds of --calls calls,
so a drifting machine moves them alike. A case's CPU window ends 2 x spin
after its last call, so the spin after the last call is counted too. Spin is
put back to 0 at the end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fastpin
from fastpin import _C
from fastpin.bench import procfs


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def cpu_ns() -> dict:
    """{tid: CPU ns so far} of every thread of this process."""
    return {tid: t.run_ns for tid, t in procfs.threads().items()}


def cpu_since(before: dict) -> float:
    """CPU seconds of every thread since `before` (a thread born since counted from 0)."""
    return sum(ns - before.get(tid, 0) for tid, ns in cpu_ns().items()) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["256K", "512K", "1M", "2M", "4M", "8M"])
    p.add_argument("--spins", nargs="+", type=int, default=[0, 20_000, 100_000])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    cuda = fastpin.cuda_available() and torch.cuda.is_available()

    data = {}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        dst = torch.empty_like(x)
        data[n] = (x, dst)
        if not torch.equal(fastpin.pin_memory(x), x):
            raise AssertionError("pin_memory returned different bytes")
        _C.copy(dst.data_ptr(), x.data_ptr(), n)
        if not torch.equal(dst, x):
            raise AssertionError("_C.copy returned different bytes")

    def pin_fn(n):
        x = data[n][0]
        return lambda: fastpin.pin_memory(x)

    def copy_fn(n):
        x, dst = data[n]
        src_p, dst_p = x.data_ptr(), dst.data_ptr()
        return lambda: _C.copy(dst_p, src_p, n)

    cases = []  # (path, spin, bytes, fn)
    for n in sizes:
        for spin in args.spins:
            cases.append(("pin_memory", spin, n, pin_fn(n)))
            cases.append(("copy", spin, n, copy_fn(n)))
        if cuda:
            x = data[n][0]
            cases.append(("torch_pin", None, n, lambda x=x: x.pin_memory()))

    times = {i: [] for i in range(len(cases))}
    cpu = {i: 0.0 for i in range(len(cases))}
    try:
        for _ in range(args.rounds):
            for i, (path, spin, n, fn) in enumerate(cases):
                _C.set_spin(spin or 0)
                for _ in range(5):
                    fn()
                out = times[i]
                before = cpu_ns()
                for _ in range(args.calls):
                    t0 = time.perf_counter_ns()
                    fn()
                    out.append(time.perf_counter_ns() - t0)
                time.sleep(2 * (spin or 0) / 1e9)
                cpu[i] += cpu_since(before)
    finally:
        _C.set_spin(0)

    rows = []
    print(f"pool of {_C.get_threads()} threads, {_C.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}; {args.rounds} x {args.calls} calls a case")
    print(f"{'path':>10} {'bytes':>9} {'spin us':>7} {'median us':>9} {'GB/s':>7} "
          f"{'CPU s/GB':>8}")
    for i, (path, spin, n, _) in enumerate(cases):
        med = statistics.median(times[i]) / 1e3
        gb = len(times[i]) * n / 1e9
        row = {"path": path, "spin_ns": spin, "bytes": n, "median_us": round(med, 2),
               "gbps": round(n / med / 1e3, 2), "cpu_s_per_gb": round(cpu[i] / gb, 4)}
        rows.append(row)
        spin_s = "-" if spin is None else f"{spin / 1e3:g}"
        print(f"{path:>10} {n:>9} {spin_s:>7} {med:>9.1f} {row['gbps']:>7.2f} "
              f"{row['cpu_s_per_gb']:>8.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": _C.get_threads(), "cpus": _C.cpu_count(),
                       "calls": args.calls, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
