"""python -m fastpin.bench: fastpin side by side with PyTorch's own paths, on
batches shaped like real workloads.

The report opens with a summary: for each workload case, the GB/s delivered to
the GPU through the stock DataLoader(pin_memory=True) and, with the ratio to it,
the timm prefetcher, install(), every path that delivers to the GPU and
fastpin.Loader; and the training case's images/s. Each case's details follow.

Cases (--case, repeatable; default: all but train_step and loader_images; --quick:
pin_sizes, images_u8, tokens, recsys):

  pin_sizes     pin_memory of one batch of 64 KiB to 256 MiB: the machine's memcpy
                rates, torch's pinning with 1 and N threads, fastpin.pin_memory
  train_step    a training step with compute C and transfer T (C < T, C > T):
                stock .to(), the timm/Apex prefetcher, fastpin.Loader (GPU only;
                when asked for)
  loader_images DataLoader delivered GB/s, uint8 and float32 images, batch 256, 8 and
                N workers: pin_memory=True, fastpin.Loader, zero-copy (when asked for)
  train_model   training resnet18 (torchvision's or timm's) on in-memory images,
                each path beside the batch already on the GPU (GPU only)
  images_u8     uint8 images 3x224x224, batch 256 (36.8 MiB)
  images_f32    float32 images 3x224x224, batch 256 (147 MiB)
  tokens        int64 token sequences of 2k-8k tokens, batch 8, padded per batch
                (input_ids, attention_mask, labels)
  recsys        a recommendation batch: a dict of 50 feature tensors, 4096 rows
  video         float32 clips 3x32x224x224, batch 16 (294 MiB)
  clips_f16     float16 clips 3x16x112x112, batch 32 (36.8 MiB)
  token_windows int32 token windows of 4096 tokens, batch 16, fixed length
                (input_ids, attention_mask, labels: 0.75 MiB)

The seven workload cases go through the paths (--path, repeatable):

  pageable      DataLoader(pin_memory=False); batch.to(device, non_blocking=True)
  pin_memory    DataLoader(pin_memory=True) (torch's pin thread); then .to()
  prefetcher    the timm/Apex side-stream prefetcher over DataLoader(pin_memory=True)
  fastpin_pin   DataLoader(pin_memory=False); fastpin.pin_memory(batch); then .to()
  loader_host   fastpin.Loader(loader, device=None): pinned host batches; then .to()
  loader_cuda   fastpin.Loader(loader, device="cuda", zero_copy=False): batches
                arrive on the GPU (when asked for)
  zero_copy     fastpin.Loader(loader, zero_copy=True): workers collate into the
                shared pinned arena (device "cuda", or None where there is no GPU)
  install       DataLoader(pin_memory=True) after fastpin.install(): the same
                zero-copy collation, the pin thread hands the batch over; then .to()

(--list gives every path of this version.) Each path is measured in its steady
state: the first batch and at least every batch its workers made meanwhile
(num_workers x prefetch_factor, and the Loader's depth) go untimed, then it is
timed over at least --batches batches (20) and at least a second. --quick
shortens the lists of cases and paths, never this.

Figures per path: delivered GB/s; step time with --compute-ms of simulated compute
per step (a GPU kernel that spins for that long; with no GPU, the main thread
sleeps, as a host waiting for its GPU does); main-process CPU per batch (every
thread of this process: pin thread, copy threads, the Loader's thread); pinned
memory held (torch's pinned cache, or fastpin's page-locked arena) with the peak
in use; time from making the loader to the first batch.

With no GPU, one line says so and why, and the GPU paths and cases are left out.
A case that needs more memory than is available is skipped, with the reason.

The same measurement for your own DataLoader: fastpin.bench.compare(...).
"""
# (This docstring is also --help's text.) One concept a module: paths (the
# registry of paths, each with its factory), runner (compare() and one path's
# measurement), results (Row, Results, their tables), workloads (the workload
# cases, their datasets), micro (the micro tables), cases (the registry of every
# case of the suite), suite (its report), progress (the reporter), plots, host
# (this machine), train (the training case), __main__ (the command line).
from __future__ import annotations

import sys
from typing import Any, Optional

from fastpin import _torch


def _for_main() -> bool:
    """This import is runpy's, looking for this package's __main__ (python -m
    fastpin.bench, or runpy.run_module): --help and --list need no torch."""
    frame: Any = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__") == "runpy"
                and frame.f_locals.get("mod_name") == __name__ + ".__main__"):
            return True
        frame = frame.f_back
    return False


try:
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:
    # Any other import says at once what to install; main() says it after
    # --help and --list.
    if _exc.name != "torch" or not _for_main():
        if _exc.name == "torch":
            raise ModuleNotFoundError(_torch.message("fastpin.bench"), name="torch") from None
        raise

import fastpin  # noqa: E402,F401 - fastpin.bench.fastpin, as before

from .cases import CASE_NAMES, MICRO, SUITE  # noqa: E402
from .host import MB, machine  # noqa: E402
from .host import meminfo_available as _available_memory  # noqa: E402
from .micro import (format_loader_table, format_pin_table, format_step_table,  # noqa: E402
                    loader_table, pin_table, step_table)
from .paths import PATHS, PathInfo  # noqa: E402
from .plots import plot  # noqa: E402
from .results import Results, Row  # noqa: E402
from .results import too_few as _too_few  # noqa: E402
from .runner import compare  # noqa: E402
from .suite import report  # noqa: E402
from .workloads import CASES, Workload, run_case  # noqa: E402
from .workloads import Images as _Images  # noqa: E402,F401 - benchmarks/zero_copy_cpu.py

__all__ = ["CASES", "PATHS", "Results", "Row", "compare", "main", "plot"]

# The hang report of compare() calls that bring no reporter of their own:
# seconds on one path before every thread's stack is printed (None: never).
# python -m fastpin.bench passes its reporter, with --hang-report, instead.
_hang_report_s: Optional[float] = None


def __getattr__(name: str) -> Any:
    # main() and its parser live in __main__, imported only when asked for: an
    # import here would run it twice under python -m fastpin.bench (runpy warns).
    if name in ("main", "_parser"):
        from . import __main__ as cli

        return getattr(cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
