"""The workload cases: in-memory datasets shaped like real workloads (images,
token sequences and windows, a recommendation batch, video clips), how a
DataLoader batches each (Workload), and run_case(), which puts one through
every path when the machine has room for it."""
from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Optional, Sequence

from ._optional import Dataset, torch
from .host import MB, available_memory, gb, shm_free
from .paths import PATHS, target_of, why_not
from .progress import Progress
from .results import MIN_SECONDS, Results, Row, workers_label
from .runner import compare


class Images(Dataset):
    """An in-memory image set: samples are views, so loading costs nothing and
    the loader's own path is what is measured."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


class Tokens(Dataset):
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


def pad_collate(samples):
    """Pad to the longest sequence of the batch, as language-model collators do."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TokenWindows(Dataset):
    """Fixed-length int32 windows of `length` tokens, each with its attention
    mask and labels (a document of length/4..length tokens, then padding: id 0,
    mask 0, label -100), held as three (n, length) tensors: samples are views,
    and default_collate stacks them."""

    def __init__(self, n: int, length: int, seed: int = 19):
        g = torch.Generator().manual_seed(seed)
        used = torch.randint(length // 4, length + 1, (n, 1), generator=g)
        self.mask = (torch.arange(length).expand(n, length) < used).to(torch.int32)
        self.ids = torch.randint(1, 50_000, (n, length), dtype=torch.int32,
                                 generator=g) * self.mask
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


class Recsys(Dataset):
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


class Clips(Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"video": self.data[i], "label": i}


def _images(dtype: torch.dtype, n: int) -> Images:
    g = torch.Generator().manual_seed(7)
    return Images(torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g).to(dtype))


def _clips(n: int, shape: tuple, dtype: torch.dtype, seed: int) -> Clips:
    g = torch.Generator().manual_seed(seed)
    return Clips(torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g).to(dtype))


ENDLESS = 1 << 40   # batches a workload's sampler gives: never the end of a path


@dataclasses.dataclass
class Workload:
    """A case of the suite: a dataset and how DataLoader batches it."""

    name: str
    title: str
    batch_size: int
    batch_bytes: int                      # the largest batch, bytes
    dataset_bytes: int
    make: Callable[[], Any]               # -> the dataset (allocates it)
    collate: Optional[Callable] = None
    batched: bool = False                 # the dataset reads a list of indices at once

    def factory(self, dataset: Any, workers: int, n_batches: int = ENDLESS, seed: int = 0):
        """loader_factory(pin_memory) for compare(): the same batches every call,
        sampled with replacement (the samples cycle), `n_batches` of them (by
        default more than any path takes: each takes what its warm-up and timing
        need, however fast it is)."""
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


IMAGE_BYTES = 3 * 224 * 224
_CLIP = 3 * 32 * 224 * 224 * 4             # float32 3x32x224x224
_CLIP_F16 = 3 * 16 * 112 * 112 * 2         # float16 3x16x112x112
_WINDOW = 4096 * 4 * 3                     # int32 ids, mask, labels of 4096 tokens
CASES: dict = {w.name: w for w in [
    Workload("images_u8", "uint8 images 3x224x224, batch 256", 256, 256 * (IMAGE_BYTES + 8),
             1024 * IMAGE_BYTES, lambda: _images(torch.uint8, 1024)),
    Workload("images_f32", "float32 images 3x224x224, batch 256", 256,
             256 * (IMAGE_BYTES * 4 + 8), 512 * IMAGE_BYTES * 4,
             lambda: _images(torch.float32, 512)),
    Workload("tokens", "int64 token sequences of 2k-8k tokens, batch 8", 8, 8 * 8192 * 8 * 3,
             512 * 5120 * 8, lambda: Tokens(512, 2048, 8192),
             collate=pad_collate),
    Workload("recsys", "recommendation batch: dict of 50 feature tensors, 4096 rows", 4096,
             4096 * (40 * 8 + 9 * 64 + 4), (1 << 16) * (40 * 8 + 9 * 64 + 4),
             lambda: Recsys(1 << 16), batched=True),
    Workload("video", "float32 video clips 3x32x224x224, batch 16", 16, 16 * (_CLIP + 8),
             8 * _CLIP, lambda: _clips(8, (3, 32, 224, 224), torch.float32, 17)),
    Workload("clips_f16", "float16 video clips 3x16x112x112, batch 32", 32, 32 * (_CLIP_F16 + 8),
             128 * _CLIP_F16, lambda: _clips(128, (3, 16, 112, 112), torch.float16, 23)),
    Workload("token_windows", "int32 token windows of 4096 tokens (input_ids, attention_mask, "
             "labels), batch 16", 16, 16 * _WINDOW, 1024 * _WINDOW,
             lambda: TokenWindows(1024, 4096)),
]}


def arena_bytes(w: Workload, workers: int, depth: int) -> int:
    """An arena that holds every batch in flight: those the workers have ready
    (zero-copy), the Loader's queue, the consumer's, those the GPU still reads."""
    return max(256 * MB, -(-w.batch_bytes * (2 * workers + depth + 6) // MB) * MB)


def copy_arena_bytes(w: Workload, depth: int) -> int:
    """The copy paths' arena: the Loader's queue, the consumer's batch, those the
    GPU still reads (zero-copy's grows by the workers' batches: compare())."""
    return max(256 * MB, -(-w.batch_bytes * (depth + 4) // MB) * MB)


def case_room(w: Workload, workers: int, depth: int, target: Optional[Any]) -> Optional[str]:
    """Why this machine cannot hold the case, or None."""
    arena = arena_bytes(w, workers, depth)
    need = w.dataset_bytes + arena + w.batch_bytes * (2 * workers + depth + 4)
    avail = available_memory()
    if need > 0.85 * avail:
        return f"too little memory: needs about {gb(need)}, {gb(avail)} available"
    if workers:
        shm = w.batch_bytes * (2 * workers + 2)
        free = shm_free()
        if shm > free:
            return (f"too little shared memory: DataLoader workers pass batches through /dev/shm, "
                    f"about {gb(shm)} needed, {gb(free)} free")
    if target is not None:
        free, _ = torch.cuda.mem_get_info(target)
        gneed = w.batch_bytes * (depth + 6)
        if gneed > 0.9 * free:
            return f"too little GPU memory: needs about {gb(gneed)}, {gb(free)} free"
    return None


def run_case(w: Workload, *, workers: int, batches: int, warmup: int, device: Any,
             compute_ms: float, paths: Optional[Sequence[str]], depth: int = 2,
             progress: Any = True, max_seconds: Optional[float] = None,
             min_seconds: float = MIN_SECONDS, rounds: int = 1) -> Results:
    """One workload case through every path; the case is skipped (all rows, with
    the reason) when this machine has too little memory for it. progress: as
    compare() takes it (a bool, or the Progress of a whole suite); rounds: as
    compare() takes it."""
    target, host_reason = target_of(device)
    title = f"{w.title}, {workers_label(workers)}"
    why = case_room(w, workers, depth, target)
    if why is not None:
        rows = [Row(p, status="skipped", reason=why) for p in (paths or PATHS)]
        if isinstance(progress, Progress):
            runnable = [p for p in (paths or PATHS) if why_not(p, target, host_reason) is None]
            progress.skip(rounds * len(runnable) * (1 + warmup + batches))
            progress.note(f"{w.name}: skipped: {why}")
        return Results(rows=rows, name=w.name, title=title, device=str(target or "host"),
                       workers=workers, batches=batches, warmup=warmup, compute_ms=compute_ms,
                       rounds=rounds, notes=[f"case skipped: {why}"])
    dataset = w.make()
    try:
        res = compare(w.factory(dataset, workers), paths=paths, batches=batches,
                      warmup=warmup, device=device, compute_ms=compute_ms,
                      capacity=copy_arena_bytes(w, depth), batch_bytes=w.batch_bytes,
                      depth=depth, progress=progress, name=w.name, title=title,
                      max_seconds=max_seconds, min_seconds=min_seconds, rounds=rounds)
    finally:
        del dataset
        gc.collect()
    res.workers = workers
    return res
