"""Main-process CPU of one zero-copy recsys batch (a dict of 50 tensors, 4096 rows),
without workers: unpickling what a worker ships (adoption included), then making
its host views; thread CPU per batch and per leaf (4 rounds of 100 batches after
one not counted). With --device: device mode's views of one buffer of the
block's bytes instead (a CPU tensor: no GPU needed). Runs against whichever
fastpin is importable, also one from before the layout record (its _pack gave
(block, tree)), put first on PYTHONPATH:

    python benchmarks/zero_copy_unpack.py [--device]
"""
import gc
import pickle
import sys
import time

import torch

from fastpin import _C, _zerocopy

LEAVES = 50


def _batch() -> dict:
    out = {f"cat_{k}": torch.arange(4096, dtype=torch.int64) * (k + 1) for k in range(40)}
    out.update({f"dense_{k}": torch.arange(4096 * 16, dtype=torch.float32).reshape(4096, 16) + k
                for k in range(9)})
    out["label"] = torch.arange(4096, dtype=torch.float32) + 0.5
    return out


def _ship(batch, arena) -> bytes:
    """What a worker puts on the result queue for `batch`."""
    block, *layout = _zerocopy._pack(batch, arena)
    layout = layout if len(layout) > 1 else layout[0]  # before the record: (block, tree)
    return pickle.dumps(_zerocopy._Shipped(arena.token, block.index, block.nbytes, layout, block))


def host(batch, arena) -> None:
    n, unpickled, made = 100, 0.0, 0.0
    for r in range(5):
        payloads = [_ship(batch, arena) for _ in range(n)]
        t0 = time.thread_time()
        adopted = [pickle.loads(p) for p in payloads]
        t1 = time.thread_time()
        outs = [_zerocopy.receive(a)[0] for a in adopted]
        t2 = time.thread_time()
        assert all(torch.equal(o[k], batch[k]) for o in outs[:3] for k in batch)
        if r:
            unpickled, made = unpickled + t1 - t0, made + t2 - t1
        del outs, adopted, payloads
        gc.collect()
        arena.collect()
    n *= 4
    both = (unpickled + made) / n
    print(f"shipped {len(_ship(batch, arena))} bytes; unpickle+adopt {unpickled / n * 1e6:6.1f} "
          f"us/batch; views {made / n * 1e6:6.1f} us/batch ({made / n / LEAVES * 1e6:.2f} "
          f"us/leaf); both {both * 1e6:6.1f} us/batch, {both / LEAVES * 1e6:.2f} us/leaf")


def device(batch, arena) -> None:
    adopted = pickle.loads(_ship(batch, arena))
    block = adopted.block
    buffer = torch.from_dlpack(block.dlpack(0, (block.nbytes,), (1,), 1, 8, 1))
    out = _zerocopy.device_views(adopted, buffer)
    assert all(torch.equal(out[k], batch[k]) for k in batch)
    n = 300
    for _ in range(2):  # the first round warms up
        t0 = time.thread_time()
        for _ in range(n):
            _zerocopy.device_views(adopted, buffer)
        dt = (time.thread_time() - t0) / n
    print(f"device_views {dt * 1e6:6.1f} us/batch ({dt / LEAVES * 1e6:.2f} us/leaf)")


def main() -> None:
    arena = _C.Arena(512 << 20, shared=True, cuda=False)
    _zerocopy.register(arena)
    (device if "--device" in sys.argv else host)(_batch(), arena)


if __name__ == "__main__":
    main()
