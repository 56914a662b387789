"""python -m fastpin.bench: fastpin side by side with PyTorch's own paths, on
batches shaped like real workloads.

Cases (--case, repeatable; default: all of them):

  pin_sizes     pin_memory of one batch of 64 KiB to 256 MiB: the machine's memcpy
                rates, torch's pinning with 1 and N threads, fastpin.pin_memory
  train_step    a training step with compute C and transfer T (C < T, C > T):
                stock .to(), the timm/Apex prefetcher, fastpin.Loader (GPU only)
  loader_images DataLoader delivered GB/s, uint8 and float32 images, batch 256:
                pin_memory=True, fastpin.Loader, fastpin.Loader(zero_copy=True)
  train_model   training resnet18 (torchvision's or timm's) on in-memory images,
                every path beside the batch already on the GPU (fastpin.bench_train)
  images_u8     uint8 images 3x224x224, batch 256 (36.8 MiB)
  images_f32    float32 images 3x224x224, batch 256 (147 MiB)
  tokens        int64 token sequences of 2k-8k tokens, batch 8, padded per batch
                (input_ids, attention_mask, labels)
  recsys        a recommendation batch: a dict of 50 feature tensors, 4096 rows
  video         float32 clips 3x32x224x224, batch 16 (294 MiB)

The five workload cases go through every path that applies (--path, repeatable):

  pageable      DataLoader(pin_memory=False); batch.to(device, non_blocking=True)
  pin_memory    DataLoader(pin_memory=True) (torch's pin thread); then .to()
  prefetcher    the timm/Apex side-stream prefetcher over DataLoader(pin_memory=True)
  fastpin_pin   DataLoader(pin_memory=False); fastpin.pin_memory(batch); then .to()
  loader_host   fastpin.Loader(loader, device=None): pinned host batches; then .to()
  loader_cuda   fastpin.Loader(loader, device="cuda"): batches arrive on the GPU
  zero_copy     fastpin.Loader(loader, zero_copy=True): workers collate into the
                shared pinned arena (device "cuda", or None where there is no GPU)

Figures per path: delivered GB/s; step time with --compute-ms of simulated compute
per step (a GPU kernel that spins for that long; with no GPU, the main thread
sleeps, as a host waiting for its GPU does); main-process CPU per batch (every
thread of this process: pin thread, copy threads, the Loader's thread); pinned
memory held (torch's pinned cache, or fastpin's page-locked arena) with the peak
in use; time from making the loader to the first batch on the device.

With no GPU the GPU paths are skipped, with the reason, and the host paths still
run. A case that needs more memory than is available is skipped, with the reason.

The same measurement for your own DataLoader: fastpin.bench.compare(...).
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import io
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import fastpin
from fastpin import _C, _torch
from fastpin._walk import map_leaves
from fastpin._walk import nbytes as batch_nbytes

try:
    import torch
    from torch.utils.data import Dataset as _Dataset

    from fastpin._zerocopy import capacity_for
except ModuleNotFoundError as _exc:
    # python -m fastpin.bench without torch: --help and --list still work, and
    # everything else says what to install (main()); an import says it at once.
    if _exc.name != "torch" or __name__ != "__main__":
        if _exc.name == "torch":
            raise ModuleNotFoundError(_torch.message("fastpin.bench"), name="torch") from None
        raise
    torch = None
    _Dataset = object

__all__ = ["CASES", "PATHS", "Results", "Row", "compare", "main", "plot"]

log = logging.getLogger("fastpin.bench")

MB = 1 << 20  # sizes are MiB (and labelled so); rates are GB/s of 1e9 bytes


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
    fastpin.configure(capacity=int(max(1 << 30, 3 * max(sizes_mb) * MB)))
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
        # The same copy on fastpin's pool, into ordinary memory: with torch's the
        # best multi-thread memcpy rate this machine shows, the ceiling to compare with.
        row["memcpy_pool"] = _time(lambda: _C.copy(dst.data_ptr(), src.data_ptr(), nbytes),
                                   nbytes, min_seconds, min_iters)
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
        _progress(f"  {size_mb:g} MiB done")
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


def step_table(batch_mb: int = 256, steps: int = 100) -> dict:
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
        feed = [pinned[i % len(pinned)] for i in range(steps)]
        resident = pinned[0].to("cuda")

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

        # C: the same loop over a batch already on the GPU.
        compute = run(resident for _ in range(steps))
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


class _Images(_Dataset):
    """An in-memory image set: samples are views, so loading costs nothing and
    the loader's own path is what is measured."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def loader_table(workers=(8, 15), batches: int = 300, batch_size: int = 256,
                 dtypes=("uint8", "float32"), max_seconds: Optional[float] = None) -> dict:
    """Delivered GB/s of a DataLoader over in-memory 3x224x224 images, random
    sampling over one long epoch, no compute: pin_memory=True, fastpin.Loader
    copying, fastpin.Loader(zero_copy=True). With no GPU, batches are delivered
    to the host instead (and pin_memory=True cannot pin). Each path is timed
    over `batches` batches, or fewer once `max_seconds` have passed."""
    from torch.utils.data import DataLoader, RandomSampler

    gpu = fastpin.cuda_available() and torch.cuda.is_available()
    device = "cuda" if gpu else None
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(7)
        data = torch.randint(0, 256, (1024, 3, 224, 224), dtype=torch.uint8, generator=g).to(dtype)
        batch_bytes = batch_size * data[0].numel() * data.element_size()
        for nw in workers:
            def make():
                sampler = RandomSampler(_Images(data), replacement=True,
                                        num_samples=batch_size * (batches + 10), generator=g)
                return DataLoader(_Images(data), batch_size=batch_size, sampler=sampler,
                                  num_workers=nw, pin_memory=gpu, persistent_workers=False)

            def measure(loader, to_device):
                it = iter(loader)
                for _ in range(5):  # workers up, arena warm
                    x = next(it)[0]
                if gpu:
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                n = 0
                for x, _ in it:
                    if to_device:
                        x = x.to("cuda", non_blocking=True)
                    n += 1
                    if n == batches or _out_of_time(t0, n, max_seconds):
                        break
                if gpu:
                    torch.cuda.synchronize()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                del it
                timed.append(n)
                return n * batch_bytes / wall / 1e9, cpu / n * 1e3

            row = {"dtype": dtype_name, "workers": nw, "batch_mb": batch_bytes / MB}
            timed: list = []  # batches each path timed
            row["stock_gbps"], row["stock_cpu_ms"] = measure(make(), gpu)
            _progress(f"  {dtype_name} {_workers(nw)}: pin_memory={gpu} done")
            dl = make()
            dl.pin_memory = False
            capacity = max(1 << 30, capacity_for(dl, batch_bytes, depth=2))  # Loader's depth
            fastpin.configure(capacity=capacity)
            row["copy_gbps"], row["copy_cpu_ms"] = measure(fastpin.Loader(dl, device=device), False)
            _progress(f"  {dtype_name} {_workers(nw)}: fastpin.Loader done")
            dl = make()
            dl.pin_memory = False
            zc = fastpin.Loader(dl, device=device, zero_copy=True, capacity=capacity)
            row["zero_copy_gbps"], row["zero_copy_cpu_ms"] = measure(zc, False)
            row["zero_copy_fallbacks"] = zc.stats()["worker_fallbacks"]
            row["batches_timed"] = timed
            _progress(f"  {dtype_name} {_workers(nw)}: zero-copy done")
            del zc, dl
            rows.append(row)
    return {"gpu": gpu, "batches": batches, "batch_size": batch_size, "rows": rows,
            "max_seconds": max_seconds}


def _out_of_time(t0: float, n: int, max_seconds: Optional[float]) -> bool:
    """A path's time budget is spent (it always times a few batches first)."""
    return bool(max_seconds) and n >= _MIN_TIMED and time.perf_counter() - t0 >= max_seconds


_MIN_TIMED = 5  # batches a path times at least, whatever its time budget


def format_loader_table(result: dict) -> str:
    # With no GPU, torch cannot pin: the stock column ran DataLoader(pin_memory=False).
    stock = "pin_memory=True" if result["gpu"] else "pin_memory=False"
    where = ("to the GPU" if result["gpu"] else
             "to host batches (no GPU here: nothing is page-locked, and torch cannot pin, so "
             "the stock DataLoader ran with pin_memory=False)")
    budget = (f" (or fewer, once {result['max_seconds']:g} s had passed)"
              if result.get("max_seconds") else "")
    lines = [
        f"Delivered {where}, GB/s; main-process CPU ms per batch in brackets. "
        f"{result['batches']} batches{budget} of {result['batch_size']} images 3x224x224 "
        "per path, random sampling.",
        "",
        f"| dtype | workers | batch | {stock} | fastpin.Loader | fastpin.Loader(zero_copy) | "
        f"zero-copy / {stock} | worker fallbacks |",
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
        timed = ", ".join(f"{r['dtype']} {_workers(r['workers'])} {'/'.join(map(str, r['batches_timed']))}"
                          for r in result["rows"] if r.get("batches_timed"))
        lines += ["", f"Batches timed ({stock} / fastpin.Loader / zero-copy): {timed}."]
    return "\n".join(lines)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def format_pin_table(result: dict) -> str:
    n, fp = result["torch_threads"], result["fastpin_threads"]
    lines = [
        f"| batch | memcpy 1 thread | memcpy {n} threads (torch) | memcpy {fp} threads (pool) | "
        f"torch pin 1 thread | torch pin {n} threads | fastpin ({fp} threads) | "
        "fastpin / best memcpy | fastpin / torch pin 1 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t1 = r.get("torch_pin_1")
        best = max(r["memcpy_n"], r["memcpy_pool"])
        lines.append(
            f"| {r['size_mb']:g} MiB | {_fmt(r['memcpy_1'])} | {_fmt(r['memcpy_n'])} | "
            f"{_fmt(r['memcpy_pool'])} | {_fmt(t1)} | "
            f"{_fmt(r.get('torch_pin_n'))} | {_fmt(r['fastpin'])} | "
            f"{r['fastpin'] / best:.2f}x | "
            f"{'n/a' if t1 is None else format(r['fastpin'] / t1, '.2f') + 'x'} |")
    lines.append("")
    lines.append("GB/s, median of repeated calls on the same patterned batch.")
    if not result["gpu"]:
        lines.append("No GPU: nothing is page-locked here; torch cannot pin without an "
                     "accelerator, so its pin rows are n/a and fastpin copies into ordinary memory.")
    return "\n".join(lines)


# ---- progress ------------------------------------------------------------------

class _Progress:
    """A progress bar on stderr: tqdm where it is installed, else a plain counter
    (redrawn in place on a terminal, one line per stage elsewhere)."""

    def __init__(self, total: int, enabled: bool = True, desc: str = "fastpin.bench"):
        self.total, self.n, self.enabled, self.desc = total, 0, enabled, desc
        self.label = ""
        self.start = time.monotonic()
        self.bar = None
        self._last = 0.0
        self._tty = enabled and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        # A redrawn bar in a log (CI, a remote run's captured output) is noise:
        # tqdm only on a terminal or in Jupyter, one line per stage elsewhere.
        if enabled and (self._tty or "ipykernel" in sys.modules):
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr,
                                dynamic_ncols=True, leave=False)

    def stage(self, label: str) -> None:
        """A new stage begins (a case, a path)."""
        self.label = label
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=True)
        elif self._tty:
            self._draw(force=True)
        else:
            self._write(f"[{self.n}/{self.total}, {time.monotonic() - self.start:.0f} s] {label}")

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
        elif self._tty:
            self._draw()

    def skip(self, n: int) -> None:
        """Steps counted in the total that will not run."""
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def note(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            if self._tty:
                sys.stderr.write("\r\x1b[K")
            self._write(msg)
            if self._tty:
                self._draw(force=True)

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last > 0.1:
            self._last = now
            sys.stderr.write(f"\r\x1b[K{self.desc} {self.n}/{self.total} {self.label}")
            sys.stderr.flush()

    def _write(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self._tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


_reporter: Optional[_Progress] = None


def _progress(msg: str) -> None:
    """A stage of the micro tables done: a step of the progress bar."""
    if _reporter is not None:
        _reporter.note(msg)
        _reporter.update(1)


# ---- the paths -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PathInfo:
    name: str
    label: str
    what: str
    needs_cuda_target: bool   # delivers to the GPU only
    needs_gpu: bool           # needs a GPU even to deliver host batches
    fastpin: bool


PATHS = {p.name: p for p in [
    PathInfo("pageable", "pageable .to()",
             "DataLoader(pin_memory=False); batch.to(device, non_blocking=True)", False, False,
             False),
    PathInfo("pin_memory", "pin_memory=True",
             "DataLoader(pin_memory=True), torch's pin thread; batch.to(device, non_blocking=True)",
             False, True, False),
    PathInfo("prefetcher", "timm/Apex prefetcher",
             "DataLoader(pin_memory=True) under a side-stream prefetcher (timm PrefetchLoader, "
             "Apex data_prefetcher)", True, True, False),
    PathInfo("fastpin_pin", "fastpin.pin_memory",
             "DataLoader(pin_memory=False); fastpin.pin_memory(batch) in the loop; then .to()",
             False, False, True),
    PathInfo("loader_host", "Loader(device=None)",
             "fastpin.Loader(loader, device=None): pinned host batches; then .to()", False,
             False, True),
    PathInfo("loader_cuda", "Loader(device=cuda)",
             "fastpin.Loader(loader, device='cuda'): copied on a side stream", True, True, True),
    PathInfo("zero_copy", "Loader(zero_copy)",
             "fastpin.Loader(loader, zero_copy=True): workers collate into the shared pinned "
             "arena", False, False, True),
]}


def _gpu() -> tuple[bool, str]:
    """(a CUDA GPU is usable by fastpin and torch, why not)."""
    status = fastpin.cuda_status()
    if status.state != "ready":
        return False, status.reason
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no GPU (a CPU build?)"
    return True, ""


def _target(device: Any) -> tuple[Optional[torch.device], str]:
    """Where batches are delivered: a CUDA device, or None for the host; and,
    for the host, why (no GPU, or asked for)."""
    gpu, why = _gpu()
    if isinstance(device, str) and device in ("auto",):
        return (torch.device("cuda", torch.cuda.current_device()), "") if gpu else (None, why)
    if device is None or (isinstance(device, str) and device in ("host", "cpu")):
        return None, "the target is the host (device=None)"
    dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if dev.type != "cuda":
        raise ValueError(f"device must be 'auto', None/'host' or a CUDA device, not {device!r}")
    if not gpu:
        return None, why
    return (dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()),
            "")


def _why_not(path: str, target: Optional[torch.device], host_reason: str) -> Optional[str]:
    """Why `path` cannot run here, or None."""
    info = PATHS[path]
    gpu, why = _gpu()
    if info.needs_gpu and not gpu:
        return f"needs a GPU ({why})"
    if info.needs_cuda_target and target is None:
        return f"delivers to a GPU, and {host_reason}"
    return None


# ---- results ---------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    """One path's figures. status: 'ok', 'skipped' or 'failed' (reason says why)."""

    path: str
    status: str = "ok"
    reason: str = ""
    batches: int = 0                       # batches timed
    batch_mb: Optional[float] = None       # mean MiB of tensor data per timed batch
    gbps: Optional[float] = None           # delivered GB/s (1e9 bytes)
    step_ms: Optional[float] = None        # wall time per step, compute included
    cpu_ms: Optional[float] = None         # main-process CPU time per batch
    cpu_s_per_gb: Optional[float] = None   # CPU-seconds per GB delivered, the main
                                           # process and its worker processes together
    pinned_mb: Optional[float] = None      # page-locked memory held by the path, MiB
    pool_peak_mb: Optional[float] = None   # peak of it in use (fastpin's arenas only)
    first_batch_s: Optional[float] = None  # loader made -> first batch ready
    fallbacks: Optional[int] = None        # batches pinned the ordinary way (fastpin)

    @property
    def label(self) -> str:
        info = PATHS.get(self.path)
        return info.label if info else self.path

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _children_cpu(since: Optional[dict] = None):
    """CPU seconds of this process's live child processes (DataLoader workers):
    with `since` (an earlier call's result), the seconds they used after it, a
    child that started later counted from zero; without, {pid: seconds} now.
    Read from /proc; children that ended in between are not counted (their
    epoch outlives the timed window, so none of the workers' do)."""
    tick = os.sysconf("SC_CLK_TCK")
    now: dict = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0 if since is not None else now
    pids: set = set()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        now[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    if since is None:
        return now
    return sum(seconds - since.get(pid, 0.0) for pid, seconds in now.items())


def _grouped(rows: Iterable[Row], key: Callable[[Row], str] = lambda r: r.label) -> list:
    """[(status: reason, [keys of the rows with it])], in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(f"{r.status}: {r.reason}", []).append(key(r))
    return list(groups.items())


_METRICS = {
    "gbps": "delivered GB/s",
    "step_ms": "step ms",
    "cpu_ms": "main CPU ms/batch",
    "cpu_s_per_gb": "CPU s/GB (main + workers)",
    "first_batch_s": "first batch s",
    "pinned_mb": "pinned MiB held",
}


def _num(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


@dataclasses.dataclass
class Results:
    """What compare() measured: one Row per path, in the order asked for.

    table() / markdown() give a Markdown table (Jupyter shows it as one);
    to_dict() / to_json() the same as data; Results.from_dict() reads it back;
    fastpin.bench.plot() draws it."""

    rows: list
    name: str = "compare"
    title: str = ""
    device: str = "host"
    workers: Optional[int] = None
    batches: int = 0
    warmup: int = 0
    compute_ms: float = 0.0
    max_seconds: Optional[float] = None
    notes: list = dataclasses.field(default_factory=list)
    machine: dict = dataclasses.field(default_factory=dict)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __getitem__(self, path: str) -> Row:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(path)

    @property
    def ran(self) -> list:
        return [r for r in self.rows if r.ok]

    @property
    def not_run(self) -> list:
        return [r for r in self.rows if not r.ok]

    def baseline(self) -> Optional[Row]:
        """The row the others are compared with: pin_memory=True, else pageable."""
        for path in ("pin_memory", "pageable"):
            for row in self.rows:
                if row.path == path and row.ok and row.gbps:
                    return row
        return None

    def table(self) -> str:
        base = self.baseline()
        vs = f"x {base.label}" if base else "x baseline"
        lines = [
            f"| path | batches timed | GB/s | {vs} | step ms | main CPU ms/batch | "
            "CPU s/GB (main + workers) | pinned MiB held (peak used) | first batch s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.rows:
            if not r.ok:
                lines.append(f"| {r.label} | | {r.status} | | | | | | |")
                continue
            ratio = f"{r.gbps / base.gbps:.2f}x" if base and r.gbps is not None else "-"
            pinned = "-" if r.pinned_mb is None else f"{r.pinned_mb:.0f}"
            if r.pool_peak_mb is not None:
                pinned += f" ({r.pool_peak_mb:.0f})"
            few = " (too few)" if _too_few(r) else ""
            lines.append(
                f"| {r.label} | {r.batches}{few} | {_num(r.gbps)} | {ratio} | {_num(r.step_ms)} | "
                f"{_num(r.cpu_ms, 3)} | {_num(r.cpu_s_per_gb, 3)} | {pinned} | "
                f"{_num(r.first_batch_s, 3)} |")
        return "\n".join(lines)

    def header(self) -> str:
        mb = [r.batch_mb for r in self.rows if r.ok and r.batch_mb]
        size = f"{statistics.mean(mb):.1f} MiB batches, " if mb else ""
        workers = "" if self.workers is None else _workers(self.workers) + ", "
        # What the paths timed, never more: a loader that runs out times fewer.
        counts = sorted({r.batches for r in self.rows if r.ok})
        span = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}") if counts else "0"
        timed = f"{self.batches} timed" if counts in ([], [self.batches]) else \
            f"{span} timed (of {self.batches} asked for)"
        if self.max_seconds:
            timed = f"{span} timed (up to {self.batches}, or {self.max_seconds:g} s a path)"
        return (f"{size}{timed} after {self.warmup} warm-up, {workers}"
                f"compute {self.compute_ms:g} ms/step, delivered to {self.device}.")

    def markdown(self, heading: str = "##") -> str:
        parts = []
        if self.title or self.name:
            parts.append(f"{heading} {self.title or self.name}\n")
        parts.append(self.header() + "\n")
        parts.append(self.table())
        reasons = [f"- {', '.join(labels)}: {why}" for why, labels in _grouped(self.not_run)]
        fallbacks = [f"- {r.label}: {r.fallbacks} batches pinned the ordinary way (arena full)"
                     for r in self.rows if r.ok and r.fallbacks]
        short = [f"- {r.label}: {r.reason}" for r in self.rows if r.ok and r.reason]
        few = [f"- {_few_warning(r)}" for r in self.rows if _too_few(r)]
        if reasons or fallbacks or short or few or self.notes:
            parts.append("")
            parts.extend(reasons + fallbacks + short + few + [f"- {n}" for n in self.notes])
        return "\n".join(parts)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        return self.markdown()

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for row, r in zip(d["rows"], self.rows):
            row["label"] = r.label
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Results":
        names = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in d["rows"]]
        fields = {f.name for f in dataclasses.fields(cls)} - {"rows"}
        return cls(rows=rows, **{k: v for k, v in d.items() if k in fields})


# fastpin is on no package index: "pip install 'fastpin[plot]'" would ask one for
# a project of that name, not this one.
_MATPLOTLIB = ("pip install matplotlib (or, installing fastpin from its source, "
               "pip install '/path/to/fastpin[plot]')")

_FEW_TIMED = 10  # fewer batches than this, in under a second, measure start-up noise


def _too_few(row: Row) -> bool:
    """A path timed too few batches, too briefly, for its figures to mean much (two
    runs of 4 batches each of the same loader once gave 0.85x and 4.00x)."""
    return (row.ok and row.batches < _FEW_TIMED and row.step_ms is not None
            and row.batches * row.step_ms < 1e3)


def _few_warning(row: Row) -> str:
    return (f"warning: {row.label} timed only {row.batches} batches, in "
            f"{row.batches * row.step_ms:.0f} ms: too few for its figures to mean much; ask for "
            f"more batches (and a loader that yields at least 1 + warmup + batches)")


# ---- measuring one path ------------------------------------------------------------

def _to_device(batch: Any, device: torch.device) -> Any:
    return map_leaves(batch, lambda x: isinstance(x, torch.Tensor),
                      lambda x: x.to(device, non_blocking=True))


def _shutdown(it: Any) -> None:
    """End an iterator now: generators and fastpin epochs close, a DataLoader's
    worker processes stop (instead of whenever the garbage collector gets to it)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


class _SideStreamPrefetcher:
    """timm's PrefetchLoader / Apex's data_prefetcher for nested batches: copy batch
    N+1 on a side stream while batch N computes; the compute stream waits on the
    side stream before it takes the batch."""

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        stream = torch.cuda.Stream(self.device)
        it = iter(self.loader)
        try:
            first, current = True, None
            for batch in it:
                with torch.cuda.stream(stream):
                    nxt = _to_device(batch, self.device)
                if not first:
                    yield current
                else:
                    first = False
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_stream(stream)
                _record_stream(nxt, consumer)
                current = nxt
            if not first:
                yield current
        finally:
            _shutdown(it)


def _record_stream(batch: Any, stream: Any) -> None:
    map_leaves(batch, lambda x: isinstance(x, torch.Tensor) and x.is_cuda,
               lambda x: x.record_stream(stream))


def _plain(loader: Iterable, target: Optional[torch.device],
           pin: Optional[Callable[[Any], Any]] = None) -> Iterator:
    it = iter(loader)
    try:
        for batch in it:
            if pin is not None:
                batch = pin(batch)
            yield batch if target is None else _to_device(batch, target)
    finally:
        _shutdown(it)


_cycles_per_ms: dict = {}


def _gpu_compute(ms: float, device: torch.device) -> Callable[[Any], None]:
    """A kernel on the current stream that spins for `ms` (calibrated once)."""
    if device not in _cycles_per_ms:
        with torch.cuda.device(device):
            cycles = 10_000_000
            torch.cuda._sleep(cycles // 10)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _cycles_per_ms[device] = cycles / max(start.elapsed_time(end), 1e-3)
    n = max(1, int(ms * _cycles_per_ms[device]))
    return lambda batch: torch.cuda._sleep(n)


def _host_compute(ms: float) -> Callable[[Any], None]:
    return lambda batch: time.sleep(ms / 1e3)


def _torch_pinned(gpu: bool, reset: bool = False) -> Optional[int]:
    """Bytes torch's pinned-memory cache holds now; with reset, empty it first.
    The cache keeps every block it made until emptied, so at the end of a path
    this is what the path left page-locked (with any block an earlier path left
    that torch would not release). Its "peak" figures are sums of per-size-bucket
    peaks, not a peak of memory in use: not reported."""
    if not gpu:
        return 0
    try:
        if reset:
            empty = getattr(torch.accelerator, "empty_host_cache", None) or \
                getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):  # an older torch
        return None


def _settle(gpu: bool) -> None:
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _no_pin(loader: Any) -> Any:
    if isinstance(loader, torch.utils.data.DataLoader) and loader.pin_memory:
        loader.pin_memory = False  # the factory ignored pin_memory=False
    return loader


# The command line sets it: after this many seconds on one path, print every
# thread's stack to stderr (a path that hangs says where), then carry on waiting.
_hang_report_s: Optional[float] = None


class _HangWatch:
    """After _hang_report_s on one path, every thread's stack, named, to stderr.
    That report needs the GIL; should a call hold it while stuck, faulthandler's
    own thread dumps the stacks at twice the time without it."""

    def __init__(self, path: str, seconds: float):
        self.timer = threading.Timer(seconds, self.report, (path, seconds))
        self.timer.daemon = True
        self.timer.start()
        self.dumping = False
        try:
            faulthandler.dump_traceback_later(2 * seconds, file=sys.stderr)
            self.dumping = True
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            pass  # stderr with no file descriptor (captured): the timer alone

    @staticmethod
    def report(path: str, seconds: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = [f"fastpin.bench: {PATHS[path].label} has run for {seconds:g} s; "
                 "the stack of every thread follows\n"]
        for ident, frame in sys._current_frames().items():
            lines.append(f"-- thread {names.get(ident, ident)}\n")
            lines.extend(traceback.format_stack(frame))
        sys.stderr.write("".join(lines))
        sys.stderr.flush()

    def cancel(self) -> None:
        self.timer.cancel()
        if self.dumping:
            faulthandler.cancel_dump_traceback_later()


def _hang_watch(path: str) -> Optional[_HangWatch]:
    return _HangWatch(path, _hang_report_s) if _hang_report_s else None


def _run_path(path: str, factory: Callable[[bool], Iterable], *, target: Optional[torch.device],
              batches: int, warmup: int, step: Optional[Callable[[Any], Any]],
              capacity: int, depth: int, progress: _Progress,
              seen: Optional[dict] = None, max_seconds: Optional[float] = None) -> Row:
    gpu, _ = _gpu()
    row = Row(path)
    arena: Any = None
    floader: Any = None
    feed: Any = None
    fallbacks0 = fastpin.stats()["fallbacks"]
    # torch's own paths measure torch's pinning, even after fastpin.install().
    reinstall = path in ("pin_memory", "prefetcher") and fastpin.installed()
    if reinstall:
        fastpin.uninstall()
    _torch_pinned(gpu, reset=True)
    cuda = fastpin.cuda_available()
    dev_index = target.index if target is not None else 0
    consumer = torch.cuda.current_stream(target) if target is not None else None
    watch = _hang_watch(path)
    try:
        t0 = time.perf_counter()
        if path == "pageable":
            feed = _plain(_no_pin(factory(False)), target)
        elif path == "pin_memory":
            feed = _plain(factory(True), target)
        elif path == "prefetcher":
            feed = _plain(_SideStreamPrefetcher(factory(True), target), None)
        elif path == "fastpin_pin":
            arena = _C.Arena(capacity, device=dev_index, cuda=cuda)
            feed = _plain(_no_pin(factory(False)), target,
                          lambda b: fastpin.pin_memory(b, arena=arena, stream=consumer))
        elif path in ("loader_host", "loader_cuda"):
            arena = _C.Arena(capacity, device=dev_index, cuda=cuda)
            floader = fastpin.Loader(_no_pin(factory(False)),
                                     device=target if path == "loader_cuda" else None,
                                     depth=depth, arena=arena)
            feed = _plain(floader, target if path == "loader_host" else None)
        elif path == "zero_copy":
            loader = _no_pin(factory(False))
            if not isinstance(loader, torch.utils.data.DataLoader):
                row.status, row.reason = "skipped", (
                    f"needs a torch DataLoader (the factory made a {type(loader).__name__})")
                return row
            # Room for every batch the workers have in flight, or they fall back.
            batch_bytes = (seen or {}).get("batch_bytes", 0)
            need = -(-capacity_for(loader, batch_bytes, depth) // MB) * MB
            floader = fastpin.Loader(loader, device=target, depth=depth, zero_copy=True,
                                     capacity=max(capacity, need))
            if not floader.zero_copy:
                row.status, row.reason = "skipped", "the DataLoader's workers already run"
                return row
            arena = floader.arena
            feed = _plain(floader, None)
        else:
            raise ValueError(f"unknown path {path!r}")

        def sync():
            if consumer is not None:
                consumer.synchronize()

        def one() -> Any:
            batch = next(feed)
            if step is not None:
                step(batch)
            progress.update(1)
            return batch

        try:
            batch = one()
            sync()
            row.first_batch_s = time.perf_counter() - t0
            for _ in range(warmup):
                batch = one()
            del batch
        except StopIteration:
            row.status, row.reason = "failed", "the loader ran out during warm-up"
            return row
        sync()
        n = nbytes = 0
        t1, c1, w1 = time.perf_counter(), time.process_time(), _children_cpu()
        largest = 0
        for batch in feed:
            size = batch_nbytes(batch)
            nbytes += size
            largest = max(largest, size)
            if step is not None:
                step(batch)
            n += 1
            progress.update(1)
            if n == batches or _out_of_time(t1, n, max_seconds):
                break
        batch = None
        sync()
        wall, cpu = time.perf_counter() - t1, time.process_time() - c1
        workers_cpu = _children_cpu(w1)
        if n == 0:
            row.status, row.reason = "failed", "the loader ran out after the warm-up"
            return row
        if seen is not None:
            seen["batch_bytes"] = max(seen.get("batch_bytes", 0), largest)
        row.batches = n
        row.batch_mb = nbytes / n / MB
        row.gbps = nbytes / wall / 1e9
        row.step_ms = wall / n * 1e3
        row.cpu_ms = cpu / n * 1e3
        if nbytes:
            row.cpu_s_per_gb = (cpu + workers_cpu) / (nbytes / 1e9)
        if n < batches and not _out_of_time(t1, n, max_seconds):
            row.reason = f"the loader ran out after {n} of {batches} batches"
        if arena is None:   # torch's paths: its pinned cache, as the path left it
            held, used = _torch_pinned(gpu), None
        else:               # fastpin's: its page-locked arena (torch pinned nothing)
            held, used = (arena.capacity if arena.registered else 0), arena.stats()["high_water"]
        row.pinned_mb = None if held is None else held / MB
        row.pool_peak_mb = None if used is None else used / MB
        if PATHS[path].fastpin:
            row.fallbacks = fastpin.stats()["fallbacks"] - fallbacks0
            if floader is not None:
                st = floader.stats()
                row.fallbacks += st["fallbacks"]
        return row
    except Exception as exc:  # one path failing does not end the comparison
        log.debug("fastpin.bench: %s failed", path, exc_info=True)
        row = Row(path, status="failed", reason=f"{type(exc).__name__}: {exc}")
        return row
    finally:
        if watch is not None:
            watch.cancel()
        if feed is not None:
            feed.close()
        feed = floader = arena = None
        _settle(gpu)
        if reinstall:
            fastpin.install()


def compare(loader_factory: Callable[[bool], Iterable], *,
            paths: Optional[Sequence[str]] = None, batches: int = 50, warmup: int = 3,
            device: Any = "auto", compute_ms: float = 0.0,
            step: Optional[Callable[[Any], Any]] = None, capacity: Optional[int] = None,
            batch_bytes: Optional[int] = None, depth: int = 2, progress: bool = True,
            name: str = "compare", title: str = "",
            max_seconds: Optional[float] = None) -> Results:
    """Run your own DataLoader through every pinning path and measure each.

    loader_factory(pin_memory: bool) returns a fresh loader each call (a
        torch.utils.data.DataLoader, or any iterable of batches; zero_copy needs a
        DataLoader whose workers have not started). Every path iterates its own:
        pin_memory=True for torch's pinning paths, False for fastpin's. Make it
        yield the same batches each time (a seeded sampler) for a like-for-like run,
        and at least 1 + warmup + batches of them.
    paths: names from fastpin.bench.PATHS (default: all, in that order); those that
        cannot run here are kept as rows with status 'skipped' and the reason.
    batches / warmup: batches timed per path, after the first one and `warmup` more.
    max_seconds: a time budget per path: it stops timing once this much has passed
        (after at least 5 batches), so slow paths do not hold up a run. None: none.
    device: 'auto' (the current GPU, else the host), a CUDA device, or None/'host':
        where batches are delivered. Without a GPU the GPU paths are skipped.
    compute_ms: simulated compute per step: a GPU kernel that spins that long on the
        current stream (with no GPU: the main thread sleeps). 0: no compute.
    step: your own step, called with every delivered batch (instead of compute_ms).
    capacity: bytes of each fastpin arena (default: fastpin.configure's, 1 GiB).
        Zero-copy's shared arena gets at least room for the batches its workers
        have in flight (prefetch_factor x num_workers, plus depth + 6), sized by
        the largest batch the earlier paths saw, or by `batch_bytes` if given.
    depth: fastpin.Loader's batches prepared ahead.
    progress: a progress bar on stderr (tqdm where installed).

    Returns a Results: one Row per path with delivered GB/s, step ms, main-process
    CPU ms per batch, pinned MiB held and peak in use, seconds to the first batch.
    It changes no global setting (each fastpin path gets an arena of its own).
    """
    from ._arena import get_capacity

    paths = list(PATHS) if paths is None else list(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"unknown paths {unknown}; choose from {list(PATHS)}")
    if batches < 1 or warmup < 0:
        raise ValueError("batches must be at least 1 and warmup at least 0")
    target, host_reason = _target(device)
    if step is None and compute_ms > 0:
        step = _gpu_compute(compute_ms, target) if target is not None else _host_compute(compute_ms)
    capacity = int(capacity or get_capacity())
    seen = {"batch_bytes": int(batch_bytes or 0)}
    results = Results(rows=[], name=name, title=title, device=str(target or "host"),
                      batches=batches, warmup=warmup, compute_ms=compute_ms,
                      max_seconds=max_seconds, machine=machine())
    runnable = [p for p in paths if _why_not(p, target, host_reason) is None]
    bar = _reporter if _reporter is not None else _Progress(
        len(runnable) * (1 + warmup + batches), enabled=progress, desc=name)
    try:
        for path in paths:
            why = _why_not(path, target, host_reason)
            if why is not None:
                results.rows.append(Row(path, status="skipped", reason=why))
                continue
            bar.stage(f"{name}: {PATHS[path].label}")
            n0 = bar.n
            row = _run_path(path, loader_factory, target=target, batches=batches,
                            warmup=warmup, step=step, capacity=capacity, depth=depth,
                            progress=bar, seen=seen, max_seconds=max_seconds)
            bar.skip(max(0, (1 + warmup + batches) - (bar.n - n0)))
            if not row.ok:
                log.info("fastpin.bench: %s %s: %s", PATHS[path].label, row.status, row.reason)
                bar.note(f"  {name}: {PATHS[path].label} {row.status}: {row.reason}")
            elif row.reason or _too_few(row):
                bar.note(f"  {name}: " + (_few_warning(row) if _too_few(row) else
                                          f"{PATHS[path].label}: {row.reason}"))
            results.rows.append(row)
    finally:
        if bar is not _reporter:
            bar.close()
    return results


# ---- the workload cases ---------------------------------------------------------------

class _Tokens(_Dataset):
    """Token sequences of lo..hi int64 tokens, views of one flat tensor."""

    def __init__(self, n: int, lo: int, hi: int, seed: int = 11):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(lo, hi + 1, (n,), generator=g)
        self.flat = torch.randint(1, 50_000, (int(lengths.sum()),), dtype=torch.int64, generator=g)
        self.offsets = [0] + torch.cumsum(lengths, 0).tolist()

    def __len__(self):
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


def _pad_collate(samples):
    """Pad to the longest sequence of the batch, as language-model collators do."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Recsys(_Dataset):
    """Columnar features read a batch at a time (the sampler yields index lists):
    40 categorical ids, 9 dense embeddings of 16 floats, a label: 50 tensors."""

    SPARSE, DENSE = 40, 9

    def __init__(self, n: int, seed: int = 13):
        g = torch.Generator().manual_seed(seed)
        self.sparse = torch.randint(0, 1 << 24, (self.SPARSE, n), dtype=torch.int64, generator=g)
        self.dense = torch.randn(self.DENSE, n, 16, generator=g)
        self.label = torch.randint(0, 2, (n,), generator=g).float()

    def __len__(self):
        return self.label.numel()

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx)
        out = {f"cat_{k}": self.sparse[k, idx] for k in range(self.SPARSE)}
        out.update({f"dense_{k}": self.dense[k, idx] for k in range(self.DENSE)})
        out["label"] = self.label[idx]
        return out


class _Clips(_Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"video": self.data[i], "label": i}


def _images(dtype: torch.dtype, n: int) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(7)
    return _Images(torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g).to(dtype))


def _clips(n: int) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(17)
    return _Clips(torch.randint(0, 256, (n, 3, 32, 224, 224), dtype=torch.uint8,
                                generator=g).to(torch.float32))


@dataclasses.dataclass
class Workload:
    """A case of the suite: a dataset and how DataLoader batches it."""

    name: str
    title: str
    batch_size: int
    batch_bytes: int                      # the largest batch, bytes
    dataset_bytes: int
    make: Callable[[], Any]               # -> the dataset (allocates it)
    batches: tuple                        # timed batches: (with a GPU, without, --quick)
    collate: Optional[Callable] = None
    batched: bool = False                 # the dataset reads a list of indices at once

    def factory(self, dataset: Any, workers: int, n_batches: int, seed: int = 0):
        """loader_factory(pin_memory) for compare(): the same batches every call."""
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler

        def make(pin_memory: bool) -> DataLoader:
            g = torch.Generator().manual_seed(seed)
            sampler = RandomSampler(dataset, replacement=True,
                                    num_samples=self.batch_size * n_batches, generator=g)
            if self.batched:
                return DataLoader(dataset, sampler=BatchSampler(sampler, self.batch_size, True),
                                  batch_size=None, num_workers=workers, pin_memory=pin_memory)
            return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler,
                              collate_fn=self.collate, num_workers=workers,
                              pin_memory=pin_memory, drop_last=True)
        return make


_IMG = 3 * 224 * 224
_CLIP = 3 * 32 * 224 * 224 * 4
CASES: dict = {w.name: w for w in [
    Workload("images_u8", "uint8 images 3x224x224, batch 256", 256, 256 * (_IMG + 8), 1024 * _IMG,
             lambda: _images(torch.uint8, 1024), (300, 40, 4)),
    Workload("images_f32", "float32 images 3x224x224, batch 256", 256, 256 * (_IMG * 4 + 8),
             512 * _IMG * 4, lambda: _images(torch.float32, 512), (100, 16, 2)),
    Workload("tokens", "int64 token sequences of 2k-8k tokens, batch 8", 8, 8 * 8192 * 8 * 3,
             512 * 5120 * 8, lambda: _Tokens(512, 2048, 8192), (500, 60, 10),
             collate=_pad_collate),
    Workload("recsys", "recommendation batch: dict of 50 feature tensors, 4096 rows", 4096,
             4096 * (40 * 8 + 9 * 64 + 4), (1 << 16) * (40 * 8 + 9 * 64 + 4),
             lambda: _Recsys(1 << 16), (500, 60, 10), batched=True),
    Workload("video", "float32 video clips 3x32x224x224, batch 16", 16, 16 * (_CLIP + 8), 8 * _CLIP,
             lambda: _clips(8), (40, 8, 2)),
]}
MICRO = ("pin_sizes", "train_step", "loader_images", "train_model")
CASE_NAMES = MICRO + tuple(CASES)


def _available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, capped by the cgroup."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail if avail is not None else 1 << 62


def _shm_free() -> int:
    try:
        s = os.statvfs("/dev/shm")
        return s.f_bavail * s.f_frsize
    except OSError:
        return 1 << 62


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _arena_bytes(w: Workload, workers: int, depth: int) -> int:
    """An arena that holds every batch in flight: those the workers have ready
    (zero-copy), the Loader's queue, the consumer's, those the GPU still reads."""
    return max(256 * MB, -(-w.batch_bytes * (2 * workers + depth + 6) // MB) * MB)


def _copy_arena_bytes(w: Workload, depth: int) -> int:
    """The copy paths' arena: the Loader's queue, the consumer's batch, those the
    GPU still reads (zero-copy's grows by the workers' batches: compare())."""
    return max(256 * MB, -(-w.batch_bytes * (depth + 4) // MB) * MB)


def _case_room(w: Workload, workers: int, depth: int, target: Optional[torch.device]) -> Optional[str]:
    """Why this machine cannot hold the case, or None."""
    arena = _arena_bytes(w, workers, depth)
    need = w.dataset_bytes + arena + w.batch_bytes * (2 * workers + depth + 4)
    avail = _available_memory()
    if need > 0.85 * avail:
        return f"too little memory: needs about {_gb(need)}, {_gb(avail)} available"
    if workers:
        shm = w.batch_bytes * (2 * workers + 2)
        free = _shm_free()
        if shm > free:
            return (f"too little shared memory: DataLoader workers pass batches through /dev/shm, "
                    f"about {_gb(shm)} needed, {_gb(free)} free")
    if target is not None:
        free, _ = torch.cuda.mem_get_info(target)
        gneed = w.batch_bytes * (depth + 6)
        if gneed > 0.9 * free:
            return f"too little GPU memory: needs about {_gb(gneed)}, {_gb(free)} free"
    return None


def run_case(w: Workload, *, workers: int, batches: int, warmup: int, device: Any,
             compute_ms: float, paths: Optional[Sequence[str]], depth: int = 2,
             progress: bool = True, max_seconds: Optional[float] = None) -> Results:
    """One workload case through every path; the case is skipped (all rows, with
    the reason) when this machine has too little memory for it."""
    target, host_reason = _target(device)
    title = f"{w.title}, {_workers(workers)}"
    why = _case_room(w, workers, depth, target)
    if why is not None:
        rows = [Row(p, status="skipped", reason=why) for p in (paths or PATHS)]
        if _reporter is not None:
            runnable = [p for p in (paths or PATHS) if _why_not(p, target, host_reason) is None]
            _reporter.skip(len(runnable) * (1 + warmup + batches))
            _reporter.note(f"{w.name}: skipped: {why}")
        return Results(rows=rows, name=w.name, title=title, device=str(target or "host"),
                       workers=workers, batches=batches, warmup=warmup, compute_ms=compute_ms,
                       notes=[f"case skipped: {why}"])
    dataset = w.make()
    n_batches = 1 + warmup + batches + (2 * workers + depth + 4)
    try:
        res = compare(w.factory(dataset, workers, n_batches), paths=paths, batches=batches,
                      warmup=warmup, device=device, compute_ms=compute_ms,
                      capacity=_copy_arena_bytes(w, depth), batch_bytes=w.batch_bytes,
                      depth=depth, progress=progress, name=w.name, title=title,
                      max_seconds=max_seconds)
    finally:
        del dataset
        gc.collect()
    res.workers = workers
    return res


# ---- plotting -------------------------------------------------------------------------

_COLORS = ["#8c8c8c", "#1f77b4", "#17becf", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]


def _as_results(obj: Any) -> list:
    if isinstance(obj, Results):
        return [obj]
    if isinstance(obj, dict):
        if "cases" in obj:                       # a suite, as main() writes it
            return [Results.from_dict(c) for c in obj["cases"]]
        return [Results.from_dict(obj)]          # one Results.to_dict()
    return [r if isinstance(r, Results) else Results.from_dict(r) for r in obj]


def plot(results: Any, path: Optional[str] = None, *,
         metrics: Sequence[str] = ("gbps", "step_ms", "cpu_ms", "first_batch_s")):
    """Bar charts of Results (or a list of them, or the dict/JSON that
    Results.to_dict() or `python -m fastpin.bench --json` wrote): one row of panels
    per case, one panel per metric, one bar per path. Saves a PNG (or any format
    matplotlib knows by the suffix) to `path` when given; returns the
    matplotlib Figure. Needs matplotlib (pip install matplotlib)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"fastpin.bench.plot needs matplotlib: {_MATPLOTLIB}") from None
    groups = _as_results(results)
    if not groups:
        raise ValueError("nothing to plot")
    bad = [m for m in metrics if m not in _METRICS]
    if bad:
        raise ValueError(f"unknown metrics {bad}; choose from {list(_METRICS)}")
    order = list(PATHS)
    colors = {p: _COLORS[i % len(_COLORS)] for i, p in enumerate(order)}
    most = max(len(g.rows) for g in groups)
    fig = Figure(figsize=(3.6 * len(metrics) + 1.6, (0.32 * most + 0.9) * len(groups) + 0.6),
                 layout="constrained")
    axes = fig.subplots(len(groups), len(metrics), squeeze=False)
    for r, res in enumerate(groups):
        rows = res.rows
        ys = list(range(len(rows)))
        for c, metric in enumerate(metrics):
            ax = axes[r][c]
            values = [getattr(row, metric) if row.ok and getattr(row, metric) is not None else 0.0
                      for row in rows]
            ax.barh(ys, values, color=[colors.get(row.path, "#444444") for row in rows])
            ax.set_yticks(ys, [row.label for row in rows] if c == 0 else [""] * len(rows))
            ax.invert_yaxis()
            ax.tick_params(axis="both", labelsize=8)
            top = max(values) if values and max(values) > 0 else 1.0
            ax.set_xlim(0, top * 1.3)
            for y, row, v in zip(ys, rows, values):
                text = _num(getattr(row, metric), 3 if metric == "cpu_ms" else 2) if row.ok \
                    else row.status
                ax.text(v + top * 0.02, y, text, va="center", fontsize=7,
                        color="black" if row.ok else "#999999")
            if r == 0:
                ax.set_title(_METRICS[metric], fontsize=10)
            if c == 0:
                ax.set_ylabel(res.name if res.workers is None
                              else f"{res.name}\n{_workers(res.workers)}", fontsize=9)
    where = sorted({g.device for g in groups})
    fig.suptitle(f"fastpin.bench, delivered to {', '.join(where)}", fontsize=11)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ---- the command line ---------------------------------------------------------------

def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastpin": fastpin.__version__,
        "cpus": _C.cpu_count(),
        "memory_available_gb": round(_available_memory() / 1e9, 1),
        "cuda": fastpin.cuda_status()._asdict(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# What each micro case measures (python -m fastpin.bench --list).
_MICRO_WHAT = {
    "pin_sizes": "pin_memory of one batch of 64 KiB, 256 KiB, 1, 16, 256 MiB (--sizes): "
                 "the machine's memcpy rates, torch's pinning with 1 and N threads, fastpin.pin_memory",
    "train_step": "a training step with compute C and transfer T (C < T, C > T): stock .to(), "
                  "the timm/Apex prefetcher, fastpin.Loader (GPU only)",
    "loader_images": "DataLoader delivered GB/s over uint8 and float32 images, batch 256: "
                     "pin_memory=True, fastpin.Loader, fastpin.Loader(zero_copy=True)",
}

_SECTION = {
    "pin_sizes": ("pin_memory", "pin_memory of one batch", format_pin_table),
    "train_step": ("step", "Training step: compute overlapped with transfer", format_step_table),
    "loader_images": ("loader", "DataLoader: delivered throughput", format_loader_table),
    "train_model": ("train", "Training resnet18: images/s against the batch already on the GPU",
                    lambda r: __import__("fastpin.bench_train").bench_train.format_train_table(r)),
}


def report(suite: dict) -> str:
    """The whole suite (as main() runs it, or as its --json wrote it) as Markdown."""
    parts = [_header(suite["machine"], suite.get("command"))]
    for name in suite.get("order", []):
        parts.append(_section(suite, name))
    parts.append(_not_run(suite))
    return "\n\n".join(p for p in parts if p)


def _header(info: dict, command: Optional[str] = None) -> str:
    lines = [f"fastpin {info['fastpin']}, torch {info['torch']}, Python {info['python']}, "
             f"{info['cpus']} CPUs, GPU: {info.get('gpu', 'none')}"]
    if command:
        lines.append(f"`{command}`, {info.get('date', '')}".rstrip(", "))
    if info["cuda"]["state"] != "ready":
        lines.append(f"No GPU path: {info['cuda']['reason']}")
    return "\n".join(lines)


def _section(suite: dict, name: str) -> str:
    if name in _SECTION:
        key, title, fmt = _SECTION[name]
        if key in suite:
            return f"## {title}\n\n{fmt(suite[key])}"
        why = suite.get("not_run_cases", {}).get(name, "not run")
        return f"## {title}\n\n{why}"
    parts = [Results.from_dict(c).markdown() for c in suite["cases"] if c["name"] == name]
    if not parts:
        why = suite.get("not_run_cases", {}).get(name, "not run")
        return f"## {CASES[name].title}\n\n{why}" if name in CASES else ""
    return "\n\n".join(parts)


def _not_run(suite: dict) -> str:
    lines = [f"- {name}: {why}" for name, why in suite.get("not_run_cases", {}).items()]
    rows = []
    for c in suite.get("cases", []):
        res = Results.from_dict(c)
        rows += [(res, r) for r in res.not_run]
    groups: dict = {}
    for res, r in rows:
        groups.setdefault(f"{r.status}: {r.reason}", {}).setdefault(r.label, []).append(res.name)
    for why, paths in groups.items():
        where = "; ".join(f"{label} ({', '.join(dict.fromkeys(cases))})"
                          for label, cases in paths.items())
        lines.append(f"- {why}: {where}")
    if not lines:
        return ""
    return "## Not run\n\n" + "\n".join(lines)


def _failed(suite: dict) -> bool:
    if suite.get("failed_cases"):
        return True
    return any(r["status"] == "failed" for c in suite.get("cases", []) for r in c["rows"])


def _micro_room(name: str, sizes: Sequence[float], workers: Sequence[int]) -> Optional[str]:
    avail = _available_memory()
    if name == "pin_sizes":
        need = 4 * max(sizes) * MB + max(1 << 30, 3 * max(sizes) * MB)
    elif name == "train_step":
        need = 6 * 256 * MB
    else:
        batch = 256 * _IMG * 4
        need = 1024 * _IMG * 5 + max(1 << 30, batch * (2 * max(workers) + 8)) \
            + batch * (2 * max(workers) + 4)
    if need > 0.85 * avail:
        return f"skipped: too little memory: needs about {_gb(need)}, {_gb(avail)} available"
    return None


def _save(suite: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(suite, f, indent=2)
    os.replace(tmp, path)


def _device_arg(text: str) -> str:
    """--device: auto, host (or cpu), cuda or cuda:N; anything else is a usage error."""
    kind, _, index = text.partition(":")
    if text in ("auto", "host", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a device: use auto (the GPU if any, else the host), host, cuda or "
        "cuda:N")


def _parser() -> argparse.ArgumentParser:
    """The command line's options (main() and the README's list of them)."""
    parser = argparse.ArgumentParser(prog="python -m fastpin.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=CASE_NAMES + ("all",),
                        help="a case to run (repeatable; default: all)")
    parser.add_argument("--path", action="append", choices=tuple(PATHS),
                        help="a path to run in the workload cases (repeatable; default: all)")
    parser.add_argument("--workers", type=int, nargs="+",
                        help="DataLoader workers (default: one per core but one for the workload "
                             "cases; 8 and one per core but one for loader_images)")
    parser.add_argument("--batches", type=int,
                        help="batches timed per path (default: each case's own, fewer without "
                             "a GPU; loader_images: 300, or 10 without a GPU)")
    parser.add_argument("--warmup", type=int, help="batches before timing starts (default: 3)")
    parser.add_argument("--max-seconds", type=float, default=3.0,
                        help="time budget of each path: it stops timing after this many "
                             "seconds (at least 5 batches) even short of --batches, so the "
                             "whole suite fits in a few minutes (default: 3; 0: no budget)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="simulated compute per step in the workload cases, ms (default: 0)")
    parser.add_argument("--device", default="auto", type=_device_arg,
                        help="where batches go: auto (the GPU if any, else the host), host, "
                             "cuda, cuda:N (an error where there is no such GPU)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: a few batches per path, smaller micro tables")
    parser.add_argument("--sizes", type=float, nargs="+",
                        help="pin_sizes: batch sizes in MiB (default: 0.0625 0.25 1 16 256)")
    parser.add_argument("--seconds", type=float,
                        help="pin_sizes: least time spent timing each cell (default: 0.5)")
    parser.add_argument("--hang-report", type=float, default=300.0, metavar="SECONDS",
                        help="a workload path still running after this long prints every "
                             "thread's stack to stderr (and again, from faulthandler, at twice "
                             "the time), then goes on (default: 300; 0: never)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the workload cases (PNG; needs matplotlib: "
                             "pip install matplotlib)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="measure nothing: print (and --plot) a run that --json wrote")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--list", action="store_true",
                        help="list the cases and paths, each with what it measures")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    def out(text: str = "") -> None:
        if _reporter is not None and _reporter.bar is not None:
            _reporter.bar.clear()
        elif _reporter is not None and _reporter._tty:
            sys.stderr.write("\r\x1b[K")
        print(text, flush=True)
        if _reporter is not None and _reporter.bar is not None:
            _reporter.bar.refresh()

    if args.list:
        out("cases:")
        for name in MICRO:
            out(f"  {name:14s}{_MICRO_WHAT.get(name) or _SECTION.get(name, ('', name))[1]}")
        for w in CASES.values():
            out(f"  {w.name:14s}{w.title} ({w.batch_bytes / MB:.3g} MiB a batch): every path")
        out("paths:")
        for p in PATHS.values():
            out(f"  {p.name:14s}{p.what}")
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot needs matplotlib: {_MATPLOTLIB}")
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        out(report(saved))
        if args.plot:
            plot(saved, args.plot)
            out(f"\nPlot: {args.plot}")
        return 0
    if torch is None:
        print(f"python -m fastpin.bench: {_torch.message('the benchmark')}", file=sys.stderr)
        return 1
    if args.device.startswith("cuda"):
        gpu, why = _gpu()
        if not gpu:
            parser.error(f"--device {args.device}: no GPU to deliver to here ({why}); use "
                         "--device auto (the GPU if any, else the host) or --device host")
        if ":" in args.device and int(args.device.partition(":")[2]) >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")

    global _hang_report_s
    _hang_report_s = args.hang_report or None
    gpu, _ = _gpu()
    cpus = _C.cpu_count()
    names = list(CASE_NAMES) if not args.case or "all" in args.case else \
        [n for n in CASE_NAMES if n in args.case]
    quick = args.quick
    sizes = args.sizes or ([0.0625, 1, 16] if quick else [0.0625, 0.25, 1, 16, 256])
    seconds = args.seconds if args.seconds is not None else (0.1 if quick else 0.5)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    workers = args.workers or [max(1, cpus - 1)]
    lt_workers = args.workers or sorted({min(8, max(1, cpus - 1)), max(1, cpus - 1)})
    lt_batches = args.batches or (3 if quick else 300 if gpu else 10)
    target, host_reason = _target(args.device)
    paths = args.path or list(PATHS)

    def case_batches(w: Workload) -> int:
        return args.batches or w.batches[2 if quick else 0 if gpu else 1]

    total = 0
    for name in names:
        if name == "pin_sizes":
            total += len(sizes)
        elif name == "train_step":
            total += 2 if gpu else 0
        elif name == "loader_images":
            total += 3 * 2 * len(lt_workers)
        elif name == "train_model":
            pass  # fastpin.bench_train reports no progress steps
        else:
            runnable = [p for p in paths if _why_not(p, target, host_reason) is None]
            total += len(workers) * len(runnable) * (1 + warmup + case_batches(CASES[name]))

    global _reporter
    _reporter = _Progress(total, enabled=not args.no_progress)
    suite: dict = {
        "command": "python -m fastpin.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "settings": {"cases": names, "paths": paths, "workers": workers, "warmup": warmup,
                     "compute_ms": args.compute_ms, "device": str(target or "host"),
                     "max_seconds": args.max_seconds,
                     "quick": quick},
        "order": names, "cases": [], "not_run_cases": {}, "failed_cases": {},
    }
    out(_header(suite["machine"], suite["command"]))
    try:
        for name in names:
            _reporter.stage(name)
            try:
                if name in MICRO:
                    key = _SECTION[name][0]
                    why = _micro_room(name, sizes, lt_workers)
                    if name == "train_step" and not gpu:
                        why = f"skipped: needs a GPU ({_gpu()[1]})"
                    if name == "train_model":
                        from . import bench_train
                        why = bench_train.why_not() or why
                    if why is not None:
                        suite["not_run_cases"][name] = why
                    elif name == "pin_sizes":
                        suite[key] = pin_table(sizes, min_seconds=seconds)
                    elif name == "train_step":
                        suite[key] = (step_table(batch_mb=64, steps=10) if quick
                                      else step_table())
                    elif name == "train_model":
                        suite[key] = bench_train.train_table(
                            workers=args.workers or sorted({min(8, max(1, cpus - 1)),
                                                            min(15, max(1, cpus - 1))}),
                            steps=5 if quick else 50, warmup=2 if quick else 5)
                    else:
                        suite[key] = loader_table(workers=lt_workers, batches=lt_batches,
                                                  max_seconds=args.max_seconds)
                else:
                    for nw in workers:
                        res = run_case(CASES[name], workers=nw, batches=case_batches(CASES[name]),
                                       warmup=warmup, device=args.device,
                                       compute_ms=args.compute_ms, paths=paths,
                                       max_seconds=args.max_seconds)
                        suite["cases"].append(res.to_dict())
            except Exception as exc:  # a case that breaks does not end the suite
                log.debug("fastpin.bench: case %s failed", name, exc_info=True)
                suite["not_run_cases"][name] = f"failed: {type(exc).__name__}: {exc}"
                suite["failed_cases"][name] = f"{type(exc).__name__}: {exc}"
            out()
            out(_section(suite, name))
            if args.json:  # after every case: a run cut short keeps what it measured
                _save(suite, args.json)
    finally:
        _reporter.close()
        _reporter = None
        _hang_report_s = None
    summary = _not_run(suite)
    if summary:
        out()
        out(summary)
    if args.json:
        _save(suite, args.json)
    if args.plot:
        if suite["cases"]:
            plot(suite, args.plot)
            out(f"\nPlot: {args.plot}")
        else:
            out("\nNo plot: no workload case ran.")
    return 1 if _failed(suite) else 0


if __name__ == "__main__":
    sys.exit(main())
