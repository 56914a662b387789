"""The training case of python -m fastpin.bench (--case train_model): a real
model trained on an in-memory image set, through every data path that applies,
beside the model's own speed with the batch already on the GPU (the upper
bound). Also runnable alone: python -m fastpin.bench.train (or, as before,
python -m fastpin.bench_train).

The model: resnet18 (torchvision's, else timm's), random weights, channels_last,
bf16 autocast, SGD with momentum. The data: 3x224x224 uint8 images held in
memory, batch 256, in two forms:

  uint8     the workers hand over uint8 images; the step normalises them on the GPU
  float32   the workers normalise each image to float32 (4x the bytes to move)

Paths (the workload cases' own, from fastpin.bench.PATHS; --path takes any of
them): by default the stock path (pin_memory: DataLoader's pin thread) and
those of the report's summary (the timm/Apex prefetcher, install(), every path
that delivers to the GPU but the copying Loader, fastpin.Loader with
zero-copy), each with fastpin's
default settings: the default arena, and a shared arena that sizes itself.
Each path is timed as the workload cases are: untimed steps first, at least the
batches its workers make ahead (num_workers x prefetch_factor, and the depth),
then at least --steps steps and a second. Figures: images/s and the fraction of
the upper bound. Skipped, with the reason, where there is no GPU or neither
torchvision nor timm is importable.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from . import paths as _paths
from ._optional import Dataset, torch
from .results import MIN_SECONDS, MIN_TIMED, wrap
from .workloads import ENDLESS

__all__ = ["PATHS", "default_paths", "format_train_table", "resnet18_maker", "train_table",
           "why_not"]


def default_paths() -> tuple:
    """The stock path and those of the report's summary that a default run takes,
    in the registry's order."""
    return tuple(p for p, info in _paths.PATHS.items()
                 if p == "pin_memory" or (info.in_summary and info.in_default))


PATHS = default_paths()
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


def resnet18_maker() -> Optional[Callable[[], torch.nn.Module]]:
    """A maker of resnet18 with random weights: torchvision's, else timm's."""
    try:
        import torchvision

        return lambda: torchvision.models.resnet18(weights=None)
    except Exception:  # noqa: BLE001 - an install that fails to import counts as none
        pass
    try:
        import timm

        return lambda: timm.create_model("resnet18", pretrained=False)
    except Exception:  # noqa: BLE001
        return None


def why_not() -> Optional[str]:
    """Why the training case cannot run here, or None."""
    gpu, reason = _paths.gpu_usable()
    if not gpu:
        return f"skipped: needs a GPU ({reason})"
    if resnet18_maker() is None:
        return "skipped: needs torchvision or timm (for resnet18); neither is importable"
    return None


class _Images(Dataset):
    """`n` samples over `data` (a few distinct images, cycled): uint8 as held, or
    float32 normalised here, in the worker."""

    def __init__(self, data: torch.Tensor, labels: torch.Tensor, n: int, normalise: bool):
        self.data, self.labels, self.n, self.normalise = data, labels, n, normalise
        self.mean = torch.tensor(_MEAN).view(3, 1, 1) * 255
        self.std = torch.tensor(_STD).view(3, 1, 1) * 255

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        k = i % len(self.data)
        x = self.data[k]
        if self.normalise:
            x = (x.float() - self.mean) / self.std
        return x, self.labels[k]


class _Trainer:
    """One resnet18 and its optimiser; step(batch) trains on a batch already on
    `device` (uint8 batches are normalised there first)."""

    def __init__(self, make: Callable[[], torch.nn.Module], device: torch.device):
        self.device = device
        self.model = make().to(device).to(
            memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = torch.nn.CrossEntropyLoss()
        self.mean = (torch.tensor(_MEAN, device=device) * 255).view(1, 3, 1, 1)
        self.std = (torch.tensor(_STD, device=device) * 255).view(1, 3, 1, 1)
        self.autocast = device.type == "cuda"

    def step(self, batch) -> None:
        x, y = batch
        if x.dtype == torch.uint8:
            x = (x.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(dataset, *, batch_size: int, workers: int, device: torch.device,
         depth: int = 2) -> _paths.PathRun:
    """What a path is given to deliver `dataset`'s batches to `device`."""
    cuda = device.type == "cuda"

    def dl(pin: bool):
        # Sampled with replacement, endless: each path takes what it needs.
        sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                 num_samples=batch_size * ENDLESS)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                           num_workers=workers, pin_memory=pin and cuda,
                                           drop_last=True, persistent_workers=False)

    # capacity None: fastpin's defaults (arenas that size themselves).
    return _paths.PathRun(dl, device if cuda else None, depth=depth)


def _images_per_s(trainer: _Trainer, batches: Iterable, steps: int, warmup: int,
                  batch_size: int, min_seconds: float = MIN_SECONDS,
                  run: Optional[_paths.PathRun] = None) -> float:
    """Images/s over at least `steps` training steps and `min_seconds`, after
    `warmup` untimed ones, and at least what the path's source made ahead (run)."""
    it = iter(batches)
    try:
        trainer.step(next(it))  # the source made and started: its workers are known
        ahead = run.prefetched() if run is not None else 0
        for _ in range(max(warmup, ahead)):
            trainer.step(next(it))
        _sync(trainer.device)
        t0 = time.perf_counter()
        n = 0
        # Steps the GPU has queued when the clock says enough are timed too: the
        # last synchronisation waits for them.
        while n < steps or time.perf_counter() - t0 < min_seconds:
            trainer.step(next(it))
            n += 1
        _sync(trainer.device)
        return n * batch_size / (time.perf_counter() - t0)
    finally:
        _paths.shutdown(it)


def _bound(dataset, batch_size: int, device: torch.device):
    """One batch, already on the device, handed out again and again."""
    x = torch.stack([dataset[i][0] for i in range(batch_size)]).to(device)
    y = torch.stack([dataset[i][1] for i in range(batch_size)]).to(device)
    while True:
        yield x, y


def _path_ips(path: str, trainer: _Trainer, dataset, workers: int, steps: int, warmup: int,
              batch_size: int, bound: float, min_seconds: float) -> dict:
    """One path's images/s and fraction of the bound, or the error that ended it."""
    run = _run(dataset, batch_size=batch_size, workers=workers, device=trainer.device)
    try:
        ips = _images_per_s(trainer, _paths.PATHS[path].make(run), steps, warmup, batch_size,
                            min_seconds, run)
        out = {"ips": ips, "of_bound": ips / bound}
        if path == "zero_copy":
            out["fallbacks"] = run.loader.stats()["fallbacks"]
        return out
    except Exception as exc:  # noqa: BLE001 - one path failing ends no others
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        run.loader = run.arena = run.pool = None


def train_table(workers: Sequence[int] = (15,), steps: int = MIN_TIMED, warmup: int = 5,
                batch_size: int = 256, dtypes: Sequence[str] = ("uint8", "float32"),
                paths: Sequence[str] = PATHS, device: Any = None, images: int = 512,
                size: int = 224, model: Optional[Callable[[], torch.nn.Module]] = None,
                min_seconds: float = MIN_SECONDS) -> dict:
    """Images/s training resnet18 through each path, and the fraction of the upper
    bound (the same steps with one batch already on the GPU): at least `steps`
    steps and `min_seconds` timed, after `warmup` untimed and what the workers
    made ahead. `device` (default: the current GPU) and `model` (default:
    resnet18) are there for tests."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    make = model or resnet18_maker()
    if make is None:
        raise RuntimeError("needs torchvision or timm (for resnet18)")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 1000, (images,), generator=g)
    trainer = _Trainer(make, device)
    rows = []
    for dtype in dtypes:
        dataset = _Images(data, labels, images, normalise=dtype == "float32")
        bound = _images_per_s(trainer, _bound(dataset, batch_size, device), steps, warmup,
                              batch_size, min_seconds)
        batch_mb = batch_size * 3 * size * size * (4 if dtype == "float32" else 1) / 1e6
        for nw in workers:
            row: dict = {"dtype": dtype, "workers": nw, "batch_mb": batch_mb, "bound_ips": bound,
                   "paths": {}}
            for path in paths:
                row["paths"][path] = _path_ips(path, trainer, dataset, nw, steps, warmup,
                                               batch_size, bound, min_seconds)
            rows.append(row)
    return {"device": str(device), "steps": steps, "warmup": warmup, "batch_size": batch_size,
            "min_seconds": min_seconds, "paths": list(paths), "rows": rows}


def format_train_table(result: dict) -> str:
    """Markdown: one row per path (the upper bound first), one column per dtype and
    worker count: images/s (fraction of the bound)."""
    least = f"at least {result['steps']} steps"
    if result.get("min_seconds"):
        least += f" and {result['min_seconds']:g} s"
    rows = result["rows"]
    lines = [wrap(f"resnet18, bf16 autocast, channels_last, SGD; batch {result['batch_size']}; "
                  f"{least} timed per path, after at least {result['warmup']} untimed and the "
                  "batches its workers made ahead. Images/s, and in brackets the fraction of "
                  "the upper bound (the same steps with the batch already on the GPU)."),
             "",
             "| path | " + " | ".join(f"{r['dtype']} ({r['batch_mb']:.0f} MB), "
                                      f"{r['workers']} workers" for r in rows) + " |",
             "|---|" + "---:|" * len(rows),
             "| upper bound | " + " | ".join(f"{r['bound_ips']:.0f}" for r in rows) + " |"]
    for p in result["paths"]:
        cells = []
        for r in rows:
            v = r["paths"].get(p, {})
            cells.append(f"{v['ips']:.0f} ({v['of_bound']:.2f})" if "ips" in v
                         else f"failed: {v.get('error', 'not run')}")
        label = _paths.PATHS[p].label if p in _paths.PATHS else p
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpin.bench_train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from .__main__ import _number  # python -m fastpin.bench's own checks

    parser.add_argument("--workers", type=_number(int, 0), action="append",
                        help="DataLoader workers (repeatable; default 15)")
    parser.add_argument("--steps", type=_number(int, 1), default=MIN_TIMED,
                        help=f"steps timed per path at least (and {MIN_SECONDS:g} s; "
                             f"default {MIN_TIMED})")
    parser.add_argument("--warmup", type=_number(int, 0), default=5, help="untimed steps first")
    parser.add_argument("--path", action="append", choices=tuple(_paths.PATHS),
                        help=f"a path (repeatable; default: {', '.join(PATHS)})")
    args = parser.parse_args(argv)
    why = why_not()
    if why is not None:
        sys.stdout.write(why + "\n")
        return 0
    result = train_table(workers=args.workers or (15,), steps=args.steps, warmup=args.warmup,
                         paths=args.path or PATHS)
    sys.stdout.write(format_train_table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
