"""fastpin.pin_memory's common call (no arena, device None or "cuda", no
on_full) through _C.pin_default: the default arena of the current device as
the Python layer last found it, forgotten wherever what it read changes."""
from __future__ import annotations

import collections
import os

import pytest
import torch

import fastpin
from conftest import assert_same, in_arena, patterned
from fastpin import _C, _pin


def batch(seed: int, nbytes: int = 4096) -> dict:
    return {"x": patterned((nbytes // 4,), torch.float32, seed=seed),
            "y": [patterned((3, 5), torch.int64, seed=seed + 1)]}


@pytest.fixture
def fresh():
    """pin_memory starts from the Python path; the settings are put back after."""
    _pin.forget_default()
    yield
    fastpin.configure(capacity="auto")
    _pin.forget_default()


def test_the_second_call_is_one_c_call_into_the_default_arena(fresh):
    assert _C.pin_default(batch(0)) is None  # nothing remembered yet
    for seed in (0, 1):  # the first may make the arena; the one after it remembers it
        assert_same(fastpin.pin_memory(batch(seed)), batch(seed))
    again = _C.pin_default(batch(2))
    assert again is not None and again is not NotImplemented
    assert_same(again, batch(2))
    out = fastpin.pin_memory(batch(3), "cuda")  # what DataLoader passes
    assert_same(out, batch(3))
    for leaf in (again["x"], again["y"][0], out["x"]):
        assert in_arena(leaf, fastpin.default_arena())


def test_configure_forgets_the_arena(fresh):
    fastpin.pin_memory(batch(0))
    old = fastpin.default_arena()
    fastpin.configure(capacity=8 << 20)
    assert _C.pin_default(batch(1)) is None
    fastpin.pin_memory(batch(1))  # makes the new arena
    out = fastpin.pin_memory(batch(2))
    assert_same(out, batch(2))
    new = fastpin.default_arena()
    assert new is not old and in_arena(out["x"], new) and not in_arena(out["x"], old)
    assert _C.pin_default(batch(3)) is not None


def test_tune_copy_forgets_the_span(fresh):
    before = _pin.copy_tuning()
    fastpin.pin_memory(batch(0))
    try:
        _pin.tune_copy(torch_copy=None)
        assert _C.pin_default(batch(1)) is None
    finally:
        _pin.tune_copy(**{k: before[k] for k in _pin.COPY_KEYS})


def test_torch_copy_span_follows_the_threads_at_each_call(fresh):
    threads = torch.get_num_threads()
    x = patterned((256 << 10,), torch.uint8, seed=4)  # in the default span
    try:
        torch.set_num_threads(2)
        fastpin.pin_memory(x)
        for n, taken in ((2, True), (1, False), (2, True)):
            torch.set_num_threads(n)
            count = _C.pin_counts()[3]
            out = fastpin.pin_memory(x)
            assert_same(out, x)
            assert (_C.pin_counts()[3] > count) is taken
    finally:
        torch.set_num_threads(threads)


def test_a_full_segment_lets_the_python_path_grow_it(fresh):
    fastpin.pin_memory(batch(0))
    arena = fastpin.default_arena()
    big = patterned((arena.capacity // 4 + 1024,), torch.float32, seed=5)  # more than it holds
    held = [fastpin.pin_memory(batch(k)) for k in range(3)]
    out = fastpin.pin_memory(big)
    assert_same(out, big)
    assert in_arena(out, fastpin.default_arena())
    after = fastpin.pin_memory(batch(9))
    assert_same(after, batch(9))
    for k, h in enumerate(held):
        assert_same(h, batch(k))


def test_other_containers_and_policies_take_the_python_path(fresh):
    Pair = collections.namedtuple("Pair", "a b")
    fastpin.pin_memory(batch(0))
    pair = Pair(patterned((64,), torch.int32, seed=6), patterned((8,), torch.float64, seed=7))
    assert _C.pin_default(pair) is NotImplemented
    out = fastpin.pin_memory(pair)
    assert type(out) is Pair
    assert_same(out, pair)
    with pytest.raises(_C.ArenaFullError):
        fastpin.pin_memory(_too_big(), on_full="raise")


def _too_big():
    """A tensor over the default arena's cap, without the memory: an expanded view."""
    cap = fastpin.default_arena().cap
    return torch.zeros(1, dtype=torch.uint8).expand(cap + 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_a_forked_child_pins_into_its_own_arena(fresh):
    fastpin.pin_memory(batch(0))
    fastpin.pin_memory(batch(0))
    parent = fastpin.default_arena()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what it saw
        code = 1
        try:
            declined = _C.pin_default(batch(1)) is None
            out = fastpin.pin_memory(batch(1))
            ok = torch.equal(out["x"].view(torch.int32), batch(1)["x"].view(torch.int32))
            mine = fastpin.default_arena() is not parent and in_arena(
                out["x"], fastpin.default_arena())
            code = 0 if declined and ok and mine else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    code = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert code == b"\0"
