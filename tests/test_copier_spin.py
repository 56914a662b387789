"""The copy pool's spinning workers (_C.set_spin) and its run-time cut-overs
(_C.set_copy_tuning, fastpin._pin.tune_copy): pin_memory of batches whose
bytes lie just below, at and above every cut-over of the pool, from several
Python threads at once, with spin off and on; every byte checked. Never more
threads spin than the machine has cores. Neither is yet a user setting; these
tests put them back as they found them."""
from __future__ import annotations

import threading

import pytest
import torch

import fastpin
from fastpin import _C, _pin
from conftest import assert_same, patterned, run_threads, shares_memory

KiB, MiB = 1 << 10, 1 << 20
# The pool's cut-overs (csrc/fastpin.h): the smallest chunk while workers spin,
# the smallest run shared with spinners, the inline threshold (and the
# smallest chunk otherwise), the largest chunk, streaming stores.
CUTS = [64 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB]
SIZES = sorted({cut + d for cut in CUTS for d in (-1, 0, 1)})
SPINS = [0, 20_000, 2_000_000]


@pytest.fixture
def spin_off():
    assert _C.get_spin() == 0
    yield
    _C.set_spin(0)


def _batch(nbytes: int, seed: int, shape: int):
    """A batch of `nbytes` in all: one leaf, or a dict of an image-like leaf,
    an int64 label and a 3-byte tail, so a run spans entries."""
    if shape == 0:
        return patterned((nbytes,), torch.uint8, seed)
    tail = 3
    labels = 8 * 16
    return {"x": patterned((nbytes - labels - tail,), torch.uint8, seed),
            "y": patterned((16,), torch.int64, seed + 1),
            "t": patterned((tail,), torch.uint8, seed + 2)}


def _check(out, ref):
    if isinstance(ref, dict):
        assert out.keys() == ref.keys()
        for k in ref:
            _check(out[k], ref[k])
        return
    assert_same(out, ref)
    assert not shares_memory(out, ref)


def test_default_is_off():
    assert _C.get_spin() == 0


@pytest.mark.parametrize("spin", SPINS)
def test_sizes_around_cut_overs_from_four_threads(spin_off, spin):
    _C.set_spin(spin)
    assert _C.get_spin() == spin
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        start.wait()
        for rep in range(2):
            for i, nbytes in enumerate(SIZES):
                # A large batch first, so pool threads have just copied
                # (and spin, when on) as the batch under test comes.
                seed = (t << 20) + (rep << 10) + i * 4 + spin % 7
                warm = patterned((2 * MiB + 1,), torch.uint8, seed + 3)
                batch = _batch(nbytes, seed, (i + t + rep) % 2)
                out_warm = fastpin.pin_memory(warm)
                out = fastpin.pin_memory(batch)
                _check(out_warm, warm)
                _check(out, batch)

    run_threads(worker, 4)


def _pin_while(sizes: list, stride: int, change) -> None:
    """Four threads pin batches of `sizes` (each checked) while change(i) runs
    for i = 0, 1, ... until it returns False; then they stop, and none may have
    hung or seen a wrong byte."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def pinner(t: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                nbytes = sizes[(i * stride + t) % len(sizes)]
                batch = _batch(nbytes, (t << 24) + i, i % 2)
                _check(fastpin.pin_memory(batch), batch)
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pinner, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        i = 0
        while change(i):
            threading.Event().wait(0.005)
            i += 1
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a pinning thread hung"
    assert not errors, errors[0]


def test_spin_changed_while_threads_pin(spin_off):
    def change(i: int) -> bool:
        _C.set_spin([0, 50_000, 1_000, 5_000_000][i % 4])
        return i < 59

    _pin_while(SIZES, 5, change)


def test_spin_survives_a_new_pool(spin_off):
    threads = _C.get_threads()
    _C.set_spin(30_000)
    try:
        _C.set_threads(3)
        assert _C.get_threads() == 3
        assert _C.get_spin() == 30_000
        batch = _batch(1 * MiB + 1, 11, 1)
        _check(fastpin.pin_memory(batch), batch)
    finally:
        _C.set_threads(0 if threads == min(_C.cpu_count(), 16) else threads)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (10_000_001, ValueError),
                                      (2**64, ValueError), (True, TypeError),
                                      (1.5, TypeError), ("1", TypeError)])
def test_bad_spin(spin_off, bad, exc):
    with pytest.raises(exc, match="spin"):
        _C.set_spin(bad)
    assert _C.get_spin() == 0


# ---- never more spinning threads than cores -------------------------------------

def test_default_never_spins_more_threads_than_cores():
    t = _pin.copy_tuning()
    assert t["spinners"] + 1 <= _C.cpu_count(), t
    assert t["spinners"] <= t["threads"] - 1


def test_a_pool_larger_than_the_machine_spins_no_more_than_its_cores(spin_off):
    threads = _C.get_threads()
    cpus = _C.cpu_count()
    try:
        _C.set_threads(2 * cpus + 1)
        _C.set_spin(2_000_000)
        assert _C.get_threads() == 2 * cpus + 1
        assert _pin.copy_tuning()["spinners"] == cpus - 1
        batch = _batch(4 * MiB + 5, 21, 1)
        _check(fastpin.pin_memory(batch), batch)
    finally:
        _C.set_threads(0 if threads == min(cpus, 16) else threads)


def test_pinned_to_one_cpu_the_pool_never_spins(spin_off):
    _C.set_spin(2_000_000)
    try:
        _C.set_affinity([0])
        assert _pin.copy_tuning()["spinners"] == 0
        batch = _batch(3 * MiB + 1, 22, 1)
        _check(fastpin.pin_memory(batch), batch)
    finally:
        _C.set_affinity(None)
    assert _pin.copy_tuning()["spinners"] == min(_C.cpu_count(), _C.get_threads()) - 1


# ---- cut-overs set at run time -----------------------------------------------------

@pytest.fixture
def knobs_kept():
    before = _pin.copy_tuning()
    yield
    _pin.tune_copy(**{k: before[k] for k in _pin.COPY_KEYS})


# What the measurements try: the pool from the smallest batch, the caller alone to
# 8 MiB with spinners sharing from 64 KiB, streaming from 64 KiB, the smallest
# chunks, torch's copy_ over the middle sizes.
TUNINGS = [
    dict(inline_max=0, inline_spin=0, stream_min=0, chunk_min=4 * KiB, chunk_max=64 * KiB,
         chunk_min_spin=4 * KiB),
    dict(inline_max=8 * MiB, inline_spin=64 * KiB, stream_min=1 * MiB, chunk_min=256 * KiB,
         chunk_max=4 * MiB, chunk_min_spin=16 * KiB),
    dict(inline_max=2 * MiB, inline_spin=1 * MiB, stream_min=64 * KiB, chunk_min=128 * KiB,
         chunk_max=512 * KiB, chunk_min_spin=32 * KiB, torch_copy=(512 * KiB, 2 * MiB)),
]


def _cuts(t: dict) -> list:
    sizes = [v for k, v in t.items() if k != "torch_copy"] + list(t.get("torch_copy", ()))
    return sorted({n + d for n in sizes for d in (-1, 0, 1) if n + d > 200})


@pytest.mark.parametrize("spin", [0, 50_000])
@pytest.mark.parametrize("which", range(len(TUNINGS)))
def test_tuned_cut_overs_from_six_threads(knobs_kept, spin, which):
    tuning = dict(TUNINGS[which], spin_ns=spin, streaming=which % 2 == 0)
    _pin.tune_copy(**tuning)
    sizes = _cuts(TUNINGS[which])
    start = threading.Barrier(6)

    def worker(t: int) -> None:
        start.wait()
        for i, nbytes in enumerate(sizes):
            seed = (t << 20) + (which << 12) + i * 4 + spin % 5
            batch = _batch(nbytes, seed, (i + t) % 2)
            _check(fastpin.pin_memory(batch), batch)

    run_threads(worker, 6)


def test_the_default_cut_overs_from_six_threads(knobs_kept):
    """The cut-overs pin_memory uses as shipped (the ends of torch's copy_ span
    where this machine gives the calling thread several torch threads, the
    pool's own), batches just below, at and above each from six threads at
    once, every byte checked. Those past 64 MiB (streaming's start, at half the
    last-level cache) are left to the C tests' tuned sizes: six threads of
    them would hold gigabytes."""
    t = _pin.copy_tuning()
    assert t["spin_ns"] == 0 and t["torch_copy"] == (256 * KiB, 16 * MiB)
    shipped = {k: t[k] for k in (*_pin._POOL_SIZES, "torch_copy")}
    sizes = [n for n in _cuts(shipped) if n <= 64 * MiB]
    assert 16 * MiB + 1 in sizes and 256 * KiB - 1 in sizes
    start = threading.Barrier(6)

    def worker(k: int) -> None:
        start.wait()
        for i, nbytes in enumerate(sizes[k % 2::2] + sizes[(k + 1) % 2::2]):
            batch = _batch(nbytes, (k << 20) + i, (i + k) % 2)
            _check(fastpin.pin_memory(batch), batch)

    run_threads(worker, 6)


def test_tuning_changed_while_threads_pin(knobs_kept):
    sizes = sorted({n for t in TUNINGS for n in _cuts(t)})
    default = {k: v for k, v in _pin.copy_tuning().items() if k in _pin.COPY_KEYS}

    def change(i: int) -> bool:
        _pin.tune_copy(**dict((TUNINGS + [default])[i % 4], spin_ns=[0, 50_000][i % 2]))
        return i < 39

    _pin_while(sizes, 7, change)


def test_set_copy_tuning_refuses_and_keeps(knobs_kept):
    before = _C.copy_tuning()
    for bad, exc in [(dict(chunk_min=4095), ValueError), (dict(chunk_max=1), ValueError),
                     (dict(inline_max=-1), ValueError), (dict(inline_max=2**41), ValueError),
                     (dict(chunk_min_spin=64 * MiB), ValueError), (dict(inline=1), TypeError),
                     (dict(stream_min=1.5), TypeError)]:
        with pytest.raises(exc):
            _C.set_copy_tuning(**bad)
        assert _C.copy_tuning() == before
    with pytest.raises(TypeError, match="keyword"):
        _C.set_copy_tuning(1)


# ---- where streaming stores start -------------------------------------------------

def _fake_cache(root, cpu: int, index: int, level: int, kind: str, size: str, shared: str):
    d = root / f"sys/devices/system/cpu/cpu{cpu}/cache/index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size),
                        ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_the_last_level_cache_is_summed_over_distinct_caches(tmp_path, monkeypatch):
    """Two core complexes of 32 MiB each, their CPUs interleaved (each CPU's
    highest level; instruction caches and lower levels left out), are 64 MiB;
    nothing readable is None."""
    monkeypatch.setattr(_pin.os, "sched_getaffinity", lambda pid: set(range(6)))
    for cpu in range(6):
        _fake_cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        _fake_cache(tmp_path, cpu, 1, 1, "Instruction", "4096K", str(cpu))
        _fake_cache(tmp_path, cpu, 2, 2, "Unified", "2048K", str(cpu))
        _fake_cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1,4" if cpu in (0, 1, 4)
                    else "2-3,5")
    assert _pin.llc_bytes(str(tmp_path)) == 64 * MiB
    assert _pin.llc_bytes(str(tmp_path / "nowhere")) is None


def test_streaming_stores_start_where_a_copy_passes_the_last_level_cache():
    """Measured on the H100 and H200 machines (300 MiB of last-level cache):
    streaming stores slowed cache-cold copies of 32-128 MiB to 0.66-0.84x, and
    paid from 256 MiB, where source and destination together pass the cache."""
    if _pin._stream_min_given is not None:
        pytest.skip("FASTPIN_COPY sets stream_min")
    assert _C.copy_tuning()["stream_min"] == max(4 * MiB, (_pin.llc_bytes() or 0) // 2)


class _StreamMin(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([i, _C.copy_tuning()["stream_min"], _C.get_threads()])


def test_a_zero_copy_worker_streams_from_4_mib_on_one_thread():
    """15 workers packing at once are bound by memory bandwidth, where
    streaming stores won (52 against 40 GB/s delivered): the workers keep
    them from 4 MiB whatever the main process uses."""
    dl = torch.utils.data.DataLoader(_StreamMin(), batch_size=4, num_workers=1,
                                     multiprocessing_context="fork")
    batches = [b.clone() for b in fastpin.Loader(dl, device=None, zero_copy=True)]
    assert [b[:, 0].tolist() for b in batches] == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    # Samples of later batches are read after the worker packed its first.
    expected = _pin.WORKER_STREAM_MIN if _pin._stream_min_given is None else _pin._stream_min_given
    assert {tuple(row[1:].tolist()) for b in batches[1:] for row in b} == {(expected, 1)}
