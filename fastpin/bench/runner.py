"""Measuring: compare() runs a loader factory through each path of the
registry (run_path: set up, warm up, time, read the figures, tear down) and
gathers one Row per path into a Results."""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import fastpin
from fastpin._walk import nbytes as batch_nbytes

from ._optional import torch
from .host import MB, machine
from .paths import PATHS, PathRun, PathSkipped, gpu_usable, target_of, why_not
from .procfs import children_cpu
from .progress import Progress, reporter_for
from .results import MIN_SECONDS, MIN_TIMED, Results, Row, few_warning, too_few

log = logging.getLogger("fastpin.bench")


def enough(n: int, elapsed: float, batches: int, min_seconds: float,
           max_seconds: Optional[float]) -> bool:
    """Timing may stop: `batches` batches and `min_seconds` timed; or, past a time
    budget (max_seconds), the fewest that still mean something."""
    if n >= batches and elapsed >= min_seconds:
        return True
    return (bool(max_seconds) and elapsed >= max(max_seconds, min_seconds)
            and n >= min(batches, MIN_TIMED))


def warmup_for(run: PathRun, warmup: int) -> int:
    """Untimed batches after the first: `warmup`, and at least every batch the
    path's source holds ahead of it (a batch the workers made while the loop
    waited for the first comes at once, not at the rate they make them)."""
    return max(warmup, run.prefetched())


_cycles_per_ms: dict = {}


def gpu_compute(ms: float, device: torch.device) -> Callable[[Any], None]:
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


def host_compute(ms: float) -> Callable[[Any], None]:
    return lambda batch: time.sleep(ms / 1e3)


def torch_pinned(gpu: bool, reset: bool = False) -> Optional[int]:
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


def settle(gpu: bool) -> None:
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- one path ------------------------------------------------------------------------

class _RanOut(Exception):
    """The loader ran out before anything was timed; the message says when."""


@dataclasses.dataclass
class _Timed:
    """What the timed batches of one path came to."""

    n: int
    nbytes: int
    largest: int
    wall: float
    cpu: float           # this process
    workers_cpu: float   # its child processes
    ran_out: bool        # the loader ended before enough() was


def _sync(run: PathRun) -> None:
    if run.consumer is not None:
        run.consumer.synchronize()


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def _warm_up(row: Row, feed: Any, run: PathRun, step: Optional[Callable], warmup: int,
             batches: int, reporter: Progress, t0: float) -> None:
    """The first batch (row.first_batch_s: seconds from t0) and row.warmup more
    (warmup_for: what the source prefetched, at least `warmup`), untimed."""
    got = 0

    def one() -> Any:
        batch = next(feed)
        if step is not None:
            step(batch)
        if got <= warmup:  # the progress total counts 1 + warmup (the rest is extra)
            reporter.update(1)
        return batch

    try:
        batch = one()
        got = 1
        _sync(run)
        row.first_batch_s = time.perf_counter() - t0
        # Known once the source is made and started: its workers and depth.
        row.warmup = warmup_for(run, warmup)
        for _ in range(row.warmup):
            batch = one()
            got += 1
        del batch
    except StopIteration:
        need = f"1 + {row.warmup if got else warmup}"
        total = 1 + (row.warmup if got else warmup) + batches
        raise _RanOut(f"the loader ran out during warm-up: it gave {_batches(got)}; the path "
                      f"needs {need} untimed and at least {batches} timed ({total} in all)"
                      ) from None
    _sync(run)


def _time_batches(row: Row, feed: Any, run: PathRun, step: Optional[Callable], batches: int,
                  min_seconds: float, max_seconds: Optional[float],
                  reporter: Progress) -> _Timed:
    """Batches until enough() (or the loader's end), timed from the end of the warm-up."""
    n = nbytes = largest = 0
    ran_out = True
    t1, c1, w1 = time.perf_counter(), time.process_time(), children_cpu()
    for batch in feed:
        size = batch_nbytes(batch)
        nbytes += size
        largest = max(largest, size)
        if step is not None:
            step(batch)
        n += 1
        if n <= batches:
            reporter.update(1)
        if enough(n, time.perf_counter() - t1, batches, min_seconds, max_seconds):
            ran_out = False
            break
    batch = None  # noqa: F841 - the last batch is not held while the stream drains
    _sync(run)
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    if n == 0:
        raise _RanOut(f"the loader ran out after the warm-up: it gave "
                      f"{_batches(1 + row.warmup)}; the path needs 1 + {row.warmup} untimed and "
                      f"at least {batches} timed ({1 + row.warmup + batches} in all)")
    return _Timed(n, nbytes, largest, wall, cpu, children_cpu(w1), ran_out)


def _figures(row: Row, t: _Timed, batches: int) -> None:
    row.batches = t.n
    row.batch_mb = t.nbytes / t.n / MB
    row.gbps = t.nbytes / t.wall / 1e9
    row.step_ms = t.wall / t.n * 1e3
    row.cpu_ms = t.cpu / t.n * 1e3
    if t.nbytes:
        row.cpu_s_per_gb = (t.cpu + t.workers_cpu) / (t.nbytes / 1e9)
    if t.ran_out and t.n < batches:
        row.reason = f"the loader ran out after {t.n} of {batches} batches"


def _memory(row: Row, run: PathRun, gpu: bool, fallbacks0: int) -> None:
    """Pinned memory held and peak used; for fastpin's paths, the fallbacks."""
    arena = run.arena
    if run.loader is not None and run.loader.zero_copy:
        # Zero-copy: its shared arena, every segment (a self-sizing one has
        # none until the first batch, so run.arena may be None).
        s = run.loader.stats()
        held = s["pool_capacity"] if fastpin.cuda_available() else 0
        used = s["pool_high_water"]
    elif run.pool is not None:  # install(): the pool its DataLoader's workers write into
        s = run.pool.stats() or {}
        held = s.get("capacity", 0) if fastpin.cuda_available() else 0
        used = s.get("high_water", 0)
    elif arena is None:   # torch's paths: its pinned cache, as the path left it
        held, used = torch_pinned(gpu), None
    else:                 # fastpin's: its page-locked arena (torch pinned nothing)
        held, used = (arena.capacity if arena.registered else 0), arena.stats()["high_water"]
    row.pinned_mb = None if held is None else held / MB
    row.pool_peak_mb = None if used is None else used / MB
    if PATHS[row.path].fastpin:
        row.fallbacks = fastpin.stats()["fallbacks"] - fallbacks0
        if run.loader is not None:
            row.fallbacks += run.loader.stats()["fallbacks"]
        if run.pool is not None:   # its workers' (the main process's own are above)
            row.fallbacks += (run.pool.stats() or {}).get("fallbacks", 0)


def run_path(path: str, run: PathRun, *, batches: int, warmup: int,
             step: Optional[Callable[[Any], Any]], reporter: Progress,
             min_seconds: float = MIN_SECONDS, max_seconds: Optional[float] = None) -> Row:
    """One path over a fresh loader: its Row, 'failed' or 'skipped' with the
    reason where it could not be measured (one path failing ends no others)."""
    info = PATHS[path]
    gpu, _ = gpu_usable()
    fallbacks0 = fastpin.stats()["fallbacks"]
    # torch's own paths measure torch's pinning, even after fastpin.install().
    reinstall = info.torch_pinning and fastpin.installed()
    if reinstall:
        fastpin.uninstall()
    torch_pinned(gpu, reset=True)
    watch = reporter.hang_watch(info.label)
    feed: Any = None
    row = Row(path)
    try:
        t0 = time.perf_counter()
        feed = info.make(run)
        _warm_up(row, feed, run, step, warmup, batches, reporter, t0)
        timed = _time_batches(row, feed, run, step, batches, min_seconds, max_seconds, reporter)
        run.batch_bytes = max(run.batch_bytes, timed.largest)
        _figures(row, timed, batches)
        _memory(row, run, gpu, fallbacks0)
        return row
    except PathSkipped as exc:
        return Row(path, status="skipped", reason=str(exc))
    except _RanOut as exc:
        row.status, row.reason = "failed", str(exc)
        return row
    except Exception as exc:  # one path failing does not end the comparison
        log.debug("fastpin.bench: %s failed", path, exc_info=True)
        return Row(path, status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        if watch is not None:
            watch.cancel()
        if feed is not None:
            feed.close()
        feed = run.loader = run.arena = run.pool = None
        settle(gpu)
        if reinstall:
            fastpin.install()


# ---- every path ----------------------------------------------------------------------

def compare(loader_factory: Callable[[bool], Iterable], *,
            paths: Optional[Sequence[str]] = None, batches: int = 50, warmup: int = 3,
            device: Any = "auto", compute_ms: float = 0.0,
            step: Optional[Callable[[Any], Any]] = None, capacity: Optional[int] = None,
            batch_bytes: Optional[int] = None, depth: int = 2, progress: Any = True,
            name: str = "compare", title: str = "",
            max_seconds: Optional[float] = None, min_seconds: float = MIN_SECONDS,
            rounds: int = 1) -> Results:
    """Run your own DataLoader through every pinning path and measure each.

    loader_factory(pin_memory: bool) returns a fresh loader each call (a
        torch.utils.data.DataLoader, or any iterable of batches; zero_copy needs a
        DataLoader whose workers have not started). Every path iterates its own:
        pin_memory=True for torch's pinning paths, False for fastpin's. Make it
        yield the same batches each time (a seeded sampler) for a like-for-like run,
        and enough of them (a sampler with replacement and a large num_samples
        never runs out: each path takes only what it needs).
    paths: names from fastpin.bench.PATHS (default: all, in that order); those that
        cannot run here (no GPU, or a host target) are kept as rows with status
        'skipped', the reason and unavailable=True; the tables leave them out.
    warmup: untimed batches after the first: at least this many, and at least every
        batch the path's source makes ahead (each DataLoader's num_workers x
        prefetch_factor, plus `depth`): a batch made while the loop waited for the
        first comes at once, and timing it would time the burst, not the steady state.
    batches / min_seconds: then each path times at least `batches` batches and at
        least `min_seconds` seconds (a row with fewer than 20 batches or under a
        second is marked "too few": its figures mean little).
    max_seconds: a time budget per path: it stops timing once this much has passed,
        even short of `batches` (never short of 20 batches or min_seconds), so slow
        paths do not hold up a run. None: none.
    device: 'auto' (the current GPU, else the host), a CUDA device, or None/'host':
        where batches are delivered. Without a GPU the GPU paths are skipped.
    compute_ms: simulated compute per step: a GPU kernel that spins that long on the
        current stream (with no GPU: the main thread sleeps). 0: no compute.
    step: your own step, called with every delivered batch (instead of compute_ms).
    capacity: bytes of each fastpin arena (default: fastpin.configure's; unset, each
        path's arena sizes itself as fastpin's default arena and zero-copy's do).
        Given, zero-copy's shared arena gets at least room for the batches its
        workers have in flight (prefetch_factor x num_workers, plus depth + 6),
        sized by the largest batch the earlier paths saw, or by `batch_bytes`.
    depth: fastpin.Loader's batches prepared ahead.
    progress: a progress bar on stderr (tqdm where installed); or a
        fastpin.bench.progress.Progress to report to (one bar over many runs).
    rounds: each path is run this many times, the paths taking turns (so a machine
        that drifts moves them alike); a path's row is its run of the median GB/s
        (the lower of the two middle ones for an even count), with every run's
        GB/s in Row.rounds_gbps. A path that fails in any round fails.

    Returns a Results: one Row per path with delivered GB/s, step ms, main-process
    CPU ms per batch, pinned MiB held and peak in use, seconds to the first batch.
    It changes no global setting (each fastpin path gets an arena of its own).
    """
    from fastpin._arena import get_capacity

    paths = _checked_paths(paths, batches, warmup, min_seconds, rounds)
    target, host_reason = target_of(device)
    if step is None and compute_ms > 0:
        step = gpu_compute(compute_ms, target) if target is not None else host_compute(compute_ms)
    results = Results(rows=[], name=name, title=title, device=str(target or "host"),
                      batches=batches, warmup=warmup, compute_ms=compute_ms,
                      max_seconds=max_seconds, min_seconds=min_seconds, machine=machine(),
                      rounds=rounds)
    runnable = [p for p in paths if why_not(p, target, host_reason) is None]
    reporter, own = reporter_for(progress, rounds * len(runnable) * (1 + warmup + batches), name)
    capacity = capacity or get_capacity()   # None: each path's arena sizes itself

    def make_run(seen: int) -> PathRun:
        return PathRun(loader_factory, target, depth=depth, capacity=capacity, batch_bytes=seen)
    try:
        runs = _rounds(runnable, make_run, int(batch_bytes or 0), results, step, reporter)
    finally:
        if own:
            reporter.close()
    for path in paths:
        why = why_not(path, target, host_reason)
        if why is not None:
            results.rows.append(Row(path, status="skipped", reason=why, unavailable=True))
        else:
            results.rows.append(_median_run(runs[path]))
    return results


def _rounds(paths: list, make_run: Callable[[int], PathRun], seen: int, results: Results,
            step: Optional[Callable], reporter: Progress) -> dict:
    """{path: [Row of each round]}: results.rounds rounds, the paths in turn,
    each run made by make_run(seen): the largest batch seen so far (at first
    the batch_bytes given), which sizes zero-copy's shared arena."""
    runs: dict = {path: [] for path in paths}
    for _ in range(results.rounds):
        for path in paths:
            run = make_run(seen)
            runs[path].append(_measured(path, run, results, step, reporter))
            seen = run.batch_bytes
    return runs


def _median_run(rows: list) -> Row:
    """One path's row from its rounds: the first that did not succeed, else the
    run of the median GB/s (the lower middle one of an even count), every
    round's GB/s in rounds_gbps where there were several."""
    failed = [r for r in rows if not r.ok]
    if failed or len(rows) == 1:
        return (failed or rows)[0]
    ranked = sorted(rows, key=lambda r: r.gbps if r.gbps is not None else float("-inf"))
    row = ranked[(len(ranked) - 1) // 2]
    row.rounds_gbps = [r.gbps for r in rows]
    return row


def _checked_paths(paths: Optional[Sequence[str]], batches: int, warmup: int,
                   min_seconds: float, rounds: int = 1) -> list:
    """compare()'s paths (default: all, in PATHS's order), once its arguments
    are checked; ValueError names what is wrong before any path runs."""
    paths = list(PATHS) if paths is None else list(paths)
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"unknown paths {unknown}; choose from {list(PATHS)}")
    if batches < 1 or warmup < 0:
        raise ValueError("batches must be at least 1 and warmup at least 0")
    if not min_seconds >= 0 or min_seconds == float("inf"):
        raise ValueError(f"min_seconds must be a finite number of seconds >= 0, not "
                         f"{min_seconds!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1, not {rounds!r}")
    return paths


def _measured(path: str, run: PathRun, results: Results, step: Optional[Callable],
              reporter: Progress) -> Row:
    """run_path() under a stage of the reporter, which notes what went wrong."""
    name, label = results.name, PATHS[path].label
    reporter.stage(f"{name}: {label}")
    n0 = reporter.n
    row = run_path(path, run, batches=results.batches, warmup=results.warmup, step=step,
                   reporter=reporter, min_seconds=results.min_seconds,
                   max_seconds=results.max_seconds)
    reporter.skip(max(0, (1 + results.warmup + results.batches) - (reporter.n - n0)))
    if not row.ok:
        log.info("fastpin.bench: %s %s: %s", label, row.status, row.reason)
        reporter.note(f"  {name}: {label} {row.status}: {row.reason}")
    elif row.reason or too_few(row):
        reporter.note(f"  {name}: " + (few_warning(row) if too_few(row) else
                                       f"{label}: {row.reason}"))
    return row
