"""The suite's cases, one registry (SUITE) that python -m fastpin.bench reads
for everything it does with a case: --case and --list, the progress total,
running it, and its section of the report.

Two kinds, one interface (what, steps, run, section): a MicroCase is one of
the micro tables (pin_sizes, train_step, loader_images, train_model), a
WorkloadCase one of the workload cases (CASES), run through every path."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from . import micro, train
from .host import MB, available_memory, gb
from .paths import gpu_usable, why_not
from .progress import Progress
from .results import Results
from .workloads import CASES, IMAGE_BYTES, Workload, run_case


@dataclasses.dataclass
class Plan:
    """What one run of the suite was asked for (main() makes it from the command line)."""

    names: list                # the cases, in order
    paths: list                # the paths of the workload cases
    gpu: bool                  # a GPU is usable here
    quick: bool
    warmup: int                # untimed batches at least (each path drains its prefetch too)
    workers: list              # DataLoader workers of the workload cases
    batches: int               # batches timed at least per path (and MIN_SECONDS)
    device: str                # --device
    target: Any                # where that delivers: a CUDA device, or None (the host)
    host_reason: str           # why the host, where it is
    compute_ms: float
    max_seconds: float
    sizes: list                # pin_sizes: MiB
    seconds: float             # pin_sizes: least seconds per cell
    loader_workers: list       # loader_images
    train_workers: list        # train_model
    train_paths: list = dataclasses.field(default_factory=list)  # train_model's paths
    rounds: int = 1            # workload cases: each path run this many times, in turn


def _no_gpu(plan: Plan) -> Optional[str]:
    return None if plan.gpu else f"skipped: needs a GPU ({gpu_usable()[1]})"


def _images_memory(plan: Plan) -> float:
    batch = 256 * IMAGE_BYTES * 4
    return 1024 * IMAGE_BYTES * 5 + max(1 << 30, batch * (2 * max(plan.loader_workers) + 8)) \
        + batch * (2 * max(plan.loader_workers) + 4)


@dataclasses.dataclass(frozen=True)
class MicroCase:
    """A micro table: measured into suite[key], or skipped with the reason."""

    name: str
    key: str                                   # where its table goes in the suite
    title: str                                 # its section's heading
    what: str                                  # what it measures (--list)
    fmt: Callable[[dict], str]                 # its table as Markdown
    steps: Callable[[Plan], int]               # progress steps it reports
    memory: Callable[[Plan], float]            # bytes it needs
    measure: Callable[[Plan, Progress], dict]
    needs: Callable[[Plan], Optional[str]] = lambda plan: None  # why not, memory aside
    gpu_only: bool = False                     # left out where there is no GPU

    def why_not(self, plan: Plan) -> Optional[str]:
        need, avail = self.memory(plan), available_memory()
        room = (f"skipped: too little memory: needs about {gb(need)}, {gb(avail)} available"
                if need > 0.85 * avail else None)
        return self.needs(plan) or room

    def run(self, plan: Plan, suite: dict, reporter: Progress) -> None:
        why = self.why_not(plan)
        if why is not None:
            suite["not_run_cases"][self.name] = why
        else:
            suite[self.key] = self.measure(plan, reporter)

    def section(self, suite: dict) -> str:
        if self.key in suite:
            return f"## {self.title}\n\n{self.fmt(suite[self.key])}"
        why = suite.get("not_run_cases", {}).get(self.name, "not run")
        return f"## {self.title}\n\n{why}"


@dataclasses.dataclass(frozen=True)
class WorkloadCase:
    """A workload case: every path, once per worker count, into suite["cases"]."""

    w: Workload

    gpu_only = False

    @property
    def name(self) -> str:
        return self.w.name

    @property
    def what(self) -> str:
        return (f"{self.w.title} ({self.w.batch_bytes / MB:.3g} MiB a batch): every path that "
                "applies")

    def steps(self, plan: Plan) -> int:
        runnable = [p for p in plan.paths if why_not(p, plan.target, plan.host_reason) is None]
        return (plan.rounds * len(plan.workers) * len(runnable)
                * (1 + plan.warmup + plan.batches))

    def run(self, plan: Plan, suite: dict, reporter: Progress) -> None:
        for nw in plan.workers:
            res = run_case(self.w, workers=nw, batches=plan.batches,
                           warmup=plan.warmup, device=plan.device, compute_ms=plan.compute_ms,
                           paths=plan.paths, max_seconds=plan.max_seconds, progress=reporter,
                           rounds=plan.rounds)
            suite["cases"].append(res.to_dict())

    def section(self, suite: dict) -> str:
        # The suite's report gives the legend and what was left out once.
        parts = [Results.from_dict(c).markdown(legend=False, left_out=False)
                 for c in suite["cases"] if c["name"] == self.name]
        if not parts:
            why = suite.get("not_run_cases", {}).get(self.name, "not run")
            return f"## {self.w.title}\n\n{why}"
        return "\n\n".join(parts)


_MICRO = [
    MicroCase(
        "pin_sizes", "pin_memory", "pin_memory of one batch",
        "pin_memory of one batch of 64 KiB, 256 KiB, 1, 2, 4, 8, 16, 256 MiB (--sizes): the "
        "machine's memcpy rates, torch's pinning with 1 and N threads, fastpin.pin_memory; "
        "each pinning path's CPU-seconds per GB, every thread of the process",
        micro.format_pin_table, steps=lambda plan: len(plan.sizes),
        memory=lambda plan: 4 * max(plan.sizes) * MB + max(1 << 30, 3 * max(plan.sizes) * MB),
        measure=lambda plan, reporter: micro.pin_table(plan.sizes, min_seconds=plan.seconds,
                                                       reporter=reporter)),
    MicroCase(
        "train_step", "step", "Training step: compute overlapped with transfer",
        "a training step with compute C and transfer T (C < T, C > T): stock .to(), "
        "the timm/Apex prefetcher, fastpin.Loader (GPU only; run when asked for)",
        micro.format_step_table, steps=lambda plan: 2 if plan.gpu else 0,
        memory=lambda plan: 6 * 256 * MB, needs=_no_gpu, gpu_only=True,
        measure=lambda plan, reporter: micro.step_table(reporter=reporter)),
    MicroCase(
        "loader_images", "loader", "DataLoader: delivered throughput",
        "DataLoader delivered GB/s over uint8 and float32 images, batch 256, at 8 and N "
        "workers: pin_memory=True, fastpin.Loader, fastpin.Loader(zero_copy=True) (run when "
        "asked for: images_u8 and images_f32 measure every path)",
        micro.format_loader_table, steps=lambda plan: 3 * 2 * len(plan.loader_workers),
        memory=_images_memory,
        measure=lambda plan, reporter: micro.loader_table(
            workers=plan.loader_workers, batches=plan.batches,
            max_seconds=plan.max_seconds, reporter=reporter)),
    MicroCase(
        "train_model", "train", "Training resnet18: images/s against the batch already on the GPU",
        "Training resnet18: images/s against the batch already on the GPU",
        train.format_train_table, steps=lambda plan: 0,   # train_table reports no steps
        memory=_images_memory, needs=lambda plan: train.why_not(), gpu_only=True,
        measure=lambda plan, reporter: train.train_table(
            workers=plan.train_workers, steps=plan.batches, warmup=plan.warmup,
            paths=plan.train_paths or train.default_paths())),
]

_ALL: list = [*_MICRO, *(WorkloadCase(w) for w in CASES.values())]
SUITE: dict = {c.name: c for c in _ALL}
MICRO = tuple(c.name for c in _MICRO)
CASE_NAMES = tuple(SUITE)
# What a run measures unless --case says: every case but loader_images (whose
# paths images_u8 and images_f32 measure too) and train_step (a micro table the
# training table answers in a real loop): a default run on a GPU fits in four
# minutes; --quick, a short list. Neither changes how a case is measured.
DEFAULT_CASES = tuple(n for n in CASE_NAMES if n not in ("loader_images", "train_step"))
QUICK_CASES = ("pin_sizes", "images_u8", "tokens", "recsys")
QUICK_SIZES = [0.0625, 1, 16]
