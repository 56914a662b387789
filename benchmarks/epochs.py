"""Epoch after epoch over one DataLoader, the way training scripts write it:
each epoch's wall time and its first batch's, for the stock path
(DataLoader(pin_memory=True), then .to()), a new fastpin.Loader every epoch
(`for batch in fastpin.Loader(dl, device=...)`), one Loader kept for every
epoch, and install(device=...). A new Loader every epoch must cost no more
than the stock path's epoch: what a Loader makes once (the shared arena,
page-locked and registered with CUDA) is what this shows.

    python benchmarks/epochs.py [--case images_f32] [--workers 15] [--batches 60]
        [--epochs 3] [--persistent] [--path stock --path loader_each ...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fastpin
from fastpin.bench import workloads

PATHS = ("stock", "loader_each", "loader_kept", "install_device")


def epochs(path: str, case: str, workers: int, batches: int, n: int, persistent: bool,
           device: torch.device) -> dict:
    w = workloads.CASES[case]
    dataset = w.make()
    make = w.factory(dataset, workers, batches)
    dl = make(path in ("stock", "install_device"))
    if persistent and workers:  # DataLoader refuses the attribute once made
        dl.__dict__["persistent_workers"] = True
    if path == "install_device":
        fastpin.install(device=str(device))
    kept = fastpin.Loader(dl, device=device) if path == "loader_kept" else None
    rows = []
    try:
        for _ in range(n):
            source = (fastpin.Loader(dl, device=device) if path == "loader_each"
                      else kept if kept is not None else dl)
            t0 = time.perf_counter()
            first = None
            for batch in source:
                if first is None:
                    first = time.perf_counter() - t0
                if isinstance(batch, dict):
                    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()
                             if isinstance(v, torch.Tensor)}
                elif isinstance(batch, (list, tuple)):
                    batch = [v.to(device, non_blocking=True) for v in batch
                             if isinstance(v, torch.Tensor)]
                del batch
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"epoch_s": round(time.perf_counter() - t0, 3),
                         "first_batch_s": round(first or 0.0, 3)})
            del source
    finally:
        if path == "install_device":
            fastpin.uninstall()
    return {"path": path, "case": case, "workers": workers, "batches": batches,
            "persistent": persistent, "epochs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="images_f32", choices=sorted(workloads.CASES))
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--batches", type=int, default=60, help="batches an epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    parser.add_argument("--path", action="append", choices=PATHS)
    parser.add_argument("--json", help="write the rows here too, as a list")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for path in args.path or PATHS:
        if path == "install_device" and device.type != "cuda":
            continue  # install(device=...) needs a GPU
        rows.append(epochs(path, args.case, args.workers, args.batches, args.epochs,
                           args.persistent, device))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
