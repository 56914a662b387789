"""Data-parallel training with one fastpin.Loader per rank.

    torchrun --nproc_per_node=2 examples/ddp_train.py            # one rank per GPU
    torchrun --nproc_per_node=2 examples/ddp_train.py --compare  # and pin_memory=True beside it

Each rank builds its own DataLoader over a synthetic dataset with a
DistributedSampler, wraps it in fastpin.Loader bound to the rank's GPU
(cuda:LOCAL_RANK, backend nccl) and trains a tiny model with DDP. Without a
GPU it runs on the CPU with gloo, and the Loader hands out batches pinned in
fastpin's arena (device=None).

Every batch is checked: each sample's pattern differs (sample i is a fixed
patterned tensor plus i), so a stale, reused or misplaced buffer shows; the
batch must hold exactly the indices the sampler gave this rank, on this rank's
own device. At the end rank 0 checks that the ranks together saw every sample
once and that DDP kept the models equal.

Each rank prints one line per run, starting with "ddp_train:" and then JSON
(rank, mode, device, batches, exact, gbps: tensor bytes delivered per second
of the training loop from the second batch on, numa_node of the arena,
contexts: the GPUs with an active primary context in this process); rank 0
then prints a table of all ranks side by side. The exit status is 0 only when
every check passed on every rank.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import fastpin

TAG = "ddp_train:"


class Patterned(Dataset):
    """Sample i: {"image": base + i (int32, wrapping), "index": i}. base differs per
    element and has no zero run, so every sample differs from every other one in
    every element."""

    def __init__(self, n: int, shape):
        self.n, self.shape = n, tuple(shape)
        self.base = base_pattern(self.shape)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"image": self.base + i, "index": i}


def base_pattern(shape) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    j = torch.arange(numel, dtype=torch.int64)
    return ((j * 2654435761 + 12345) % 2147483629 + 1).to(torch.int32).view(shape)


def model_for(shape) -> nn.Module:
    numel = 1
    for s in shape:
        numel *= s
    return nn.Sequential(nn.Flatten(), nn.Linear(numel, 32), nn.ReLU(), nn.Linear(32, 10))


def say(text: str) -> None:
    """One line in one write: the ranks share stdout, and torchrun leaves it unbuffered
    (print writes the newline apart, so lines of two ranks could interleave)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def active_contexts() -> list:
    """The CUDA ordinals with an active primary context in this process (driver query:
    makes none). [] without a GPU."""
    if not torch.cuda.is_available():
        return []
    cuda = ctypes.CDLL("libcuda.so.1")
    out = []
    for ordinal in range(torch.cuda.device_count()):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            continue
        if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0 \
                and active.value:
            out.append(ordinal)
    return out


def run(mode: str, args, rank: int, world: int, device: torch.device, dataset: Patterned) -> dict:
    """Train on one epoch's share of this rank; check every batch; return the report."""
    gpu = device.type == "cuda"
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world, rank=rank,
                                                     shuffle=True, seed=7)
    sampler.set_epoch(0)
    expected_indices = list(iter(sampler))
    pin = mode == "pin_memory" and torch.accelerator.is_available()
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=pin,
                        persistent_workers=False)
    batches: Any = loader
    if mode == "fastpin":
        batches = fastpin.Loader(loader, device=device if gpu else None, depth=args.depth,
                                 zero_copy=args.zero_copy)

    torch.manual_seed(0)  # the same initial model on every rank, as DDP expects
    model = model_for(dataset.shape).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    base = dataset.base.to(device)

    exact, nbatches, nbytes = True, 0, 0
    seen: list = []
    problems: list = []
    start = None
    for step, batch in enumerate(batches):
        if step == args.steps:
            break
        if mode != "fastpin" and gpu:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        image, index = batch["image"], batch["index"]
        if start is None:  # the first batch pays for worker start-up
            if gpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        else:
            nbytes += image.numel() * image.element_size() + index.numel() * index.element_size()
        # Exact and on this rank's device, or the run fails.
        want = expected_indices[step * args.batch_size:(step + 1) * args.batch_size]
        ok = (image.device == device and index.device == device
              and index.tolist() == want
              and torch.equal(image, base + index.to(torch.int32).view(-1, *[1] * base.dim())))
        if mode == "fastpin" and not gpu:
            # The default arena sizes itself: its segments (a fixed one: itself).
            segments = getattr(batches.arena, "segments", (batches.arena,))
            ok = ok and any(a.base <= image.data_ptr() < a.base + a.capacity for a in segments)
        if not ok and len(problems) < 3:
            problems.append(f"batch {step}: indices {index.tolist()[:4]}..., device {image.device}")
        exact = exact and ok
        seen.extend(index.tolist())
        nbatches += 1

        x = image.float() / 2 ** 31
        loss = nn.functional.cross_entropy(ddp(x), index % 10)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if gpu:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start if start is not None else 0.0
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    report = {
        "rank": rank, "world": world, "mode": mode if not (mode == "pin_memory" and not pin)
        else "pin_memory(unavailable)", "device": str(device), "batches": nbatches,
        "exact": exact and nbatches > 0, "gbps": nbytes / elapsed / 1e9 if elapsed > 0 else 0.0,
        "seen": seen, "checksum": checksum, "problems": problems,
    }
    if mode == "fastpin":
        stats = batches.stats()
        report["numa_node"] = stats["numa_node"]
        report["fallbacks"] = stats["fallbacks"]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096, help="dataset size (all ranks)")
    p.add_argument("--shape", type=int, nargs="+", default=[3, 128, 128],
                   help="shape of one sample's image (int32)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank")
    p.add_argument("--steps", type=int, default=-1, help="batches per run (-1: the epoch)")
    p.add_argument("--depth", type=int, default=2, help="batches the Loader prepares ahead")
    p.add_argument("--zero-copy", action="store_true", help="Loader(zero_copy=True)")
    p.add_argument("--compare", action="store_true",
                   help="also run DataLoader(pin_memory=True) + .to(non_blocking=True)")
    args = p.parse_args(argv)

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # Run directly, not by torchrun: no rank to be. Say how, in one line.
        print(f"{sys.argv[0]}: run it under torchrun, one process per rank: torchrun "
              f"--nproc_per_node=2 examples/ddp_train.py{''.join(' ' + a for a in sys.argv[1:])}",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        # Before anything else touches CUDA: this rank's device is current, so
        # neither torch nor fastpin makes a context on another GPU.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        dataset = Patterned(args.samples, args.shape)
        reports = [run("fastpin", args, rank, world, device, dataset)]
        if args.compare:
            reports.append(run("pin_memory", args, rank, world, device, dataset))
        contexts = active_contexts()
        for r in reports:
            r["contexts"] = contexts
            say(f"{TAG} " + json.dumps({k: v for k, v in r.items() if k != "seen"}))

        everyone: list = [None] * world
        dist.all_gather_object(everyone, reports)
        ok = all(r["exact"] for rs in everyone for r in rs)
        if rank == 0:
            for i, _ in enumerate(reports):
                runs = [rs[i] for rs in everyone]
                seen = [s for r in runs for s in r["seen"]]
                # DistributedSampler pads a dataset that does not divide evenly
                # with repeats; otherwise the ranks' shares are disjoint.
                once = len(seen) == len(set(seen)) or args.samples % world != 0
                covered = once and (args.steps >= 0 or set(seen) == set(range(args.samples)))
                same_model = len({round(r["checksum"], 6) for r in runs}) == 1
                ok = ok and covered and same_model
                what = "every sample once" if args.steps < 0 else "no sample twice"
                say(f"{TAG} {runs[0]['mode']}: {what}: {covered}; "
                    f"models equal across ranks: {same_model}")
            say(f"{TAG} {'rank':>4}  {'device':<8} " + "  ".join(
                f"{r['mode'] + ' GB/s':>24}" for r in reports))
            for rs in everyone:
                say(f"{TAG} {rs[0]['rank']:>4}  {rs[0]['device']:<8} " + "  ".join(
                    f"{r['gbps']:>19.3f} {'ok' if r['exact'] else 'BAD':>4}" for r in rs))
            say(f"{TAG} {'all exact' if ok else 'FAILED'}")
        verdict = [ok]
        dist.broadcast_object_list(verdict, src=0)
        return 0 if verdict[0] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
