"""python -m fastpin.bench: the command line (the options, and main(), which
runs the cases SUITE names and prints their report as it goes)."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import textwrap
from typing import Optional, Sequence

from fastpin import _C, _torch

from ._optional import torch
from .cases import CASE_NAMES, DEFAULT_CASES, QUICK_CASES, QUICK_SIZES, SUITE, Plan
from .host import MB, machine
from .paths import PATHS, gpu_usable, target_of, why_not
from .plots import MATPLOTLIB, plot
from .progress import Progress
from .results import MIN_SECONDS, MIN_TIMED, WIDTH
from .suite import failed, report, save

log = logging.getLogger("fastpin.bench")

_out = functools.partial(print, flush=True)   # a line of the report, with no bar to clear


def _device_arg(text: str) -> str:
    """--device: auto, host (or cpu), cuda or cuda:N; anything else is a usage error."""
    kind, _, index = text.partition(":")
    if text in ("auto", "host", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a device: use auto (the GPU if any, else the host), host, cuda or "
        "cuda:N")


def _number(kind: type, least: float):
    """An option's type: a finite `kind` (int or float) of at least `least`;
    anything else is a usage error ("argument --X: ...")."""
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not math.isfinite(x) or x < least:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give {'a whole' if kind is int else 'a'} number of at least {least:g}")
        return x
    return parse


def _mib(text: str) -> float:
    """--sizes: MiB, at least one byte."""
    size = _number(float, 0)(text)
    if int(size * MB) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least one byte "
                                         f"({1 / MB:.2g} MiB)")
    return size


def _saved_run(path: str) -> dict:
    """--from-json: the run a --json wrote, read now, so a missing or broken file is
    a usage error."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{path!r}: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    """The command line's options (main() and the README's list of them)."""
    parser = argparse.ArgumentParser(prog="python -m fastpin.bench",
                                     description=sys.modules[__package__].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=CASE_NAMES + ("all",),
                        help="a case to run (repeatable; default: every case but "
                             "loader_images and train_step, and those that need a GPU where there is none; "
                             "all: every case)")
    parser.add_argument("--path", action="append", choices=tuple(PATHS),
                        help="a path to run in the workload cases (repeatable; default: every "
                             "path that can run here, but fastpin_pin, loader_host and "
                             "loader_cuda where batches go to a GPU)")
    parser.add_argument("--workers", type=_number(int, 0), nargs="+",
                        help="DataLoader workers (default: one per core but one, N; "
                             "loader_images: N, and 8 too where N > 8; train_model: N, at "
                             "most 15)")
    parser.add_argument("--batches", type=_number(int, 1), default=MIN_TIMED,
                        help="batches timed per path at least, and at least "
                             f"{MIN_SECONDS:g} s of them (default: {MIN_TIMED}; train_model: "
                             "its steps)")
    parser.add_argument("--warmup", type=_number(int, 0), default=3,
                        help="untimed batches after the first, at least: each path also "
                             "takes every batch its workers made ahead (num_workers x "
                             "prefetch_factor, and the depth) before timing (default: 3)")
    parser.add_argument("--max-seconds", type=_number(float, 0), default=0.0,
                        help="time budget of each path: it stops timing after this many "
                             "seconds even short of --batches (never short of "
                             f"{MIN_TIMED} batches and {MIN_SECONDS:g} s; default: 0, no "
                             "budget)")
    parser.add_argument("--rounds", type=_number(int, 1), default=1,
                        help="workload cases: run each path this many times, the paths "
                             "taking turns, and report each path's run of the median GB/s "
                             "with the lowest and highest (default: 1)")
    parser.add_argument("--compute-ms", type=_number(float, 0), default=0.0,
                        help="simulated compute per step in the workload cases, ms (default: 0)")
    parser.add_argument("--device", default="auto", type=_device_arg,
                        help="where batches go: auto (the GPU if any, else the host), host, "
                             "cuda, cuda:N (an error where there is no such GPU)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: fewer cases (" + ", ".join(QUICK_CASES) + "; "
                             "pin_sizes at 0.0625 1 16 MiB) and paths (the stock path and "
                             "those of the summary), each measured as in a full run")
    parser.add_argument("--sizes", type=_mib, nargs="+",
                        help="pin_sizes: batch sizes in MiB (default: 0.0625 0.25 1 2 4 8 16 256)")
    parser.add_argument("--seconds", type=_number(float, 0),
                        help="pin_sizes: least time spent timing each cell (default: 0.3)")
    parser.add_argument("--hang-report", type=_number(float, 0), default=300.0, metavar="SECONDS",
                        help="a workload path still running after this long prints every "
                             "thread's stack to stderr (and again, from faulthandler, at twice "
                             "the time), then goes on (default: 300; 0: never)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON (its folder must exist)")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the workload cases (PNG; needs matplotlib: "
                             "pip install matplotlib; its folder must exist)")
    parser.add_argument("--from-json", metavar="PATH", type=_saved_run,
                        help="measure nothing: print (and --plot) a run that --json wrote")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--list", action="store_true",
                        help="list the cases and paths, each with what it measures")
    return parser


def _listed(name: str, what: str) -> str:
    return textwrap.fill(what, WIDTH, initial_indent=f"  {name:14s}", subsequent_indent=" " * 16,
                         break_on_hyphens=False)


def _list() -> int:
    _out("cases:")
    for case in SUITE.values():
        _out(_listed(case.name, case.what))
    _out("paths:")
    for p in PATHS.values():
        _out(_listed(p.name, p.what))
    return 0


def _from_json(args: argparse.Namespace) -> int:
    saved = args.from_json  # read by _saved_run
    _out(report(saved))
    if args.plot:
        plot(saved, args.plot)
        _out(f"\nPlot: {args.plot}")
    return 0


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """--device cuda[:N] where there is no such GPU: a usage error, not a host run."""
    if not device.startswith("cuda"):
        return
    gpu, why = gpu_usable()
    if not gpu:
        parser.error(f"--device {device}: no GPU to deliver to here ({why}); use "
                     "--device auto (the GPU if any, else the host) or --device host")
    if ":" in device and int(device.partition(":")[2]) >= torch.cuda.device_count():
        parser.error(f"--device {device}: this machine has "
                     f"{torch.cuda.device_count()} CUDA device(s)")


def _cases(args: argparse.Namespace, gpu: bool) -> list:
    """The cases to run: those --case names (all: every one), else the default list
    or --quick's, without those that need a GPU where there is none (the report's
    header says there is none; named with --case, they are reported as skipped)."""
    if args.case and "all" not in args.case:
        return [n for n in CASE_NAMES if n in args.case]
    names = CASE_NAMES if args.case else QUICK_CASES if args.quick else DEFAULT_CASES
    return [n for n in CASE_NAMES if n in names and (gpu or not SUITE[n].gpu_only)]


def _paths(args: argparse.Namespace, target, host_reason: str) -> list:
    """The workload cases' paths: those --path names, else those that can run here:
    on the host every one; delivering to a GPU the stock path and the summary's
    but the copying Loader (pageable, fastpin's host-pinning paths, fastpin_pin and
    loader_host, and loader_cuda when named: a default run fits in four minutes);
    --quick: the stock path and the summary's. A named path that cannot run is left
    out of the tables, and the report says why."""
    if args.path:
        return [p for p in PATHS if p in args.path]
    stock = "pin_memory" if target is not None else "pageable"

    def wanted(p: str) -> bool:
        if p == stock or (PATHS[p].in_summary and PATHS[p].in_default):
            return True
        return not args.quick and target is None

    return [p for p in PATHS if why_not(p, target, host_reason) is None and wanted(p)]


def _plan(args: argparse.Namespace) -> Plan:
    """What the command line asks for, each default filled in for this machine.
    --quick shortens the lists of cases, paths and sizes, never how each is measured."""
    gpu, _ = gpu_usable()
    cpus = _C.cpu_count()
    target, host_reason = target_of(args.device)
    n = max(1, cpus - 1)
    return Plan(
        names=_cases(args, gpu), paths=_paths(args, target, host_reason), gpu=gpu,
        quick=args.quick, warmup=args.warmup, workers=args.workers or [n],
        batches=args.batches, device=args.device, target=target, host_reason=host_reason,
        compute_ms=args.compute_ms, max_seconds=args.max_seconds,
        sizes=args.sizes or (QUICK_SIZES if args.quick else [0.0625, 0.25, 1, 2, 4, 8, 16, 256]),
        seconds=args.seconds if args.seconds is not None else 0.3,
        loader_workers=args.workers or sorted({min(8, n), n}),
        train_workers=args.workers or [min(15, n)], rounds=args.rounds)


def _new_suite(command: str, plan: Plan) -> dict:
    return {
        "command": command,
        "machine": machine(),
        "settings": {"cases": plan.names, "paths": plan.paths, "workers": plan.workers,
                     "batches": plan.batches, "warmup": plan.warmup,
                     "min_seconds": MIN_SECONDS, "compute_ms": plan.compute_ms,
                     "device": str(plan.target or "host"), "max_seconds": plan.max_seconds,
                     "rounds": plan.rounds, "quick": plan.quick},
        "order": plan.names, "cases": [], "not_run_cases": {}, "failed_cases": {},
    }


def _run_case(name: str, plan: Plan, suite: dict, reporter: Progress,
              json_path: Optional[str]) -> None:
    """One case into the suite (and the JSON so far); the report comes at the end."""
    reporter.stage(name)
    try:
        SUITE[name].run(plan, suite, reporter)
    except Exception as exc:  # a case that breaks does not end the suite
        log.debug("fastpin.bench: case %s failed", name, exc_info=True)
        suite["not_run_cases"][name] = f"failed: {type(exc).__name__}: {exc}"
        suite["failed_cases"][name] = f"{type(exc).__name__}: {exc}"
    if json_path:  # after every case: a run cut short keeps what it measured
        save(suite, json_path)


def _finish(suite: dict, args: argparse.Namespace) -> int:
    """The report, the JSON and the plot; the exit status."""
    _out(report(suite))
    if args.json:
        save(suite, args.json)
    if args.plot:
        if suite["cases"]:
            plot(suite, args.plot)
            _out(f"\nPlot: {args.plot}")
        else:
            _out("\nNo plot: no workload case ran.")
    return 1 if failed(suite) else 0


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--json and --plot into a folder that does not exist, or cannot be written:
    a usage error now, not a traceback after the whole run."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            parser.error(f"{option} {path}: no folder {folder} (make it first)")
        if os.path.isdir(path):
            parser.error(f"{option} {path}: is a folder; give a file name")
        if not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"{option} {path}: cannot write in {folder}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        return _list()
    _check_outputs(parser, args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot needs matplotlib: {MATPLOTLIB}")
    if args.from_json:
        return _from_json(args)
    if torch is None:
        print(f"python -m fastpin.bench: {_torch.message('the benchmark')}", file=sys.stderr)
        return 1
    _check_device(parser, args.device)
    plan = _plan(args)
    reporter = Progress(sum(SUITE[name].steps(plan) for name in plan.names),
                        enabled=not args.no_progress, hang_report_s=args.hang_report or None)
    suite = _new_suite("python -m fastpin.bench " + " ".join(sys.argv[1:] if argv is None
                                                             else argv), plan)
    try:
        for name in plan.names:
            _run_case(name, plan, suite, reporter, args.json)
    finally:
        reporter.close()
    return _finish(suite, args)


if __name__ == "__main__":
    sys.exit(main())
