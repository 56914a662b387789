"""Hugging Face's Trainer on a small causal language model built from a config,
fed by the DataLoader the Trainer makes itself (dataloader_pin_memory=True, its
default): stock against fastpin.install() and fastpin.install(device="cuda").

The Trainer (through Accelerate) moves each batch to the GPU itself with
`.to(device, non_blocking=True)`; under install(device="cuda") the batch is
there already, copied on a side stream ahead of the step, and that move is a
no-op. Each path runs in a fresh interpreter, so nothing one path left behind
reaches the next.

The model: GPT-2 from a config (random weights; --layers, --width), bf16. The
data: token windows held in memory (each sample differs: input_ids, the same as
labels, and an attention mask), --batch windows of --seq tokens a step.
Tokens/s counts the steps after --warmup, timed between two CUDA
synchronisations.

    python benchmarks/hf_install.py --workers 8 --steps 60 [--json out.json]
    python benchmarks/hf_install.py --cpu --steps 4 --warmup 1   (a smoke run, no GPU)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PATHS = ("pin_memory", "install", "install_device")


def child(path: str, a: argparse.Namespace) -> dict:
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)

    import fastpin

    if path == "install":
        fastpin.install()
    elif path == "install_device":
        fastpin.install(device="cuda")
    n = a.batch * (a.steps + a.warmup + 4)

    class Windows(torch.utils.data.Dataset):
        """Token windows: sample i differs from every other (never zeros)."""

        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.tokens = torch.randint(1, a.vocab, (a.seq * 64 + 1,), generator=g)

        def __len__(self):
            return n

        def __getitem__(self, i):
            start = (i * 7919) % (len(self.tokens) - a.seq)
            ids = self.tokens[start:start + a.seq].clone()
            mask = torch.ones(a.seq, dtype=torch.int64)
            mask[a.seq - (i % 17):] = 0
            return {"input_ids": ids, "labels": ids, "attention_mask": mask}

    times: list = []
    sync = (lambda: None) if a.cpu else torch.cuda.synchronize

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step in (a.warmup, a.warmup + a.steps):
                sync()
                times.append(time.perf_counter())

    config = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.width, n_layer=a.layers,
                        n_head=max(1, a.width // 64))
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir="/tmp/fastpin-hf-install", per_device_train_batch_size=a.batch,
        dataloader_num_workers=a.workers, dataloader_pin_memory=True,
        bf16=not a.cpu, use_cpu=a.cpu, max_steps=a.warmup + a.steps + 1, learning_rate=1e-4,
        logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
        seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[Clock()])
    trainer.train()
    t0, t1 = times
    out = {"path": path, "workers": a.workers,
           "tokens_per_s": a.steps * a.batch * a.seq / (t1 - t0),
           "steps_per_s": a.steps / (t1 - t0)}
    if path.startswith("install"):
        out["fallbacks"] = fastpin.stats()["fallbacks"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--path", action="append", choices=PATHS)
    p.add_argument("--cpu", action="store_true", help="train on the CPU (a smoke run)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT", json.dumps(child(a.child, a)), flush=True)
        return 0
    paths = a.path or (("pin_memory", "install") if a.cpu else PATHS)
    rows = []
    for path in paths:
        cmd = [sys.executable, __file__, "--child", path] + [
            f"--{k}={getattr(a, k)}" for k in ("workers", "steps", "warmup", "batch", "seq",
                                                "vocab", "layers", "width")]
        cmd += ["--cpu"] if a.cpu else []
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            got = [line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")]
            row = json.loads(got[0]) if got else {
                "path": path, "workers": a.workers,
                "error": (r.stderr.strip().splitlines() or [f"rc {r.returncode}"])[-1]}
        except subprocess.TimeoutExpired:
            row = {"path": path, "workers": a.workers, "error": "timed out"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = next((r.get("tokens_per_s") for r in rows if r["path"] == "pin_memory"), None)
    print(f"\nHF Trainer, GPT-2 {a.layers} layers x {a.width}, batch {a.batch} x {a.seq} tokens, "
          f"{a.workers} workers")
    print("| path | tokens/s | steps/s | / stock |")
    print("|---|---:|---:|---:|")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"| {r['path']} | failed: {r['error']} | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {r['path']} | {r['tokens_per_s']:,.0f} | {r['steps_per_s']:.2f} | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
