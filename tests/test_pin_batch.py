"""pin_memory's C fast path (Arena.pin_batch): one C call per batch for plain
tensors and arrays, the same results as the Python pipeline (_leaves.Plan),
and None (nothing allocated) for every leaf it leaves to that pipeline."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import fastpin
from fastpin import _C, _pin
from fastpin._walk import flatten
from fastpin._leaves import is_leaf
from conftest import assert_same, in_arena, patterned

DTYPES = [d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                      torch.float16, torch.bfloat16, torch.float32, torch.float64,
                      torch.complex64, torch.complex128, torch.complex32, torch.uint16,
                      torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                      *[getattr(torch, f"{k}{b}") for k in ("uint", "int") for b in range(1, 8)
                        if hasattr(torch, f"{k}{b}")])]


def fast(leaves, arena, check_pinned=False):
    _pin._use_torch()
    return arena.pin_batch(list(leaves), check_pinned)


def planned(leaves, arena):
    spec, flat = flatten(list(leaves), is_leaf)
    return _pin._pin_planned(spec, flat, None, arena, "raise")


def shell(dtype, shape, seed):
    """A tensor of `dtype` with patterned bytes (dtypes torch cannot fill itself)."""
    size = torch.empty((), dtype=dtype).element_size()
    return patterned((*shape[:-1], shape[-1] * size), torch.uint8, seed).view(dtype)


def leaves_of_every_kind(seed):
    out = [shell(d, (3, 5), seed + i) for i, d in enumerate(DTYPES)]
    out += [patterned((4, 6), torch.float32, seed).t(),                     # dense, permuted
            patterned((2, 3, 4, 5), torch.float32, seed).to(memory_format=torch.channels_last),
            torch.empty(0, 3), patterned((), torch.int64, seed),             # empty, 0-d
            patterned((1, 7), torch.int32, seed).as_strided((1, 7), (99, 1)),  # odd size-1 stride
            patterned((5, 3), np.float64, seed), patterned((), np.int16, seed),
            np.zeros(0, np.float32),
            np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
            np.arange(12, dtype=">i4").reshape(3, 4)]                       # big-endian
    return out


def test_fast_path_gives_what_the_pipeline_gives(arena):
    leaves = leaves_of_every_kind(3)
    before = _C.pin_counts()
    outs = fast(leaves, arena)
    assert outs is not None, "every leaf here is one memcpy: the fast path takes the batch"
    assert _C.pin_counts()[0] == before[0] + 1
    ref = planned(leaves, arena)
    assert len(outs) == len(leaves) == len(ref)
    for i, (o, r, x) in enumerate(zip(outs, ref, leaves)):
        assert type(o) is type(r), i
        assert_same(o, x)
        if isinstance(x, torch.Tensor):
            assert o.stride() == r.stride(), (i, x.dtype)
            assert not o.requires_grad
        else:
            assert o.dtype == x.dtype and o.strides == r.strides and o.flags.writeable, i
        if o.nbytes:
            assert in_arena(o, arena), i
            assert o.data_ptr() % _C.GRANULE == 0 if isinstance(o, torch.Tensor) \
                else o.ctypes.data % _C.GRANULE == 0


def test_fast_path_outputs_are_copies(arena):
    x = patterned((64,), torch.int32, 1)
    a = patterned((64,), np.int32, 2)
    out_x, out_a = fast([x, a], arena)
    x_bytes, a_bytes = x.clone(), a.copy()
    x.add_(1)
    a += 1
    assert torch.equal(out_x, x_bytes) and np.array_equal(out_a, a_bytes)


@pytest.mark.parametrize("case", [
    "conj", "neg", "requires_grad", "gather", "fortran", "object", "subclass", "sparse",
    "nested", "masked", "int"])
def test_fast_path_leaves_these_to_the_pipeline(case, arena):
    z = patterned((3, 4), torch.complex64, 5)
    leaf = {
        "conj": lambda: z.conj(),
        "neg": lambda: z.conj().imag,
        "requires_grad": lambda: patterned((3,), torch.float32, 1).requires_grad_(),
        "gather": lambda: patterned((6, 6), torch.float32, 2)[::2, ::3],
        "fortran": lambda: np.asfortranarray(patterned((3, 4), np.float32, 3)),
        "object": lambda: np.array([object(), 1], dtype=object),
        "subclass": lambda: torch.nn.Parameter(patterned((3,), torch.float32, 4)),
        "sparse": lambda: patterned((3, 3), torch.float32, 6).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "masked": lambda: np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),
        "int": lambda: 7,
    }[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        x = leaf()
    plain = patterned((8,), torch.int64, 9)
    before = arena.stats()
    assert fast([plain, x], arena) is None
    after = arena.stats()
    assert (after["blocks_in_use"], after["bytes_in_use"]) == (before["blocks_in_use"],
                                                           before["bytes_in_use"])
    # ... and pin_memory still gives what the pipeline gives (one block, the same rules).
    out = fastpin.pin_memory([plain, x], arena=arena)
    assert_same(out[0], plain)


def test_fast_path_blocks_are_freed_when_the_views_die(arena):
    base = arena.stats()["blocks_in_use"]
    outs = fast([patterned((1000,), torch.float32, 1), patterned((7,), np.uint8, 2)], arena)
    assert arena.stats()["blocks_in_use"] == base + 1   # one block for the batch
    arr = outs[1]
    del outs
    arena.collect()
    assert arena.stats()["blocks_in_use"] == base + 1   # the array still holds it
    assert np.array_equal(arr, patterned((7,), np.uint8, 2))
    del arr
    arena.collect()
    assert arena.stats()["blocks_in_use"] == base


def test_fast_path_counts_in_fastpin_stats(arena):
    before = fastpin.stats()
    fastpin.pin_memory({"a": patterned((10,), torch.int16, 1),
                        "b": patterned((3,), np.float32, 2)}, arena=arena)
    after = fastpin.stats()
    assert after["batches"] == before["batches"] + 1
    assert after["leaves"] == before["leaves"] + 2
    assert after["bytes"] == before["bytes"] + 20 + 12


@pytest.mark.parametrize("on_full", ["fallback", "raise"])
def test_full_arena_follows_the_policy_on_the_fast_path(on_full):
    small = _C.Arena(1 << 20, cuda=False)
    x = patterned((600_000,), torch.uint8, 3)
    hold = fastpin.pin_memory(x, arena=small, on_full="raise")   # fills most of it
    if on_full == "raise":
        with pytest.raises(fastpin.ArenaFullError):
            fastpin.pin_memory(x, arena=small, on_full=on_full)
    else:
        out = fastpin.pin_memory(x, arena=small, on_full=on_full)
        assert torch.equal(out, x) and not in_arena(out, small)
    del hold


def test_use_torch_refuses_what_is_not_the_exchange_api():
    assert _C.use_torch(torch.Tensor, object()) is False
    import ctypes
    wrong = ctypes.pythonapi.PyCapsule_New
    wrong.restype, wrong.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
    assert _C.use_torch(torch.Tensor, wrong(1, b"not_the_api", None)) is False
    # The exchange API, on a type without the tensor's flags to read.
    assert _C.use_torch(dict, torch.Tensor.__dlpack_c_exchange_api__) is False

    class Flagless:
        requires_grad = is_neg = is_conj = is_pinned = None   # neither getter nor methods

    assert _C.use_torch(Flagless, torch.Tensor.__dlpack_c_exchange_api__) is False
    # ... and what was registered before still pins.
    x = patterned((5,), torch.float32, 1)
    assert_same(fastpin.pin_memory(x), x)
    assert _C.use_torch(torch.Tensor, torch.Tensor.__dlpack_c_exchange_api__) is True


def test_many_leaves_and_deep_shapes(arena):
    leaves = [patterned((2,) * (i % 9 + 1), torch.float32, i) for i in range(300)]
    outs = fast(leaves, arena)
    assert outs is not None
    for o, x in zip(outs, leaves):
        assert_same(o, x)


# ---- Arena.pin_tree: the whole batch in one call ---------------------------------

def tree(data, arena, check_pinned=False):
    _pin._use_torch()
    return arena.pin_tree(data, check_pinned)


def batch_of_every_container(seed):
    label = "seven"
    return {
        "image": patterned((3, 8, 8), torch.uint8, seed),
        "nested": [patterned((4,), np.float32, seed + 1),
                   (patterned((2, 3), torch.float64, seed + 2), label, None, 3, 2.5, True, b"x"),
                   {9: patterned((5,), torch.int4 if hasattr(torch, "int4") else torch.int8,
                                 seed + 3)}],
        "empty": [], "unit": (), "none": None,
    }


def test_pin_tree_gives_what_the_pipeline_gives(arena):
    data = batch_of_every_container(4)
    before = _C.pin_counts()
    out = tree(data, arena)
    assert out is not NotImplemented
    assert _C.pin_counts()[:2] == (before[0] + 1, before[1] + 4)
    ref = _pin._pin_planned(*flatten(data, is_leaf), None, arena, "raise")

    def same(o, r, x):
        assert type(o) is type(r) is type(x)
        if isinstance(x, dict):
            assert list(o) == list(r) == list(x)   # the keys, in their order
            for k in x:
                same(o[k], r[k], x[k])
        elif isinstance(x, (list, tuple)):
            assert len(o) == len(r) == len(x)
            for a, b, c in zip(o, r, x):
                same(a, b, c)
        elif isinstance(x, (torch.Tensor, np.ndarray)):
            assert_same(o, x)
            assert o is not x and in_arena(o, arena)
        else:
            assert o is x   # values come back as they are

    same(out, ref, data)


def test_pin_tree_places_a_batch_in_one_block(arena):
    base = arena.stats()["blocks_in_use"]
    out = tree({"a": patterned((100,), torch.int32, 1), "b": [patterned((9,), np.uint8, 2)]},
               arena)
    assert arena.stats()["blocks_in_use"] == base + 1
    del out
    arena.collect()
    assert arena.stats()["blocks_in_use"] == base


@pytest.mark.parametrize("case", [
    "namedtuple", "ordered_dict", "subclassed_list", "object", "bytearray", "numpy_scalar",
    "requires_grad", "too_deep"])
def test_pin_tree_leaves_these_to_the_pipeline(case, arena):
    import collections

    x = patterned((6,), torch.float32, 3)
    Pair = collections.namedtuple("Pair", "a b")

    class Listy(list):
        pass

    deep = x
    for _ in range(40):
        deep = [deep]
    data = {
        "namedtuple": lambda: Pair(x, 1),
        "ordered_dict": lambda: collections.OrderedDict(a=x),
        "subclassed_list": lambda: Listy([x]),
        "object": lambda: [x, object()],
        "bytearray": lambda: [x, bytearray(b"ab")],
        "numpy_scalar": lambda: [x, np.float32(1.5)],
        "requires_grad": lambda: {"a": x, "b": patterned((3,), torch.float32, 4).requires_grad_()},
        "too_deep": lambda: deep,
    }[case]()
    before = arena.stats()
    assert tree(data, arena) is NotImplemented
    after = arena.stats()
    assert (after["blocks_in_use"], after["bytes_in_use"]) == (before["blocks_in_use"],
                                                           before["bytes_in_use"])
    # ... and pin_memory gives the pipeline's answer, its types kept.
    out = fastpin.pin_memory(data, arena=arena)
    assert type(out) is type(data)


def test_pin_tree_keeps_sub_byte_dtypes(arena):
    kinds = [d for d in DTYPES if torch.empty((), dtype=d).element_size() == 1]
    leaves = [shell(d, (4, 3), i) for i, d in enumerate(kinds)]
    out = tree(leaves, arena)
    for o, x in zip(out, leaves):
        assert o.dtype == x.dtype
        assert_same(o, x)


def test_pin_tree_takes_two_or_four_arguments(arena):
    for args in [([],), ([], False, 1)]:
        with pytest.raises(TypeError, match="2 or 4 arguments"):
            arena.pin_tree(*args)
    with pytest.raises(OverflowError):
        arena.pin_tree([], False, -1, 2)


def test_pin_memory_of_a_batch_without_leaves_rebuilds_it(arena):
    data = {"a": [1, "b", None], "c": (2.5,)}
    out = fastpin.pin_memory(data, arena=arena)
    assert out == data and out is not data and out["a"] is not data["a"]


@pytest.mark.parametrize("kind", ["namedtuple", "ordered_dict", "dataclass"])
def test_batches_the_c_walk_leaves_still_pin_their_leaves_in_one_c_call(kind, arena):
    """A container pin_tree does not walk (namedtuple, Mapping, dataclass) is
    walked in Python, and its plain leaves still go through pin_batch, not the
    Python pipeline."""
    import collections
    import dataclasses

    x, a = patterned((16,), torch.int32, 1), patterned((4,), np.float64, 2)
    Pair = collections.namedtuple("Pair", "x a")

    @dataclasses.dataclass
    class Sample:
        x: object
        a: object

    data = {"namedtuple": lambda: Pair(x, a),
            "ordered_dict": lambda: collections.OrderedDict(x=x, a=a),
            "dataclass": lambda: Sample(x, a)}[kind]()
    _pin._use_torch()
    before = _C.pin_counts()
    out = fastpin.pin_memory(data, arena=arena)
    assert _C.pin_counts()[:2] == (before[0] + 1, before[1] + 2)
    assert type(out) is type(data)
    got = [out.x, out.a] if kind != "ordered_dict" else [out["x"], out["a"]]
    for o, ref in zip(got, [x, a]):
        assert_same(o, ref)
        assert in_arena(o, arena)


# Each batch opens with a leaf that has no dimensions or no bytes, the others
# ordinary: the fast path's first leaf found its dims pool still unallocated
# and copied a 0-d tensor's empty shape into a null pointer (UB: UBSan says
# "batch.c:151:5: null pointer passed as argument 1"; make test-asan-py).
@pytest.mark.parametrize("first", ["tensor_0d", "array_0d", "tensor_empty", "array_empty",
                                   "only_0d"])
@pytest.mark.parametrize("walk", ["pin_tree", "pin_batch"])
def test_pin_memory_of_0d_and_empty_leaves_passes_no_null_pointer(first, walk, arena):
    import collections

    if first == "only_0d":   # no leaf has a dimension: the dims pool stays empty
        leaves = [patterned((), torch.float32, 7), patterned((), np.uint16, 8),
                  patterned((), torch.complex64, 9)]
    else:
        lead = {"tensor_0d": patterned((), torch.float64, 1),
                "array_0d": patterned((), np.int32, 2),
                "tensor_empty": torch.empty(0, 4),
                "array_empty": np.empty((3, 0), np.float32)}[first]
        leaves = [lead, patterned((), torch.int16, 3), patterned((5, 2), torch.float32, 4),
                  torch.empty(0), patterned((), np.float64, 5), np.empty(0, np.uint8),
                  patterned((7,), np.int64, 6), torch.empty(2, 0, 3)]
    Row = collections.namedtuple("Row", [f"f{i}" for i in range(len(leaves))])
    data = list(leaves) if walk == "pin_tree" else Row(*leaves)   # pin_tree takes no namedtuple
    before = _C.pin_counts()[0]
    out = fastpin.pin_memory(data, arena=arena)
    assert _C.pin_counts()[0] == before + 1, "the fast path took the batch"
    assert type(out) is type(data)
    for o, x in zip(out, leaves):
        assert type(o) is type(x) and o.shape == x.shape
        assert_same(o, x)
