"""GPU behaviour: page-locked results, asynchronous copies, no reuse while a
copy reads a block. Skipped where no GPU is present."""
import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C
from conftest import sleep_cycles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (fastpin.cuda_available() and torch.cuda.is_available()),
                       reason="needs a CUDA GPU"),
]

MB = 1 << 20


def patterned(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_results_are_page_locked():
    batch = {"x": patterned(3 * MB, 1).view(3, MB), "a": np.arange(1000, dtype=np.float32) + 1}
    pinned = fastpin.pin_memory(batch)
    assert fastpin.default_arena().registered
    assert pinned["x"].is_pinned()
    assert torch.from_numpy(pinned["a"]).is_pinned()
    assert torch.equal(pinned["x"], batch["x"])


def test_pinned_leaves_come_back_unchanged_by_the_drivers_answer():
    """pin_batch asks the driver (not tensor.is_pinned()) whether a leaf is
    pinned: torch's pinned tensors and fastpin's own come back as they are,
    pageable ones are copied; so in one batch, with their views intact."""
    pageable = patterned(1 * MB, 3)
    by_torch = patterned(1 * MB, 4).pin_memory()
    by_fastpin = fastpin.pin_memory(patterned(1 * MB, 5))
    offset_view = by_torch[17:]
    out = fastpin.pin_memory([pageable, by_torch, by_fastpin, offset_view])
    assert out[0] is not pageable and out[0].is_pinned() and torch.equal(out[0], pageable)
    assert out[1] is by_torch and out[2] is by_fastpin and out[3] is offset_view
    assert fastpin.stats()["bytes"] >= pageable.nbytes


def test_current_device_follows_torch():
    assert _C.current_device() in (-1, torch.cuda.current_device())
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    assert _C.current_device() == torch.cuda.current_device()
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            torch.zeros(1, device="cuda:1")
            assert _C.current_device() == 1


def test_non_blocking_copy_is_asynchronous_and_correct():
    src = patterned(64 * MB, 2)
    pinned = fastpin.pin_memory(src)
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(sleep_cycles(300))
    on_gpu = pinned.to("cuda", non_blocking=True)
    # Had the copy been synchronous, the sleep before it would be over too.
    assert not stream.query(), "the copy waited for the GPU: it was not asynchronous"
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), src)


@pytest.mark.parametrize("tight", [False, True], ids=["roomy-arena", "one-batch-arena"])
def test_block_not_reused_while_a_copy_reads_it(tight):
    """Queue a long kernel, then the copy, drop the pinned tensor, pin a new
    batch with another pattern at once: the GPU must get the first pattern.
    In a one-batch arena the second pin must wait for the copy's event."""
    nbytes = 32 * MB
    arena = _C.Arena(nbytes if tight else 8 * nbytes)
    first, second = patterned(nbytes, 3), patterned(nbytes, 4)
    assert not torch.equal(first, second)
    for _ in range(5):
        pinned = fastpin.pin_memory(first, arena=arena)
        torch.cuda._sleep(sleep_cycles(100))
        on_gpu = pinned.to("cuda", non_blocking=True)
        del pinned
        again = fastpin.pin_memory(second, arena=arena)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), first), "a block was reused while a copy read it"
        assert torch.equal(again, second)
        del again, on_gpu
    stats = arena.stats()
    if tight:
        assert stats["waits"] >= 1
    assert stats["blocks_in_use"] == 0


@pytest.mark.parametrize("take", ["pin_memory", "alloc"])
def test_waiting_for_room_lets_other_threads_run(take):
    """A block is taken with the GIL held unless only the GPU's copies hold the
    room: then pin_memory (and Arena.alloc) waits for them with it let go, and
    the program's other Python threads run meanwhile."""
    import threading
    import time

    nbytes = 32 * MB
    arena = _C.Arena(nbytes)
    first, second = patterned(nbytes, 5), patterned(nbytes, 6)
    pinned = fastpin.pin_memory(first, arena=arena)
    torch.cuda._sleep(sleep_cycles(300))  # the copy starts after about 0.3 s
    on_gpu = pinned.to("cuda", non_blocking=True)
    del pinned
    ticks, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        # Waits for the copy's fence.
        again = (fastpin.pin_memory(second, arena=arena) if take == "pin_memory"
                 else arena.alloc(nbytes))
        t1 = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    assert arena.stats()["waits"] >= 1
    assert sum(t0 < t < t1 for t in ticks) >= 10, f"{take} held the GIL while it waited"
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), first)
    if take == "pin_memory":
        assert torch.equal(again, second)


def test_side_stream_consumer():
    """Copies on a stream of the user's own are waited for when named."""
    nbytes = 16 * MB
    arena = _C.Arena(nbytes)
    side = torch.cuda.Stream()
    first, second = patterned(nbytes, 5), patterned(nbytes, 6)
    with torch.cuda.stream(side):
        pinned = fastpin.pin_memory(first, arena=arena, stream=side)
        torch.cuda._sleep(sleep_cycles(100))
        on_gpu = pinned.to("cuda", non_blocking=True)
    del pinned
    fastpin.pin_memory(second, arena=arena)
    side.synchronize()
    assert torch.equal(on_gpu.cpu(), first)


def test_many_batches_patterns_exact():
    tensors = []
    for i in range(200):
        src = {"img": patterned(MB + 4096 * i, 100 + i), "label": torch.arange(i + 1)}
        p = fastpin.pin_memory(src)
        tensors.append((src, p["img"].to("cuda", non_blocking=True),
                        p["label"].to("cuda", non_blocking=True)))
        del p
    torch.cuda.synchronize()
    for src, img, label in tensors:
        assert torch.equal(img.cpu(), src["img"])
        assert torch.equal(label.cpu(), src["label"])


# ---- fastpin.Loader on the GPU ---------------------------------------------

def _batches(n, seed0, big=False):
    """Patterned nested batches; `big` adds a leaf larger than one staging chunk."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed0 + i)
        b = {
            "img": torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g),
            "f": (torch.randn(7, 5, generator=g).double(), torch.randn(3, generator=g).half()),
            "small": [torch.tensor([seed0 + i, j]) for j in range(20)],
            "label": seed0 + i,
        }
        if big:
            b["huge"] = torch.randint(-2**31, 2**31 - 1, (20 << 20,), dtype=torch.int32, generator=g)
        out.append(b)
    return out


def _equal_nested(gpu, cpu):
    if isinstance(cpu, torch.Tensor):
        assert gpu.is_cuda and gpu.dtype == cpu.dtype and torch.equal(gpu.cpu(), cpu)
    elif isinstance(cpu, dict):
        assert gpu.keys() == cpu.keys()
        for k in cpu:
            _equal_nested(gpu[k], cpu[k])
    elif isinstance(cpu, (list, tuple)):
        assert type(gpu) is type(cpu) and len(gpu) == len(cpu)
        for a, b in zip(gpu, cpu):
            _equal_nested(a, b)
    else:
        assert gpu == cpu


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_loader_exact_never_stale(depth):
    """Hundreds of batches, each freed at once while the next copies run."""
    src = _batches(300, 1000 * depth)
    for cpu, gpu in zip(src, fastpin.Loader(src, device="cuda", depth=depth)):
        torch.cuda._sleep(sleep_cycles(0.2))  # the consumer is busy; copies run ahead
        _equal_nested(gpu, cpu)
        del gpu


def test_loader_consumer_on_its_own_stream():
    src = _batches(100, 7)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        results = []
        for gpu in fastpin.Loader(src, device="cuda"):
            torch.cuda._sleep(sleep_cycles(0.5))
            results.append(gpu["img"].float().sum().item())
    for cpu, total in zip(src, results):
        assert total == cpu["img"].float().sum().item()


def test_loader_huge_leaf_and_pinned_leaves():
    src = _batches(6, 99, big=True)
    pinned = [fastpin.pin_memory(b) for b in src[:3]] + [
        {k: (v.pin_memory() if k == "img" else v) for k, v in b.items()} for b in src[3:]]
    for cpu, gpu in zip(src, fastpin.Loader(pinned, device="cuda")):
        _equal_nested(gpu, cpu)


def test_loader_pinned_host_mode():
    src = _batches(50, 5)
    for cpu, host in zip(src, fastpin.Loader(src, device=None)):
        assert host["img"].is_pinned()
        torch.cuda._sleep(sleep_cycles(0.2))
        on_gpu = host["img"].to("cuda", non_blocking=True)
        del host
        assert torch.equal(on_gpu.cpu(), cpu["img"])


def test_loader_with_dataloader_workers():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (512, 3, 64, 64), dtype=torch.uint8, generator=g)
    labels = torch.arange(512)
    loader = fastpin.Loader(DataLoader(TensorDataset(data, labels), batch_size=32, num_workers=2))
    for _ in range(2):
        seen = 0
        for x, y in loader:
            assert x.is_cuda and torch.equal(x.cpu(), data[y.cpu()])
            seen += len(y)
        assert seen == 512


# ---- zero-copy mode on the GPU ----------------------------------------------

class _ZCImages(torch.utils.data.Dataset):
    def __len__(self):
        return 160

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"img": torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g),
                "x": torch.randn(17, generator=g), "label": i}


def _zc_expected(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g), torch.randn(17, generator=g)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_zero_copy_to_device_exact(method):
    from torch.utils.data import DataLoader

    dl = DataLoader(_ZCImages(), batch_size=16, num_workers=2, multiprocessing_context=method)
    loader = fastpin.Loader(dl, device="cuda", zero_copy=True, capacity=64 * MB)
    assert loader.arena.registered
    for _ in range(2):
        seen = []
        for batch in loader:
            torch.cuda._sleep(sleep_cycles(0.3))
            assert batch["img"].is_cuda and batch["x"].is_cuda
            for img, x, i in zip(batch["img"].cpu(), batch["x"].cpu(), batch["label"].cpu().tolist()):
                ref_img, ref_x = _zc_expected(i)
                assert torch.equal(img, ref_img) and torch.equal(x, ref_x)
                seen.append(i)
            del batch
        assert seen == list(range(160))
    assert loader.stats()["worker_fallbacks"] == 0


def test_zero_copy_host_batches_are_pinned_and_in_the_arena():
    from torch.utils.data import DataLoader

    dl = DataLoader(_ZCImages(), batch_size=16, num_workers=2)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=64 * MB)
    arena = loader.arena
    for batch in loader:
        img = batch["img"]
        assert img.is_pinned()
        assert arena.base <= img.data_ptr() < arena.base + arena.capacity
        torch.cuda._sleep(sleep_cycles(0.2))
        on_gpu = img.to("cuda", non_blocking=True)
        labels = batch["label"].tolist()
        del batch, img
        for row, i in zip(on_gpu.cpu(), labels):
            assert torch.equal(row, _zc_expected(i)[0])


def test_attached_worker_prefaults_the_registered_arena():
    """Registration made every page resident: an attached process maps them all
    at once (no allocation), and writes through that mapping reach the creator."""
    import os

    arena = _C.Arena(16 * MB, shared=True)
    assert arena.registered
    other = _C.Arena.attach(arena.fd)
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    assert other.prefault() == (release >= (5, 14))
    assert not arena.prefault()  # the creator's own mapping is resident already
    src = patterned(MB, 9)
    block, (offset,) = other.pin([(src.data_ptr(), src.numel())])
    index, nbytes = block.index, block.nbytes
    block.detach()
    mine = arena.adopt(index, nbytes)
    got = torch.from_dlpack(mine.dlpack(offset, (MB,), (1,), 1, 8, 1))
    assert torch.equal(got, src)


def test_loader_stages_through_an_arena_smaller_than_a_chunk():
    """A 2 MiB arena stages in quarter-arena chunks: a 9 MiB leaf still arrives."""
    src = [{"big": patterned(9 * MB, 20 + i), "i": torch.tensor([i])} for i in range(6)]
    loader = fastpin.Loader(src, device="cuda", arena=_C.Arena(2 * MB))
    for cpu, gpu in zip(src, loader):
        torch.cuda._sleep(sleep_cycles(0.5))
        assert torch.equal(gpu["big"].cpu(), cpu["big"]) and int(gpu["i"]) == int(cpu["i"])


class _MixedSamples(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(500 + i)
        rng = np.random.default_rng(500 + i)
        return {
            "u8": torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=g),
            "f16": torch.randn(3, generator=g).half(),
            "bool": torch.rand(9, generator=g) > 0.5,
            "c64": torch.randn(2, 2, generator=g, dtype=torch.complex64),
            "np_i16": rng.integers(-30000, 30000, size=(4, 3), dtype=np.int16),
            "np_f64": rng.standard_normal(6),
            "empty": torch.empty(0, 3),
            "name": f"sample-{i}",
            "i": i,
        }


def _mixed_collate(samples):
    """A collate of the user's own: NumPy leaves stay arrays (stacked here)."""
    out = {k: torch.stack([s[k] for s in samples]) for k in ("u8", "f16", "bool", "c64", "empty")}
    out.update({k: np.stack([s[k] for s in samples]) for k in ("np_i16", "np_f64")})
    out["name"] = [s["name"] for s in samples]
    out["i"] = torch.tensor([s["i"] for s in samples])
    return out


def test_zero_copy_device_mode_every_leaf_kind():
    """One copy per block, leaves as views: dtypes of every width, NumPy leaves
    (arriving as device tensors, as the copy path gives them), zero-size leaves,
    strings passing through."""
    from torch.utils.data import DataLoader

    dataset = _MixedSamples()
    dl = DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=_mixed_collate)
    loader = fastpin.Loader(dl, device="cuda", zero_copy=True, capacity=32 * MB)
    seen = 0
    for batch in loader:
        torch.cuda._sleep(sleep_cycles(0.3))
        idx = batch["i"].cpu().tolist()
        want = _mixed_collate([dataset[i] for i in idx])
        assert batch["name"] == want["name"]
        for k in ("u8", "f16", "bool", "c64", "empty", "np_i16", "np_f64"):
            got, ref = batch[k], want[k]
            ref = torch.from_numpy(ref) if isinstance(ref, np.ndarray) else ref
            assert got.is_cuda and got.dtype == ref.dtype and got.shape == ref.shape, k
            assert torch.equal(got.cpu(), ref), k
        seen += len(idx)
        del batch
    assert seen == len(dataset)
    assert loader.stats()["worker_fallbacks"] == 0


def _grad_channels_last_collate(samples):
    x = torch.stack([s["u8"] for s in samples]).unsqueeze(1).repeat(1, 3, 1, 1)  # N, 3, 5, 7
    return {"cl": x.to(memory_format=torch.channels_last),
            "w": torch.stack([s["f16"] for s in samples]).float().requires_grad_(),
            "i": torch.tensor([s["i"] for s in samples])}


def test_zero_copy_device_mode_channels_last_and_requires_grad():
    """Device views keep a dense permuted layout's strides and requires_grad."""
    from torch.utils.data import DataLoader

    dataset = _MixedSamples()
    dl = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=_grad_channels_last_collate)
    loader = fastpin.Loader(dl, device="cuda", zero_copy=True, capacity=32 * MB)
    for batch in loader:
        want = _grad_channels_last_collate([dataset[i] for i in batch["i"].cpu().tolist()])
        assert batch["cl"].is_cuda and batch["cl"].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(batch["cl"].cpu(), want["cl"])
        assert batch["w"].requires_grad and torch.equal(batch["w"].detach().cpu(), want["w"].detach())
    assert loader.stats()["worker_fallbacks"] == 0
