"""Lightning's Trainer on resnet18, fed by DataLoader(pin_memory=True): stock
against fastpin.install() (pinned host batches; Lightning moves them with
`.to(device, non_blocking=True)` on the compute stream), fastpin.install(device="cuda")
(batches already on the GPU, copied on a side stream ahead of the step),
fastpin.Loader(dl, device="cuda") returned by train_dataloader(), and the
upper bound: the same model fed batches already on the GPU (`resident`).

Each (dtype, path) runs in a fresh interpreter, so nothing one path left behind
(a pinned cache, installed hooks, workers) reaches the next. The model and the
data are fastpin.bench.train's: resnet18 with random weights, channels_last,
bf16-mixed, SGD; 3x224x224 images held in memory, batch 256, uint8 normalised
on the GPU in the step or float32 normalised in the workers. Images/s counts
the steps after `--warmup`, timed between two CUDA synchronisations.

    python benchmarks/lightning_install.py --workers 15 --steps 60 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PATHS = ("pin_memory", "install", "install_device", "loader", "resident")


def child(path: str, dtype: str, workers: int, steps: int, warmup: int) -> dict:
    import lightning as L
    import torch

    import fastpin
    from fastpin.bench.train import _MEAN, _STD, _Images, resnet18_maker

    if path == "install":
        fastpin.install()
    elif path == "install_device":
        fastpin.install(device="cuda")
    torch.backends.cudnn.benchmark = True
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (512, 3, 224, 224), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 1000, (512,), generator=g)
    batch = 256
    dataset = _Images(data, labels, batch * (steps + warmup + 2), normalise=dtype == "float32")
    make = resnet18_maker()

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make().to(memory_format=torch.channels_last)
            self.register_buffer("mean", torch.tensor(_MEAN).view(1, 3, 1, 1) * 255)
            self.register_buffer("std", torch.tensor(_STD).view(1, 3, 1, 1) * 255)
            self.times: list = []

        def training_step(self, b, i):
            x, y = b
            if x.dtype == torch.uint8:
                x = (x.float() - self.mean) / self.std
            x = x.contiguous(memory_format=torch.channels_last)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def on_train_batch_start(self, b, i):
            if i in (warmup, warmup + steps):
                torch.cuda.synchronize()
                self.times.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):
            if path == "resident":
                return _resident(dataset, batch, warmup + steps + 2)
            dl = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True,
                                             num_workers=workers, pin_memory=True,
                                             drop_last=True)
            return fastpin.Loader(dl, device="cuda") if path == "loader" else dl

    model = Model()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
                        max_steps=warmup + steps + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    t0, t1 = model.times
    out = {"path": path, "dtype": dtype, "workers": workers, "ips": steps * batch / (t1 - t0)}
    if path.startswith("install"):
        # Every fallback of this process: its own, and its DataLoader workers'
        # (the pools install() gave the DataLoaders Lightning iterated).
        out["fallbacks"] = fastpin.stats()["fallbacks"]
    return out


class _Resident:
    """An iterable of batches, not a list: Lightning takes a list (or tuple) that
    train_dataloader() returns as several dataloaders, one per element."""

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def _resident(dataset, batch: int, n: int) -> _Resident:
    """The upper bound's data: four distinct batches made once on the GPU, handed
    out n times (references, no copies)."""
    import torch

    batches = []
    for k in range(4):
        samples = [dataset[k * batch + i] for i in range(batch)]
        x = torch.stack([s[0] for s in samples]).cuda()
        y = torch.stack([torch.as_tensor(s[1]) for s in samples]).cuda()
        batches.append((x, y))
    return _Resident([batches[i % 4] for i in range(n)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, action="append")
    p.add_argument("--dtype", action="append", choices=("uint8", "float32"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--path", action="append", choices=PATHS)
    p.add_argument("--json")
    p.add_argument("--child", nargs=2, metavar=("PATH", "DTYPE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    workers = a.workers or [15]
    if a.child:
        print("RESULT", json.dumps(child(*a.child, workers[0], a.steps, a.warmup)), flush=True)
        return 0
    rows = []
    for dtype in a.dtype or ("float32", "uint8"):
        for nw in workers:
            for path in a.path or PATHS:
                cmd = [sys.executable, __file__, "--child", path, dtype, "--workers", str(nw),
                       "--steps", str(a.steps), "--warmup", str(a.warmup)]
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                    got = [line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")]
                    row = json.loads(got[0]) if got else {
                        "path": path, "dtype": dtype, "workers": nw,
                        "error": r.stderr.strip().splitlines()[-1:] or f"rc {r.returncode}"}
                except subprocess.TimeoutExpired:
                    row = {"path": path, "dtype": dtype, "workers": nw, "error": "timed out"}
                rows.append(row)
                print(json.dumps(row), flush=True)
    chosen = a.path or PATHS
    print("\n| dtype | workers | " + " | ".join(f"{p} img/s" for p in chosen)
          + " | install_device / install | install_device / loader | install_device / resident |")
    print("|---|---:|" + "---:|" * (len(chosen) + 3))
    for dtype in a.dtype or ("float32", "uint8"):
        for nw in workers:
            got = {r["path"]: r for r in rows if r["dtype"] == dtype and r["workers"] == nw}
            ips = {p: got[p].get("ips") for p in chosen}
            cells = [f"{ips[p]:,.0f}" if ips.get(p) else f"failed: {got[p]['error']}"
                     for p in chosen]

            def ratio(a_: str, b_: str) -> str:
                return f"{ips[a_] / ips[b_]:.2f}" if ips.get(a_) and ips.get(b_) else "-"

            print(f"| {dtype} | {nw} | " + " | ".join(cells)
                  + f" | {ratio('install_device', 'install')} | {ratio('install_device', 'loader')}"
                  f" | {ratio('install_device', 'resident')} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
