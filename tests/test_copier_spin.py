"""The copy pool's spinning workers (_C.set_spin, issue 25): pin_memory of
batches whose bytes lie just below, at and above every cut-over of the pool,
from 4 Python threads at once, with spin off and on; every byte checked. Spin
is not yet a user setting; these tests put it back to 0."""
from __future__ import annotations

import threading

import pytest
import torch

import fastpin
from fastpin import _C
from conftest import assert_same, patterned, shares_memory

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
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(t: int) -> None:
        try:
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
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a pinning thread hung"
    assert not errors, errors[0]


def test_spin_changed_while_threads_pin(spin_off):
    stop = threading.Event()
    errors: list[BaseException] = []

    def pinner(t: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                nbytes = SIZES[(i * 5 + t) % len(SIZES)]
                batch = _batch(nbytes, (t << 24) + i, i % 2)
                _check(fastpin.pin_memory(batch), batch)
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pinner, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        for i in range(60):
            _C.set_spin([0, 50_000, 1_000, 5_000_000][i % 4])
            threading.Event().wait(0.005)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a pinning thread hung"
    assert not errors, errors[0]


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
