"""Property-based tests: over random nested batches, dtypes, shapes and
strides, pin_memory gives back equal values and the same structure."""
import collections
import dataclasses

import numpy as np
import pytest
import torch

import fastpin

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.float8_e4m3fn, torch.float8_e5m2]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32,
                np.float64, np.complex64]

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Holder:
    value: object
    tag: str


def _bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@st.composite
def torch_leaves(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    seed = draw(st.integers(0, 2**32 - 1))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        raw = torch.empty(shape, dtype=dtype)
    else:
        raw = torch.from_numpy(_bytes(n * itemsize, seed)).view(dtype).reshape(shape)
    # A view of another layout: transposed, stepped, or as it is.
    view = draw(st.sampled_from(["plain", "transpose", "step", "expand"]))
    if view == "transpose" and raw.dim() >= 2:
        raw = raw.transpose(0, raw.dim() - 1)
    elif view == "step" and raw.dim() >= 1:
        raw = raw[::2]
    elif view == "expand" and raw.dim() >= 1 and raw.shape[0] == 1:
        raw = raw.expand(3, *raw.shape[1:])
    return raw


@st.composite
def numpy_leaves(draw):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    n = int(np.prod(shape)) if shape else 1
    a = _bytes(n * dtype.itemsize, seed).view(dtype).reshape(shape)
    if a.ndim >= 1 and draw(st.booleans()):
        a = a[::-1]  # negative strides
    return a


scalars = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.floats(allow_nan=False))
leaves = st.one_of(torch_leaves(), numpy_leaves(), scalars)


def containers(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.tuples(children, st.text(max_size=3)).map(lambda t: Holder(*t)),
    )


batches = st.recursive(leaves, containers, max_leaves=12)


def _raw(t):
    """The bytes of t in canonical layout (size-1 dims may carry odd strides)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_same(out, ref):
    assert type(out) is type(ref)
    if isinstance(ref, torch.Tensor):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        if ref.numel():  # bytes, so NaN payloads and float8 compare exactly
            assert torch.equal(_raw(out), _raw(ref))
    elif isinstance(ref, np.ndarray):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert out.tobytes() == ref.tobytes()
    elif isinstance(ref, dict):
        assert list(out) == list(ref)
        for k in ref:
            assert_same(out[k], ref[k])
    elif isinstance(ref, (list, tuple)):
        assert len(out) == len(ref)
        for a, b in zip(out, ref):
            assert_same(a, b)
    elif isinstance(ref, Holder):
        assert out.tag == ref.tag
        assert_same(out.value, ref.value)
    else:
        assert out == ref or (out is ref)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_pin_memory_gives_back_equal_values_and_structure(batch):
    arena = fastpin._C.Arena(1 << 20, cuda=False)
    try:
        out = fastpin.pin_memory(batch, arena=arena)
    except fastpin.ArenaFullError:
        return  # a drawn batch bigger than this arena: a clear error, nothing else
    assert_same(out, batch)
    del out
    arena.collect()
    assert arena.is_valid()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_the_c_walk_gives_what_the_python_pipeline_gives(batch):
    """Arena.pin_tree (pin_memory's one C call) against the Python pipeline, on
    the same batch: where the C walk takes a batch, the two agree."""
    from fastpin import _leaves, _pin, _walk

    arena = fastpin._C.Arena(1 << 20, cuda=False)
    _pin._use_torch()
    try:
        out = arena.pin_tree(batch, False)
        if out is NotImplemented:
            return  # a container or leaf the pipeline's walk takes
        ref = _pin._pin_planned(*_walk.flatten(batch, _leaves.is_leaf), None, arena, "raise")
    except fastpin.ArenaFullError:
        return
    assert_same(out, ref)   # container for container, leaf for leaf
    assert_same(out, batch)
