"""Zero-copy with default settings against a hand-sized arena, delivered GB/s.

    python benchmarks/zero_copy_default.py [--workers 15] [--batches 150]

The bench's in-memory uint8 images (3x224x224, batch 256); each Loader runs
`--batches` batches to the GPU after 10 untimed, the two alternated twice."""
import argparse
import time

import torch

import fastpin
from fastpin import _zerocopy


def images(n):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g)


class Data(torch.utils.data.Dataset):
    def __init__(self, x, batches):
        self.x, self.batches = x, batches

    def __len__(self):
        return self.batches * 256  # batches of 256, cycling over x

    def __getitem__(self, i):
        return self.x[i % len(self.x)]


def run(dl, batches, **kw):
    loader = fastpin.Loader(dl, device="cuda", zero_copy=True, **kw)
    it = iter(loader)
    for _ in range(10):
        next(it)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    for _ in range(batches):
        b = next(it)
        nbytes += b.numel()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    fallbacks = loader.stats()["fallbacks"]
    del it, loader
    return nbytes / dt / 1e9, fallbacks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--batches", type=int, default=150)
    a = p.parse_args()
    ds = Data(images(512), a.batches + 10 + 2 * a.workers)  # the timed ones and more
    dl = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=a.workers)
    need = _zerocopy.capacity_for(dl, 256 * 3 * 224 * 224, 2)
    for r in range(2):
        for name, kw in (("default", {}), ("hand-sized", {"capacity": need})):
            gbps, fb = run(dl, a.batches, **kw)
            print(f"round {r + 1} {name:>10}: {gbps:6.1f} GB/s, {fb} fallbacks")


if __name__ == "__main__":
    main()
