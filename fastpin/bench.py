"""python -m fastpin.bench: fastpin's pinning path side by side with PyTorch's.

For each batch size it times, on the same patterned source batch:

  memcpy 1 thread / N threads   copy into ordinary preallocated memory: the
                                machine's copy rates, the ceiling for pinning
  torch pin 1 thread            Tensor.pin_memory() with torch.set_num_threads(1),
                                what DataLoader's pin thread runs
  torch pin N threads           the same with all of torch's threads
  fastpin.pin_memory            into the pinned arena, on fastpin's copy threads

With no GPU there is no page-locked memory: the torch pin rows are skipped
(torch cannot pin without an accelerator) and fastpin copies into ordinary
memory; the table says so.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

import fastpin
from fastpin import _C

MB = 1 << 20


def _patterned(nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _time(fn, nbytes: int, min_seconds: float, min_iters: int) -> float:
    """Median GB/s of fn() over at least min_iters calls and min_seconds."""
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


class _Threads:
    """torch.set_num_threads for the duration of a block."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def pin_table(sizes_mb, min_seconds: float = 0.5, min_iters: int = 5) -> dict:
    """Measure every pinning path at each size; returns the results as a dict."""
    gpu = fastpin.cuda_available() and torch.cuda.is_available()
    all_threads = torch.get_num_threads()
    fastpin.configure(capacity=max(1 << 30, 3 * max(sizes_mb) * MB))
    rows = []
    for size_mb in sizes_mb:
        nbytes = int(size_mb * MB)
        src = _patterned(nbytes)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault its pages in before timing
        row = {"size_mb": size_mb}
        with _Threads(1):
            row["memcpy_1"] = _time(lambda: dst.copy_(src), nbytes, min_seconds, min_iters)
        with _Threads(all_threads):
            row["memcpy_n"] = _time(lambda: dst.copy_(src), nbytes, min_seconds, min_iters)
        if gpu:
            with _Threads(1):
                row["torch_pin_1"] = _time(lambda: src.pin_memory(), nbytes, min_seconds, min_iters)
            with _Threads(all_threads):
                row["torch_pin_n"] = _time(lambda: src.pin_memory(), nbytes, min_seconds, min_iters)
        pinned = fastpin.pin_memory(src)
        if not torch.equal(pinned, src):
            raise AssertionError("fastpin.pin_memory returned different data")
        del pinned
        row["fastpin"] = _time(lambda: fastpin.pin_memory(src), nbytes, min_seconds, min_iters)
        rows.append(row)
        _progress(f"  {size_mb:g} MB done")
    return {
        "gpu": gpu,
        "torch_threads": all_threads,
        "fastpin_threads": _C.get_threads(),
        "rows": rows,
    }


class _TimmPrefetcher:
    """A side-stream prefetcher as timm's PrefetchLoader and Apex's
    data_prefetcher write it: copy batch N+1 on a side stream while batch N
    computes; the compute stream waits on the side stream."""

    def __init__(self, batches):
        self.batches = batches
        self.stream = torch.cuda.Stream()

    def __iter__(self):
        first = True
        for batch in self.batches:
            with torch.cuda.stream(self.stream):
                nxt = batch.to("cuda", non_blocking=True)
            if not first:
                yield current
            else:
                first = False
            torch.cuda.current_stream().wait_stream(self.stream)
            nxt.record_stream(torch.cuda.current_stream())
            current = nxt
        if not first:
            yield current


def _compute(x, weight, reps):
    """A step of `reps` matrix products whose input depends on the batch."""
    h = weight + x[:1].float().mean() * 0
    for _ in range(reps):
        h = h @ weight
    return h


def step_table(batch_mb: int = 256, steps: int = 40) -> dict:
    """Step time of a simulated training loop with compute C and transfer T,
    for C < T and C > T, through three paths fed the same pinned batches."""
    nbytes = batch_mb * MB
    pinned = [_patterned(nbytes + i).narrow(0, 0, nbytes).pin_memory() for i in range(4)]
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    # T: the copy alone; C per product: the compute alone.
    def timed(fn, n=10):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    transfer = timed(lambda: pinned[0].to("cuda", non_blocking=True))
    per_product = timed(lambda: _compute(torch.empty(1, device="cuda"), weight, 50)) / 50
    rows = []
    for ratio in (0.5, 2.0):
        reps = max(1, round(ratio * transfer / per_product))
        compute = timed(lambda: _compute(torch.empty(1, device="cuda"), weight, reps))
        feed = [pinned[i % len(pinned)] for i in range(steps)]

        def run(loader):
            it = iter(loader)
            x = next(it)  # warm-up step, not timed
            _compute(x, weight, reps)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 0
            for x in it:
                _compute(x, weight, reps)
                n += 1
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n

        def stock():
            for x in feed:
                yield x.to("cuda", non_blocking=True)

        row = {"compute_ms": compute * 1e3, "transfer_ms": transfer * 1e3,
               "stock_ms": run(stock()) * 1e3,
               "prefetcher_ms": run(_TimmPrefetcher(feed)) * 1e3,
               "fastpin_ms": run(fastpin.Loader(feed, device="cuda")) * 1e3}
        row["bound_ms"] = max(row["compute_ms"], row["transfer_ms"])
        rows.append(row)
        _progress(f"  step C/T={ratio:g} done")
    return {"batch_mb": batch_mb, "steps": steps, "rows": rows}


def format_step_table(result: dict) -> str:
    lines = [
        f"Batch of {result['batch_mb']} MB (pinned), {result['steps']} steps; ms per step.",
        "",
        "| compute C | transfer T | max(C, T) | stock .to(non_blocking) | timm/Apex prefetcher | "
        "fastpin.Loader | fastpin / max(C, T) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['compute_ms']:.2f} | {r['transfer_ms']:.2f} | {r['bound_ms']:.2f} | "
            f"{r['stock_ms']:.2f} | {r['prefetcher_ms']:.2f} | {r['fastpin_ms']:.2f} | "
            f"{r['fastpin_ms'] / r['bound_ms']:.3f}x |")
    return "\n".join(lines)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def format_pin_table(result: dict) -> str:
    n, fp = result["torch_threads"], result["fastpin_threads"]
    lines = [
        f"| batch | memcpy 1 thread | memcpy {n} threads | torch pin 1 thread | "
        f"torch pin {n} threads | fastpin ({fp} threads) | fastpin / memcpy {n} | "
        "fastpin / torch pin 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t1 = r.get("torch_pin_1")
        lines.append(
            f"| {r['size_mb']:g} MB | {_fmt(r['memcpy_1'])} | {_fmt(r['memcpy_n'])} | {_fmt(t1)} | "
            f"{_fmt(r.get('torch_pin_n'))} | {_fmt(r['fastpin'])} | "
            f"{r['fastpin'] / r['memcpy_n']:.2f}x | "
            f"{'n/a' if t1 is None else format(r['fastpin'] / t1, '.2f') + 'x'} |")
    lines.append("")
    lines.append("GB/s, median of repeated calls on the same patterned batch.")
    if not result["gpu"]:
        lines.append("No GPU: nothing is page-locked here; torch cannot pin without an "
                     "accelerator, so its pin rows are n/a and fastpin copies into ordinary memory.")
    return "\n".join(lines)


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastpin": fastpin.__version__,
        "cpus": _C.cpu_count(),
        "cuda": fastpin.cuda_status()._asdict(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpin.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 256],
                        help="batch sizes in MB (default: 1 16 256)")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="least time spent timing each cell (default: 0.5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    info = machine()
    status = info["cuda"]
    print(f"fastpin {info['fastpin']}, torch {info['torch']}, Python {info['python']}, "
          f"{info['cpus']} CPUs, GPU: {info.get('gpu', 'none')}")
    if status["state"] != "ready":
        print(f"No GPU path: {status['reason']}")
    print()
    _progress("pin_memory: timing ...")
    result = pin_table(args.sizes, min_seconds=args.seconds)
    print("## pin_memory of one batch\n")
    print(format_pin_table(result))
    results = {"machine": info, "pin_memory": result}
    print("\n## Training step: compute overlapped with transfer\n")
    if result["gpu"]:
        _progress("training step: timing ...")
        results["step"] = step_table()
        print(format_step_table(results["step"]))
    else:
        print("Skipped: needs a GPU.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
