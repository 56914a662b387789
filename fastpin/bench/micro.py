"""The micro tables: pin_memory of one batch by size (pin_table), a training
step with compute and transfer overlapped (step_table), and a DataLoader's
delivered throughput over in-memory images (loader_table); each with its
Markdown formatter. Each reports a step to `reporter` as it finishes a stage."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, ContextManager, Optional

import fastpin
from fastpin import _C

from ._optional import torch
from .host import MB
from .paths import SideStreamPrefetcher
from .progress import Progress
from .results import workers_label, wrap
from .runner import MIN_SECONDS, enough
from .workloads import Images

_QUIET = Progress(0, enabled=False)  # a table run on its own reports nothing


def _patterned(nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


# Each cell of a row is timed in this many turns, the cells taking turns, so
# that a machine whose speed drifts (small copies on shared hosts vary from
# second to second) moves every cell alike, not only the one timed last.
_ROUNDS = 5


def interleaved(fns: dict, *, calls: int = 1, seconds: float = 0.0, warmup: int = 3,
                around: Optional[Callable[[str], ContextManager]] = None,
                cpu: Optional[dict] = None) -> dict:
    """The seconds of each call of each fn (name -> fn): at least `calls` calls
    and `seconds` of calls each, timed in _ROUNDS turns that go round every fn.
    `warmup` untimed calls open an fn's first turn, one each later turn; each
    turn of an fn runs inside around(name) where given. `cpu`, where given, gets
    each fn's CPU-seconds over its timed calls, every thread of this process
    counted (time.process_time: the copy pool's and torch's threads too, even
    those that spin waiting for work)."""
    times: dict = {name: [] for name in fns}
    for turn in range(1, _ROUNDS + 1):
        for name, fn in fns.items():
            out = times[name]
            with around(name) if around is not None else contextlib.nullcontext():
                for _ in range(warmup if turn == 1 else 1):
                    fn()
                start, cpu0 = time.perf_counter(), time.process_time()
                while (len(out) * _ROUNDS < calls * turn
                       or time.perf_counter() - start < seconds / _ROUNDS):
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
                if cpu is not None:
                    cpu[name] = cpu.get(name, 0.0) + time.process_time() - cpu0
    return times


def _time_cells(cells: dict, nbytes: int, min_seconds: float, min_iters: int) -> dict:
    """Median GB/s of each cell's fn() (name -> (fn, torch threads)), and under
    "cpu_s_per_gb" each cell's CPU-seconds per GB copied (every thread of the process)."""
    cpu: dict = {}
    times = interleaved({name: fn for name, (fn, _) in cells.items()}, calls=min_iters,
                        seconds=min_seconds, around=lambda name: _Threads(cells[name][1]),
                        cpu=cpu)
    out: dict = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    out["cpu_s_per_gb"] = {name: cpu[name] / (len(t) * nbytes / 1e9) for name, t in times.items()}
    return out


class _Threads:
    """torch.set_num_threads for the duration of a block."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def _pin_row(size_mb: float, gpu: bool, all_threads: int, min_seconds: float,
             min_iters: int) -> dict:
    nbytes = int(size_mb * MB)
    src = _patterned(nbytes)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault its pages in before timing
    pinned = fastpin.pin_memory(src)
    if not torch.equal(pinned, src):
        raise AssertionError("fastpin.pin_memory returned different data")
    del pinned
    cells = {
        "memcpy_1": (lambda: dst.copy_(src), 1),
        "memcpy_n": (lambda: dst.copy_(src), all_threads),
        # The same copy on fastpin's pool, into ordinary memory: with torch's the
        # best multi-thread memcpy rate this machine shows, the ceiling to compare with.
        "memcpy_pool": (lambda: _C.copy(dst.data_ptr(), src.data_ptr(), nbytes), all_threads),
    }
    if gpu:
        cells["torch_pin_1"] = (lambda: src.pin_memory(), 1)
        cells["torch_pin_n"] = (lambda: src.pin_memory(), all_threads)
    cells["fastpin"] = (lambda: fastpin.pin_memory(src), all_threads)
    return {"size_mb": size_mb, **_time_cells(cells, nbytes, min_seconds, min_iters)}


def pin_table(sizes_mb, min_seconds: float = 0.5, min_iters: int = 5,
              reporter: Progress = _QUIET) -> dict:
    """Measure every pinning path at each size; returns the results as a dict."""
    gpu = fastpin.cuda_available() and torch.cuda.is_available()
    all_threads = torch.get_num_threads()
    # fastpin's default arena as configured: unset, it grows to the largest size
    # in each row's untimed warm-up calls.
    rows = []
    for size_mb in sizes_mb:
        rows.append(_pin_row(size_mb, gpu, all_threads, min_seconds, min_iters))
        reporter.step_done(f"  {size_mb:g} MiB done")
    return {
        "gpu": gpu,
        "torch_threads": all_threads,
        "fastpin_threads": _C.get_threads(),
        "rows": rows,
    }


def _compute(x, weight, reps):
    """A step of `reps` matrix products whose input depends on the batch."""
    h = weight + x[:1].float().mean() * 0
    for _ in range(reps):
        h = h @ weight
    return h


def _cuda_timed(fn, n=10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def _step_time(loader, weight, reps) -> float:
    """Seconds per step of `reps` products over the loader's batches (the first untimed)."""
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


def step_table(batch_mb: int = 256, steps: int = 100, reporter: Progress = _QUIET) -> dict:
    """Step time of a simulated training loop with compute C and transfer T,
    for C < T and C > T, through three paths fed the same pinned batches."""
    nbytes = batch_mb * MB
    pinned = [_patterned(nbytes + i).narrow(0, 0, nbytes).pin_memory() for i in range(4)]
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    device = torch.device("cuda", torch.cuda.current_device())
    # T: the copy alone; C per product: the compute alone.
    transfer = _cuda_timed(lambda: pinned[0].to("cuda", non_blocking=True))
    per_product = _cuda_timed(lambda: _compute(torch.empty(1, device="cuda"), weight, 50)) / 50
    rows = []
    for ratio in (0.5, 2.0):
        reps = max(1, round(ratio * transfer / per_product))
        feed = [pinned[i % len(pinned)] for i in range(steps)]
        resident = pinned[0].to("cuda")
        stock = (x.to("cuda", non_blocking=True) for x in feed)
        # C: the same loop over a batch already on the GPU.
        compute = _step_time((resident for _ in range(steps)), weight, reps)
        row = {"compute_ms": compute * 1e3, "transfer_ms": transfer * 1e3,
               "stock_ms": _step_time(stock, weight, reps) * 1e3,
               "prefetcher_ms": _step_time(SideStreamPrefetcher(feed, device), weight, reps) * 1e3,
               "fastpin_ms": _step_time(fastpin.Loader(feed, device="cuda"), weight, reps) * 1e3}
        row["bound_ms"] = max(row["compute_ms"], row["transfer_ms"])
        rows.append(row)
        reporter.step_done(f"  step C/T={ratio:g} done")
    return {"batch_mb": batch_mb, "steps": steps, "rows": rows}


def format_step_table(result: dict) -> str:
    lines = [
        f"Batch of {result['batch_mb']} MiB (pinned), {result['steps']} steps; ms per step.",
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


def _delivered(loader, ahead: int, to_device: bool, gpu: bool, batches: int, batch_bytes: int,
               max_seconds: Optional[float], timed: list) -> tuple:
    """(GB/s, main-process CPU ms per batch) of `loader`, timed as compare() times a
    path: after the first batch and the `ahead` its workers made meanwhile (at
    least 3), at least `batches` batches and MIN_SECONDS; appends the batches
    timed to `timed`."""
    it = iter(loader)
    for _ in range(1 + max(3, ahead)):  # workers up, arena warm, the prefetched drained
        x = next(it)[0]
    if gpu:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for x, _ in it:
        if to_device:
            x = x.to("cuda", non_blocking=True)
        n += 1
        if enough(n, time.perf_counter() - t0, batches, MIN_SECONDS, max_seconds):
            break
    if gpu:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del it
    timed.append(n)
    return n * batch_bytes / wall / 1e9, cpu / n * 1e3


def _loader_row(data, dtype_name: str, nw: int, g, gpu: bool, batches: int, batch_size: int,
                max_seconds: Optional[float], reporter: Progress) -> dict:
    """One dtype and worker count through the three paths."""
    from torch.utils.data import DataLoader, RandomSampler

    from fastpin._zerocopy import capacity_for

    device = "cuda" if gpu else None
    batch_bytes = batch_size * data[0].numel() * data.element_size()

    def make():
        # Endless: each path takes what its warm-up and timing need.
        sampler = RandomSampler(Images(data), replacement=True,
                                num_samples=batch_size * (1 << 30), generator=g)
        dl = DataLoader(Images(data), batch_size=batch_size, sampler=sampler,
                        num_workers=nw, pin_memory=gpu, persistent_workers=False)
        return dl

    ahead = nw * 2 + 2  # the workers' prefetch_factor (2), the Loader's depth

    def measure(loader, to_device):
        return _delivered(loader, ahead, to_device, gpu, batches, batch_bytes, max_seconds,
                          timed)

    row = {"dtype": dtype_name, "workers": nw, "batch_mb": batch_bytes / MB}
    timed: list = []  # batches each path timed
    row["stock_gbps"], row["stock_cpu_ms"] = measure(make(), gpu)
    reporter.step_done(f"  {dtype_name} {workers_label(nw)}: pin_memory={gpu} done")
    dl = make()
    dl.pin_memory = False
    capacity = max(1 << 30, capacity_for(dl, batch_bytes, depth=2))  # Loader's depth
    # The copying Loader pins in the default arena as configured (unset: it sizes itself).
    row["copy_gbps"], row["copy_cpu_ms"] = measure(fastpin.Loader(dl, device=device), False)
    reporter.step_done(f"  {dtype_name} {workers_label(nw)}: fastpin.Loader done")
    dl = make()
    dl.pin_memory = False
    zc = fastpin.Loader(dl, device=device, zero_copy=True, capacity=capacity)
    row["zero_copy_gbps"], row["zero_copy_cpu_ms"] = measure(zc, False)
    row["zero_copy_fallbacks"] = zc.stats()["worker_fallbacks"]
    row["batches_timed"] = timed
    reporter.step_done(f"  {dtype_name} {workers_label(nw)}: zero-copy done")
    return row


def loader_table(workers=(8, 15), batches: int = 300, batch_size: int = 256,
                 dtypes=("uint8", "float32"), max_seconds: Optional[float] = None,
                 reporter: Progress = _QUIET) -> dict:
    """Delivered GB/s of a DataLoader over in-memory 3x224x224 images, random
    sampling over one long epoch, no compute: pin_memory=True, fastpin.Loader
    copying, fastpin.Loader(zero_copy=True). With no GPU, batches are delivered
    to the host instead (and pin_memory=True cannot pin). Each path is timed
    over `batches` batches, or fewer once `max_seconds` have passed."""
    gpu = fastpin.cuda_available() and torch.cuda.is_available()
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, 256, (1024, 3, 224, 224), dtype=torch.uint8, generator=g).to(dtype)
        for nw in workers:
            rows.append(_loader_row(data, dtype_name, nw, g, gpu, batches, batch_size,
                                    max_seconds, reporter))
    return {"gpu": gpu, "batches": batches, "batch_size": batch_size, "rows": rows,
            "max_seconds": max_seconds}


def format_loader_table(result: dict) -> str:
    # With no GPU, torch cannot pin: the stock column ran DataLoader(pin_memory=False).
    stock = "pin_memory=True" if result["gpu"] else "pin_memory=False"
    where = ("to the GPU" if result["gpu"] else
             "to host batches (no GPU here: nothing is page-locked, and torch cannot pin, so "
             "the stock DataLoader ran with pin_memory=False)")
    budget = f" (up to {result['max_seconds']:g} s)" if result.get("max_seconds") else ""
    lines = [
        wrap(f"Delivered {where}, GB/s; main-process CPU ms per batch in brackets. At least "
             f"{result['batches']} batches and {MIN_SECONDS:g} s{budget} of "
             f"{result['batch_size']} images 3x224x224 timed per path, after those its workers "
             f"made ahead; random sampling. Loader: fastpin.Loader copying; x stock: zero-copy "
             f"/ {stock}; fallbacks: batches zero-copy's workers collated the ordinary way."),
        "",
        f"| dtype | workers | batch | {stock} | Loader | Loader(zero_copy) | x stock | "
        "fallbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['workers']} | {r['batch_mb']:.1f} MiB | "
            f"{r['stock_gbps']:.1f} ({r['stock_cpu_ms']:.2f}) | "
            f"{r['copy_gbps']:.1f} ({r['copy_cpu_ms']:.2f}) | "
            f"{r['zero_copy_gbps']:.1f} ({r['zero_copy_cpu_ms']:.2f}) | "
            f"{r['zero_copy_gbps'] / r['stock_gbps']:.1f}x | {r['zero_copy_fallbacks']} |")
    if result.get("max_seconds"):
        timed = ", ".join(f"{r['dtype']} {workers_label(r['workers'])} "
                          f"{'/'.join(map(str, r['batches_timed']))}"
                          for r in result["rows"] if r.get("batches_timed"))
        lines += ["", wrap(f"Batches timed ({stock} / fastpin.Loader / zero-copy): {timed}.")]
    return "\n".join(lines)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


# A cell this many times slower than its row's fastest memcpy timed no copy: a
# small copy split over threads on a busy machine waits for a core (2 threads, 64
# KiB: 8 ms a call against 2 us on one thread), and its GB/s would print as 0.0.
_TOO_SHORT = 100


def _cell(x, fastest: float) -> str:
    return "too short*" if x is not None and x * _TOO_SHORT < fastest else _fmt(x)


# The pinning paths whose CPU-seconds per GB the pin table shows.
_PIN_CPU = ("torch_pin_1", "torch_pin_n", "fastpin")
_PIN_LABEL = {"torch_pin_1": "torch pin 1", "torch_pin_n": "torch pin N", "fastpin": "fastpin"}


def _cpu_cell(cpu: dict, key: str) -> str:
    return "n/a" if cpu.get(key) is None else f"{cpu[key]:.3f}"


def format_pin_table(result: dict) -> str:
    """Two narrow tables: GB/s of each path by size, then each pinning path's
    CPU-seconds per GB; torch's pinning columns only where torch can pin."""
    n, fp = result["torch_threads"], result["fastpin_threads"]
    gpu = result["gpu"]
    rate = [("memcpy_1", "memcpy 1"), ("memcpy_n", f"memcpy {n}"), ("memcpy_pool", f"pool {fp}")]
    if gpu:
        rate += [("torch_pin_1", "torch pin 1"), ("torch_pin_n", f"torch pin {n}")]
    rate += [("fastpin", f"fastpin {fp}")]
    pins = [k for k in _PIN_CPU if gpu or k == "fastpin"]
    # Without a GPU only fastpin pins: its CPU s/GB is one more column.
    lines = ["| batch | " + " | ".join(h for _, h in rate) + " | x memcpy |"
             + (" x pin 1 |" if gpu else " CPU s/GB |"),
             "|---:|" + "---:|" * (len(rate) + 2)]
    short = False
    for r in result["rows"]:
        best = max(r["memcpy_n"], r["memcpy_pool"])
        fastest = max(r["memcpy_1"], best)
        cells = [_cell(r.get(k), fastest) for k, _ in rate]
        short = short or "too short*" in cells
        cells.append(f"{r['fastpin'] / best:.2f}x")
        cpu = r.get("cpu_s_per_gb", {})
        if gpu:
            t1 = r.get("torch_pin_1")
            cells.append("n/a" if not t1 else f"{r['fastpin'] / t1:.2f}x")
        else:
            cells.append(_cpu_cell(cpu, "fastpin"))
        lines.append(f"| {r['size_mb']:g} MiB | " + " | ".join(cells) + " |")
    if gpu:
        lines += ["", "| batch | " + " | ".join(f"CPU s/GB: {_PIN_LABEL[k]}" for k in pins)
                  + " |", "|---:|" + "---:|" * len(pins)]
        for r in result["rows"]:
            cpu = r.get("cpu_s_per_gb", {})
            lines.append(f"| {r['size_mb']:g} MiB | "
                         + " | ".join(_cpu_cell(cpu, k) for k in pins) + " |")
    notes = [f"GB/s, median of repeated calls on the same patterned batch, the columns timed "
             f"in five interleaved turns; memcpy N: torch's copy on N threads, pool: fastpin's "
             f"copy threads into ordinary memory; x memcpy: fastpin over the faster "
             f"multi-thread memcpy" + ("; x pin 1: over torch's pin on one thread "
                                       "(DataLoader's pin thread)" if gpu else "") + ". "
             "CPU s/GB: the CPU time of every thread of this process over a path's timed calls "
             "(its copy threads, torch's threads, and any that spin waiting), per GB pinned"
             + ("." if gpu else " (fastpin's).")]
    if short:
        notes.append(f"* too short: its median call took over {_TOO_SHORT}x as long as the "
                     "row's fastest memcpy of the same bytes: a copy this short timed threads "
                     "waiting for a core (a busy machine), not copying; --json keeps the figure.")
    if not gpu:
        notes.append("Torch cannot pin without an accelerator (its columns are left out), and "
                     "without a GPU fastpin copies into ordinary memory: nothing is page-locked.")
    return "\n".join(lines + [""] + [wrap(t) for t in notes])
