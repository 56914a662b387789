"""fastpin.pin_memory: structure, values for every dtype, layouts, and what
happens when the arena is too small or full."""
from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Mapping

import numpy as np
import pytest
import torch

import fastpin
from fastpin._dtypes import _TORCH
from conftest import (assert_same, in_arena, patterned, run_threads, settle, shares_memory,
                      tensor_bytes)

TORCH_DTYPES = [getattr(torch, name) for name in _TORCH]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (4, 0, 2), (1, 1, 1, 33)]


# ---- containers used in the structure tests ------------------------------

Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Sample:
    image: object
    label: object
    meta: object


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: object
    b: object


class ReadOnlyMap(Mapping):
    """A Mapping that is not a dict and not mutable."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class TaggedDict(dict):
    """A dict subclass with extra state that copy.copy keeps."""
    tag = None


class SelfPinning:
    """An object that pins itself: pin_memory() is asked exactly once."""

    def __init__(self, value):
        self.value = value
        self.calls = 0

    def pin_memory(self):
        self.calls += 1
        return ("pinned-by-self", self.value)


class Opaque:
    pass


def walk_leaves(x):
    """Tensor and ndarray leaves of a nested batch, in a fixed order."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        yield x
    elif isinstance(x, (str, bytes)):
        return
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from walk_leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from walk_leaves(v)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from walk_leaves(getattr(x, f.name))


def make_deep_batch(seed):
    n = itertools.count()

    def t(shape, dtype=torch.float32):
        return patterned(shape, dtype, seed * 1000 + next(n))

    def a(shape, dtype=np.int32):
        return patterned(shape, dtype, seed * 1000 + next(n))

    opaque = Opaque()
    tagged = TaggedDict(w=t((5,), torch.int64))
    tagged.tag = "kept"
    batch = {
        "image": t((3, 8, 8)),
        "array": a((4, 5)),
        "od": OrderedDict([("z", t((2,))), ("a", [t((3,), torch.int16), "s", 3])]),
        "dd": defaultdict(list, {"k": (t((4,), torch.uint8), a((6,), np.float64))}),
        "ro": ReadOnlyMap({"x": t((2, 2), torch.bfloat16)}),
        "tagged": tagged,
        "nt": Point(t((1,)), "label"),
        "dc": Sample(t((2, 3)), 3, {"deep": [[[(t((5,), torch.complex64),)]]]}),
        "frozen": Frozen(a((3,), np.uint16), None),
        "tuple": (t(()), b"bytes", 1.5, None, opaque, 7),
        "self": SelfPinning(11),
        "cls": SelfPinning,   # a class with a pin_memory attribute is not asked
        "str": "hello",
        "nested": [[t((3,))], ((t((2, 2), torch.bool),), {"k": [a((), np.float32)]})],
    }
    return batch, opaque


def test_structure_of_deep_mixed_batch(arena):
    batch, opaque = make_deep_batch(seed=1)
    before = [x.clone() if isinstance(x, torch.Tensor) else x.copy() for x in walk_leaves(batch)]
    out = fastpin.pin_memory(batch, arena=arena)

    assert type(out) is dict and list(out) == list(batch)
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["z", "a"]
    assert type(out["od"]["a"]) is list and out["od"]["a"][1:] == ["s", 3]
    assert type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    assert type(out["dd"]["k"]) is tuple
    assert type(out["ro"]) is ReadOnlyMap and list(out["ro"]) == ["x"]
    assert type(out["tagged"]) is TaggedDict and out["tagged"].tag == "kept"
    assert type(out["nt"]) is Point and out["nt"].y == "label"
    assert type(out["dc"]) is Sample and out["dc"].label == 3
    assert type(out["dc"].meta["deep"][0][0][0]) is tuple
    assert type(out["frozen"]) is Frozen and out["frozen"].b is None
    assert type(out["tuple"]) is tuple and len(out["tuple"]) == 6
    assert out["tuple"][1] is batch["tuple"][1]
    assert out["tuple"][2] is batch["tuple"][2]
    assert out["tuple"][3] is None
    assert out["tuple"][4] is opaque
    assert out["str"] is batch["str"]
    assert out["cls"] is SelfPinning
    assert out["self"] == ("pinned-by-self", 11)
    assert batch["self"].calls == 1
    assert type(out["nested"][1]) is tuple and type(out["nested"][1][0]) is tuple

    outs = list(walk_leaves(out))
    ins = list(walk_leaves(batch))
    assert len(outs) == len(ins) == 16
    for o, i, b in zip(outs, ins, before):
        assert_same(o, i)
        assert_same(i, b)                      # the input is left as it was
        assert not shares_memory(o, i)
        assert in_arena(o, arena)
    assert type(outs[1]) is np.ndarray and isinstance(outs[0], torch.Tensor)
    # Every leaf has memory of its own.
    for x, y in itertools.combinations([o for o in outs if o.nbytes if hasattr(o, "nbytes")], 2):
        assert not shares_memory(x, y)


def test_structure_through_default_arena():
    batch, _ = make_deep_batch(seed=2)
    out = fastpin.pin_memory(batch, "cuda")  # DataLoader passes a device: ignored
    for o, i in zip(walk_leaves(out), walk_leaves(batch)):
        assert_same(o, i)
        assert in_arena(o, fastpin.default_arena())


def test_leaf_objects_pass_through_by_identity():
    items = ["s", b"b", bytearray(b"ba"), 3, 2.5, 1 + 2j, None, True, Opaque(),
             {1, 2}, frozenset({3}), np.float32(1.5), torch.float16]
    out = fastpin.pin_memory(items)
    assert type(out) is list
    for o, i in zip(out, items):
        assert o is i, i
    assert fastpin.pin_memory("string") == "string"
    assert fastpin.pin_memory(None) is None


def test_top_level_leaves():
    t = patterned((17,), torch.int32, 3)
    a = patterned((3, 3), np.float64, 4)
    assert_same(fastpin.pin_memory(t), t)
    assert_same(fastpin.pin_memory(a), a)
    assert type(fastpin.pin_memory((t,))) is tuple


# ---- every dtype, every shape ---------------------------------------------

@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype(dtype, arena):
    batch = [patterned(shape, dtype, seed) for seed, shape in enumerate(SHAPES)]
    batch.append(patterned((70_000,), dtype, 99))  # large enough for the copy pool
    out = fastpin.pin_memory(batch, arena=arena)
    for o, i in zip(out, batch):
        assert_same(o, i)
        assert o.is_contiguous()
        if i.numel():
            assert in_arena(o, arena)


NUMPY_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                np.int64, np.uint64, np.float16, np.float32, np.float64, np.longdouble,
                np.complex64, np.complex128, ">i4", ">f8", "S5", "U3", "M8[ns]", "m8[s]",
                np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")]),
                np.dtype([("x", "u1"), ("y", ">u2")], align=True)]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_every_numpy_dtype(dtype, arena):
    batch = [patterned(shape, dtype, seed) for seed, shape in enumerate(SHAPES)]
    out = fastpin.pin_memory(batch, arena=arena)
    for o, i in zip(out, batch):
        assert_same(o, i)
        assert o.flags.c_contiguous and o.flags.writeable
        if i.size:
            assert in_arena(o, arena)


def test_object_arrays_pass_through(arena):
    obj = np.array([1, "x", None, Opaque()], dtype=object)
    mixed = np.zeros(2, dtype=[("n", "i4"), ("o", object)])
    out = fastpin.pin_memory({"obj": obj, "mixed": mixed}, arena=arena)
    assert out["obj"] is obj
    assert out["mixed"] is mixed


# ---- layouts -----------------------------------------------------------------

def _noncontiguous_views(dtype):
    base = patterned((6, 8, 10), dtype, 5)
    return {
        "transpose": base.transpose(0, 2),
        "permute": base.permute(1, 2, 0),
        "step": base[::2, 1::3, ::4],
        "narrow": base[1:5, 2:7, 3:9],
        "offset_row": base[3],
        "column": base[:, :, 7],
        "expand": patterned((6, 1, 10), dtype, 6).expand(6, 8, 10),
        "broadcast0": patterned((), dtype, 7).expand(4, 5),
        "t": patterned((1, 9), dtype, 8).t(),
        "diag": torch.as_strided(patterned((5, 5), dtype, 9), (5,), (6,)),
    }


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_noncontiguous_tensors(dtype, arena):
    views = _noncontiguous_views(dtype)
    out = fastpin.pin_memory(views, arena=arena)
    for name, view in views.items():
        o = out[name]
        assert_same(o, view)
        assert in_arena(o, arena), name
        assert not shares_memory(o, view), name
        # Either contiguous, or a dense permutation of the input's layout.
        assert o.is_contiguous() or o.stride() == view.stride(), name


def test_zero_stride_result_owns_every_element(arena):
    src = patterned((3, 1), torch.int32, 1)
    out = fastpin.pin_memory(src.expand(3, 4), arena=arena)
    assert 0 not in out.stride()
    out[0, 0] += 1                      # must not write through to [0, 1]
    assert out[0, 1] == src[0, 0] and out[0, 0] != out[0, 1]


@pytest.mark.parametrize("fmt,shape", [(torch.channels_last, (4, 3, 5, 6)),
                                       (torch.channels_last_3d, (2, 3, 4, 5, 6))])
def test_channels_last_keeps_strides(fmt, shape, arena):
    x = patterned(shape, torch.float32, 2).contiguous(memory_format=fmt)
    assert not x.is_contiguous()
    out = fastpin.pin_memory(x, arena=arena)
    assert out.stride() == x.stride()
    assert out.is_contiguous(memory_format=fmt)
    assert_same(out, x)
    assert in_arena(out, arena)


def test_conj_and_neg_bits_are_resolved(arena):
    c = patterned((4, 6), torch.complex64, 3)
    cases = {
        "conj": c.conj(),
        "neg": c.conj().imag,                     # a neg-bit view
        "conj_t": c.conj().t(),
        "conj_conj": c.conj().conj(),
        "conj128": patterned((5,), torch.complex128, 4).conj(),
        "neg_step": c.conj().imag[::2],
    }
    assert cases["conj"].is_conj() and cases["neg"].is_neg()
    out = fastpin.pin_memory(cases, arena=arena)
    for name, view in cases.items():
        o = out[name]
        assert not o.is_conj() and not o.is_neg(), name
        assert tensor_bytes(o) == tensor_bytes(view.resolve_conj().resolve_neg()), name
        assert torch.equal(o, view), name
    # The values are the conjugate, not the raw storage.
    assert torch.equal(out["conj"].imag, -c.imag)


def test_numpy_layouts(arena):
    base = patterned((6, 8, 4), np.int32, 7)
    views = {
        "fortran": np.asfortranarray(base),
        "transpose": base.transpose(2, 0, 1),
        "step": base[::2, 1::3],
        "negative": base[::-1],
        "negative_inner": base[:, :, ::-1],
        "negative_step": base[::-2, ::-3, 1:],
        "broadcast": np.broadcast_to(patterned((1, 4), np.float32, 8), (5, 4)),
        "readonly": np.frombuffer(patterned((16,), np.uint8, 9).tobytes(), dtype=np.uint8),
        "field": patterned((5,), np.dtype([("a", "<i4"), ("b", "<f8")]), 10)["b"],
        "zero_d": patterned((), np.complex128, 11),
        "empty": base[:, :0],
    }
    out = fastpin.pin_memory(views, arena=arena)
    for name, view in views.items():
        o = out[name]
        assert_same(o, view)
        assert o.flags.c_contiguous and o.flags.writeable, name
        if view.size:
            assert in_arena(o, arena), name
            assert not np.shares_memory(o, view), name


# ---- what DLPack cannot carry -----------------------------------------------

@pytest.fixture
def quiet_quantized():
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
        warnings.filterwarnings("ignore", ".*quantiz.*deprecated", UserWarning)
        yield


def test_quantized_tensors_go_the_ordinary_way(quiet_quantized, arena):
    f = patterned((4, 5), torch.float32, 3).clamp(-5, 5).nan_to_num(1.0)
    q = torch.quantize_per_tensor(f, 0.05, 7, torch.quint8)
    qc = torch.quantize_per_channel(f, torch.tensor([0.1, 0.2, 0.3, 0.4]),
                                    torch.tensor([1, 2, 3, 4]), 0, torch.qint8)
    plain = patterned((9,), torch.int16, 4)
    if fastpin.cuda_available():
        # torch cannot pin quantized tensors; fastpin says so plainly.
        with pytest.raises(TypeError, match="quantized"):
            fastpin.pin_memory({"q": q, "plain": plain}, arena=arena)
        return
    out = fastpin.pin_memory({"q": q, "qc": qc, "plain": plain}, arena=arena)
    for name, ref in (("q", q), ("qc", qc)):
        o = out[name]
        assert o.is_quantized and o.dtype == ref.dtype and o.qscheme() == ref.qscheme()
        assert torch.equal(o.int_repr(), ref.int_repr())
        assert torch.equal(o.dequantize(), ref.dequantize())
        assert o.data_ptr() != ref.data_ptr()
    assert out["q"].q_scale() == q.q_scale() and out["q"].q_zero_point() == 7
    assert_same(out["plain"], plain)
    assert in_arena(out["plain"], arena)


def test_sparse_tensors_go_the_ordinary_way(arena):
    dense = patterned((6, 7), torch.float64, 5) * (patterned((6, 7), torch.bool, 6))
    sparse = dense.to_sparse()
    out = fastpin.pin_memory([sparse], arena=arena)[0]
    assert out.layout == torch.sparse_coo
    assert torch.equal(out.to_dense(), dense)


SHELL_DTYPES = [getattr(torch, f"{kind}{bits}") for kind in ("uint", "int")
                for bits in range(1, 8) if hasattr(torch, f"{kind}{bits}")]


def test_sub_byte_shell_dtypes_are_copied():
    """torch.uint1..7 / int1..7 hold one element per byte; torch has no copy
    kernel for them, so fastpin carries their bytes as uint8 and views them back
    (regression: they once went to a clone() fallback that raised)."""
    failures = []
    for i, dtype in enumerate(SHELL_DTYPES):
        src = patterned((3, 4), torch.uint8, i).view(dtype)
        try:
            out = fastpin.pin_memory({"x": src})["x"]
        except Exception as e:  # collect every dtype, report them together
            failures.append(f"{dtype}: {type(e).__name__}: {e}")
            continue
        if out.dtype != dtype or not torch.equal(out.view(torch.uint8), src.view(torch.uint8)):
            failures.append(f"{dtype}: wrong result")
    assert not failures, "\n".join(failures)


def test_cpu_only_error_names_the_device():
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="meta"):
        fastpin.pin_memory([meta])


# ---- independence, requires_grad ---------------------------------------------

def test_results_are_independent_of_inputs(arena):
    t = patterned((64, 33), torch.float32, 1)
    a = patterned((50,), np.int64, 2)
    v = patterned((20, 20), torch.int32, 3)[::2]
    out = fastpin.pin_memory({"t": t, "a": a, "v": v}, arena=arena)
    snap = {k: (x.clone() if isinstance(x, torch.Tensor) else x.copy()) for k, x in out.items()}
    t.add_(1)
    a += 3
    v.fill_(12345)
    for k in out:
        assert_same(out[k], snap[k])
    # ... and writing the result leaves the input alone.
    t_before = t.clone()
    out["t"].mul_(2)
    assert_same(t, t_before)


def test_requires_grad_is_kept(arena):
    w = patterned((3, 4), torch.float32, 1).nan_to_num(0.5).requires_grad_()
    out = fastpin.pin_memory([w], arena=arena)[0]
    assert out.requires_grad
    assert torch.equal(out.detach(), w.detach())


# ---- a small arena --------------------------------------------------------------

def test_too_big_for_arena_names_both_sizes(small_arena):
    capacity = small_arena.capacity
    batch = [patterned((25_600,), torch.int16, 1), patterned((12_800,), np.float32, 2)]
    total = 25_600 * 2 + 12_800 * 4
    assert total > capacity
    for policy in ("raise", "wait"):
        with pytest.raises(fastpin.ArenaFullError) as info:
            fastpin.pin_memory(batch, arena=small_arena, on_full=policy)
        message = str(info.value)
        assert str(total) in message and str(capacity) in message
        assert isinstance(info.value, MemoryError) and isinstance(info.value, fastpin.FastpinError)
    assert small_arena.stats()["bytes_in_use"] == 0


def test_too_big_for_arena_falls_back_by_default(small_arena, caplog):
    batch = [patterned((25_600,), torch.int16, 7), patterned((12_800,), np.float32, 8)]
    before = fastpin.stats()["fallbacks"]
    out = fastpin.pin_memory(batch, arena=small_arena)
    assert fastpin.stats()["fallbacks"] == before + 1
    assert_same(out[0], batch[0])
    assert_same(out[1], batch[1])
    assert not in_arena(out[0], small_arena)


def test_wait_policy_waits_for_room_then_times_out(small_arena):
    import threading

    hold = [small_arena.alloc(48 << 10)]
    batch = [patterned((6000,), torch.int32, 9)]            # 24 KiB: needs the held room
    fastpin.configure(wait_timeout=5)
    # Room appears while pin_memory waits: it gets it and pins into the arena.
    threading.Timer(0.2, hold.clear).start()
    out = fastpin.pin_memory(batch, arena=small_arena, on_full="wait")
    assert in_arena(out[0], small_arena)
    assert_same(out[0], batch[0])
    # No room ever: the timeout ends the wait with a clear error.
    fastpin.configure(wait_timeout=0.2)
    try:
        held = small_arena.alloc(40 << 10)
        with pytest.raises(fastpin.ArenaFullError, match="waited 0.2 s"):
            fastpin.pin_memory(batch, arena=small_arena, on_full="wait")
        del held
    finally:
        fastpin.configure(wait_timeout=10)
    with pytest.raises(fastpin.ArenaFullError):
        small_arena.alloc(1 << 20)
    with pytest.raises(ValueError, match="on_full"):
        fastpin.pin_memory(batch, arena=small_arena, on_full="sometimes")


def test_full_arena_falls_back(small_arena):
    hold = small_arena.alloc(48 << 10)            # leaves 16 KiB
    batch = {"t": patterned((4096,), torch.float32, 3),      # 16 KiB + 8 KiB > 16 KiB
             "a": patterned((2048,), np.int32, 4),
             "c": patterned((8, 16), torch.complex64, 5).conj(),
             "s": "kept"}
    before = fastpin.stats()
    failed_before = small_arena.stats()["failed"]
    out = fastpin.pin_memory(batch, arena=small_arena)
    after = fastpin.stats()
    assert after["fallbacks"] == before["fallbacks"] + 1
    assert small_arena.stats()["failed"] == failed_before + 1
    assert_same(out["t"], batch["t"])
    assert_same(out["a"], batch["a"])
    assert torch.equal(out["c"], batch["c"]) and not out["c"].is_conj()
    assert out["s"] == "kept"
    for k in ("t", "a", "c"):
        assert not in_arena(out[k], small_arena)
        assert not shares_memory(out[k], batch[k])
    # Once there is room again, batches go into the arena.
    del hold
    settle()
    out = fastpin.pin_memory(batch, arena=small_arena)
    assert fastpin.stats()["fallbacks"] == after["fallbacks"]
    assert in_arena(out["t"], small_arena)
    assert_same(out["t"], batch["t"])


def test_counters_count_batches_leaves_and_bytes(arena):
    fastpin.default_arena()  # its counters are in stats() once it exists
    before = fastpin.stats()
    batch = [patterned((100,), torch.int64, 1), patterned((3,), np.uint8, 2), "x",
             patterned((0,), torch.float32, 3)]
    fastpin.pin_memory(batch, arena=arena)
    after = fastpin.stats()
    assert after["batches"] == before["batches"] + 1
    assert after["leaves"] == before["leaves"] + 3
    assert after["bytes"] == before["bytes"] + 803
    assert set(after["arena"]) >= {"bytes_in_use", "high_water", "class_blocks"}


# ---- deep nesting ---------------------------------------------------------------

def test_map_leaves_recursion_error_at_depth_450(arena):
    """Nesting as deep as torch's own pin_memory walker takes (one frame per
    level for lists: about the recursion limit) pins, for every container kind;
    map_leaves took about three frames a level and stopped near 330."""
    import sys

    from torch.utils.data._utils.pin_memory import pin_memory as torch_pin
    from fastpin._walk import map_leaves

    depth = torch_depth(torch_pin)
    assert depth > sys.getrecursionlimit() // 2   # lists: one frame per level
    for kind in ("list", "dict", "tuple", "dataclass"):
        x = patterned((3,), torch.int32, 7)
        batch = nest(depth, kind, x)
        out = fastpin.pin_memory(batch, arena=arena)
        inner = out
        for _ in range(depth):
            inner = unwrap(inner, kind)
        assert_same(inner, x) and in_arena(inner, arena)
        assert map_leaves(batch, lambda v: isinstance(v, torch.Tensor), lambda v: 5) is not None
        del out, inner


def torch_depth(walker) -> int:
    """The deepest list nesting torch's walker takes here, found by trying."""
    lo, hi = 1, 100_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            walker(nest_list(mid, "leaf"))
            lo = mid
        except RecursionError:
            hi = mid - 1
    return lo


def nest_list(depth, x):
    for _ in range(depth):
        x = [x]
    return x


@dataclasses.dataclass
class Box:
    item: object


def nest(depth, kind, x):
    wrap = {"list": lambda v: [v], "dict": lambda v: {"k": v}, "tuple": lambda v: (v,),
            "dataclass": Box}[kind]
    for _ in range(depth):
        x = wrap(x)
    return x


def unwrap(x, kind):
    return {"list": lambda v: v[0], "dict": lambda v: v["k"], "tuple": lambda v: v[0],
            "dataclass": lambda v: v.item}[kind](x)


# ---- one walk ---------------------------------------------------------------------

class Shuffling(Mapping):
    """A read-only Mapping that iterates its keys in another order each time."""

    def __init__(self, data):
        self.data = dict(data)
        self.turn = 0

    def __getitem__(self, key):
        return self.data[key]

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        keys = list(self.data)
        self.turn += 1
        k = self.turn % len(keys)
        return iter(keys[k:] + keys[:k])


def test_mapping_that_reorders_gets_other_keys_data(arena):
    batch = Shuffling({f"k{i}": patterned((4 + i,), torch.int32, i) for i in range(4)})
    out = fastpin.pin_memory(batch, arena=arena)
    assert set(out) == set(batch.data)
    for key, value in batch.data.items():
        assert_same(out[key], value)


# ---- leaf types as torch gives them back -------------------------------------------

class Tagged(torch.Tensor):
    """A tensor subclass that keeps torch's default __torch_function__."""


class Wrapping(torch.Tensor):
    """A subclass with its own __torch_function__: fastpin leaves it to torch."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_masked_array_loses_its_mask(arena):
    data = patterned((6,), np.float32, 1)
    masked = np.ma.masked_array(data, mask=[True, False, True, False, False, True],
                                fill_value=7.5)
    out = fastpin.pin_memory({"m": masked}, arena=arena)["m"]
    assert type(out) is np.ma.MaskedArray
    assert out.mask.tolist() == masked.mask.tolist()
    assert out.fill_value == masked.fill_value
    assert out.sum() == masked.sum()                 # masked values stay out
    assert out.data.tobytes() == data.tobytes()


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_numpy_subclasses_lose_their_type(arena, tmp_path):
    matrix = np.asmatrix(patterned((3, 4), np.int32, 2))
    rec = np.rec.fromarrays([patterned((5,), np.int16, 3), patterned((5,), np.float64, 4)],
                            names="a,b")
    mm = np.memmap(tmp_path / "m.bin", dtype=np.int64, mode="w+", shape=(7,))
    mm[:] = patterned((7,), np.int64, 5)
    out = fastpin.pin_memory([matrix, rec, mm], arena=arena)
    assert type(out[0]) is np.matrix and out[0].tobytes() == matrix.tobytes()
    assert in_arena(out[0], arena)
    assert type(out[1]) is np.recarray and out[1].dtype == rec.dtype
    assert out[1].b.tobytes() == rec.b.tobytes() and out[1].a.tolist() == rec.a.tolist()
    assert in_arena(out[1], arena)
    assert type(out[2]) is np.memmap and out[2].tobytes() == mm.tobytes()


def test_structured_dtype_keeps_its_fields(arena):
    dt = np.dtype([("x", np.int32), ("y", np.float64)])
    a = patterned((4,), dt, 6)
    out = fastpin.pin_memory(a, arena=arena)
    assert out.dtype == dt and out.dtype.names == ("x", "y")
    assert out.tobytes() == a.tobytes()


def test_tensor_subclasses_lose_their_type(arena):
    tagged = patterned((4, 3), torch.float32, 7).as_subclass(Tagged)
    wrapping = patterned((5,), torch.int64, 8).as_subclass(Wrapping)
    param = torch.nn.Parameter(patterned((2, 2), torch.float32, 9).nan_to_num(0.5))
    out = fastpin.pin_memory({"t": tagged, "w": wrapping, "p": param}, arena=arena)
    # torch.Tensor.pin_memory() keeps the type where __torch_function__ converts
    # (the default), and gives a plain tensor for Parameter (conversion disabled).
    assert type(out["t"]) is Tagged and in_arena(out["t"], arena)
    assert tensor_bytes(out["t"].as_subclass(torch.Tensor)) == \
        tensor_bytes(tagged.as_subclass(torch.Tensor))
    assert type(out["w"]) is Wrapping
    assert torch.equal(out["w"].as_subclass(torch.Tensor), wrapping.as_subclass(torch.Tensor))
    assert type(out["p"]) is torch.Tensor and torch.equal(out["p"].detach(), param.detach())


def test_requires_grad_outputs_lose_grad_fn(arena):
    w = patterned((3, 4), torch.float32, 1).nan_to_num(0.5).requires_grad_()
    nc = patterned((4, 3), torch.float32, 2).nan_to_num(0.5).t().requires_grad_()  # gathered
    out = fastpin.pin_memory([w, nc], arena=arena)
    for o, x in zip(out, (w, nc)):
        assert o.requires_grad and o.grad_fn is not None and not o.is_leaf   # as torch's
        assert in_arena(o, arena)
        assert torch.equal(o.detach(), x.detach())
    weights = patterned((3, 4), torch.float32, 3).nan_to_num(0.25)
    ((out[0] * weights).sum() + out[1].sum()).backward()
    assert torch.equal(w.grad, weights)              # the gradient reaches the input
    assert torch.equal(nc.grad, torch.ones_like(nc))
    with torch.no_grad():                            # torch: no graph, no requires_grad
        assert not fastpin.pin_memory(w, arena=arena).requires_grad


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_subclasses_and_grad_kept_on_the_ordinary_path(small_arena):
    hold = small_arena.alloc(small_arena.capacity)       # full: every batch falls back
    tagged = patterned((4, 3), torch.float32, 7).as_subclass(Tagged)
    w = patterned((3, 4), torch.float32, 1).nan_to_num(0.5).requires_grad_()
    matrix = np.asmatrix(patterned((3, 4), np.int32, 2))
    out = fastpin.pin_memory([tagged, w, matrix], arena=small_arena, on_full="fallback")
    assert type(out[0]) is Tagged
    assert out[1].requires_grad and out[1].grad_fn is not None
    assert type(out[2]) is np.matrix and out[2].tobytes() == matrix.tobytes()
    del hold


def test_flat_batches_rebuild_as_they_came(arena):
    """The one-level dict/list/tuple fast path keeps keys (any hashable, in
    order), types and every leaf."""
    key = torch.tensor([1])                           # a key whose == is elementwise
    batch = {"b": patterned((3,), torch.int8, 1), 2: patterned((2,), np.int16, 2),
             key: patterned((4,), torch.float64, 3)}
    out = fastpin.pin_memory(batch, arena=arena)
    assert type(out) is dict and list(out) == list(batch)
    for k in batch:
        assert_same(out[k], batch[k]) and in_arena(out[k], arena)
    for kind in (list, tuple):
        seq = kind([patterned((5,), torch.int32, 4), patterned((1,), np.uint8, 5)])
        out = fastpin.pin_memory(seq, arena=arena)
        assert type(out) is kind and len(out) == 2
        for o, i in zip(out, seq):
            assert_same(o, i)
    assert fastpin.pin_memory({}, arena=arena) == {} and fastpin.pin_memory((), arena=arena) == ()


# ---- torch's copy_ as the copy (fastpin._pin.tune_copy(torch_copy=...)) ---------

from fastpin import _C, _pin  # noqa: E402


def by_torch() -> int:
    """The batches torch's threads have filled in this process, by its copy_
    or its OpenMP team (Arena.pin_tree's and pin_batch's count)."""
    return _C.pin_counts()[3]


def by_team() -> int:
    """Of those, the batches torch's OpenMP team filled."""
    return _C.pin_counts()[4]


class TorchCopy:
    """Sets the torch_copy range; `taken` records, call by call, whether
    torch's threads filled the batch (True) or the pool copied it (False), and
    `teamed` whether its OpenMP team did. `via`: "team" or "copy_", how the
    span is filled in this test. Calls from one thread at a time: the counts
    are the process's."""

    def __init__(self, via: str):
        self.via = via
        self.taken: list = []
        self.teamed: list = []

    def __call__(self, lo, hi):
        _pin.tune_copy(torch_copy=(lo, hi))


@pytest.fixture(params=["team", "copy_"])
def torch_copy(request, monkeypatch):
    """A TorchCopy for the test, whose fastpin.pin_memory records each call,
    the span filled by torch's OpenMP team (its default grain) or through its
    copy_ (team_grain 0); every copy knob is put back after."""
    if not _pin._torch_seen:
        _pin._use_torch()  # as the first pin_memory of a batch of tensors does
    before = _pin.copy_tuning()
    if request.param == "team" and not before["team"]:
        pytest.skip("torch's parallel backend here is not OpenMP: no team to copy on")
    _pin.tune_copy(team_grain=(before["team_grain"] or 32 << 10) if request.param == "team" else 0)
    tc = TorchCopy(request.param)
    real = fastpin.pin_memory

    def spy(*args, **kw):
        count, teams = by_torch(), by_team()
        out = real(*args, **kw)
        tc.taken.append(by_torch() > count)
        tc.teamed.append(by_team() > teams)
        return out

    monkeypatch.setattr(fastpin, "pin_memory", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # torch's copy_ is taken only with 2 or more
    yield tc
    torch.set_num_threads(threads)
    _pin.tune_copy(**{k: before[k] for k in _pin.COPY_KEYS})


def _by_torch(tc, batch, **kw):
    """pin_memory(batch), asserting torch's threads took it (not the pool), by
    the way the test asked."""
    out = fastpin.pin_memory(batch, **kw)
    assert tc.taken[-1:] == [True], "the batch did not go through torch's threads"
    assert tc.teamed[-1:] == [tc.via == "team"], f"the batch did not go through {tc.via}"
    return out


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_copy_every_dtype(dtype, arena, torch_copy):
    torch_copy(0, 1 << 40)
    batch = [patterned(shape, dtype, seed) for seed, shape in enumerate(SHAPES)
             if 0 not in shape]
    batch.append(patterned((70_000,), dtype, 99))
    # Every dtype torch's DLPack exchange takes (all but float4_e2m1fn_x2 on
    # torch 2.13: the pipeline pins that one, by the pool).
    c_path = arena.pin_batch(batch[:1], False) is not None
    out = fastpin.pin_memory(batch, arena=arena)
    assert torch_copy.taken[-1] is c_path
    assert type(out) is list and len(out) == len(batch)
    for o, i in zip(out, batch):
        assert_same(o, i)
        assert o.is_contiguous() and in_arena(o, arena) and not shares_memory(o, i)


@pytest.mark.parametrize("kind", [torch.Tensor, tuple, list, dict])
def test_torch_copy_keeps_the_container(kind, arena, torch_copy):
    torch_copy(0, 1 << 40)
    outs = []  # each batch its own block: the earlier ones still hold theirs
    for seed in range(3):
        x = patterned((3, 64, 65), torch.float32, seed)
        y = patterned((3,), torch.int64, seed + 100)
        batch = {torch.Tensor: x, tuple: (x, y), list: [x, y], dict: {"x": x, "y": y}}[kind]
        out = _by_torch(torch_copy, batch, arena=arena)
        outs.append(out)
        assert type(out) is type(batch)
        if kind is torch.Tensor:
            assert_same(out, x)
        elif kind is dict:
            assert list(out) == ["x", "y"]
            assert_same(out["x"], x)
            assert_same(out["y"], y)
        else:
            assert_same(out[0], x)
            assert_same(out[1], y)


def test_torch_copy_only_in_its_range(arena, torch_copy):
    torch_copy(1 << 20, 2 << 20)
    for nbytes, taken in [((1 << 20) - 1, False), (1 << 20, True), (2 << 20, True),
                          ((2 << 20) + 1, False)]:
        x = patterned((nbytes,), torch.uint8, nbytes)
        assert_same(fastpin.pin_memory(x, arena=arena), x)
        assert torch_copy.taken[-1] is taken, nbytes
        assert torch_copy.teamed[-1] is (taken and torch_copy.via == "team"), nbytes


def test_torch_copy_by_default_for_256_kib_to_16_mib(arena, torch_copy):
    # Chosen on the H100 machine (benchmarks/pin_cutover.py --recommend).
    assert _pin.copy_tuning()["torch_copy"] == (256 << 10, 16 << 20)
    for nbytes, taken in [((256 << 10) - 1, False), (256 << 10, True), (16 << 20, True),
                          ((16 << 20) + 1, False)]:
        x = patterned((nbytes,), torch.uint8, nbytes)
        assert_same(fastpin.pin_memory(x, arena=arena), x)
        assert torch_copy.taken[-1] is taken, nbytes
        assert torch_copy.teamed[-1] is (taken and torch_copy.via == "team"), nbytes


def test_torch_copy_not_where_torch_has_one_thread(arena, torch_copy):
    # The DataLoader's pin thread sets one torch thread: there torch's copy_
    # is one thread's memcpy, and the pool is faster.
    torch_copy(0, 1 << 40)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = patterned((2 << 20,), torch.uint8, 3)
        assert_same(fastpin.pin_memory(x, arena=arena), x)
        assert torch_copy.taken[-1] is False
    finally:
        torch.set_num_threads(threads)


def test_torch_copy_takes_every_batch_of_tensors_the_c_path_takes(arena, torch_copy):
    torch_copy(0, 1 << 40)
    x = patterned((4, 6), torch.float32, 1)
    batches = [
        x.t(),                                          # dense, permuted: its strides kept
        (x, patterned((0,), torch.float32, 3)),         # a zero-size leaf
        Point(x, x + 1),                                # a namedtuple (Arena.pin_batch)
        [x, [x, {"y": x + 2, "n": 3}]],                 # nested, with plain values
    ]
    for batch in batches:
        out = fastpin.pin_memory(batch, arena=arena)
        assert torch_copy.taken[-1] is True, type(batch)
        assert torch_copy.teamed[-1] is (torch_copy.via == "team"), type(batch)
        assert type(out) is type(batch)
        for o, i in zip(walk_leaves(out), walk_leaves(batch)):
            assert_same(o, i)
            assert o.stride() == i.stride()
            assert i.numel() == 0 or (in_arena(o, arena) and not shares_memory(o, i))


def test_torch_copy_that_torch_refuses_is_copied_by_memcpy(arena, torch_copy, monkeypatch):
    # A dtype whose copy_ torch has no kernel for raises RuntimeError (or
    # TypeError): that leaf is copied byte for byte instead. Anything else
    # raised goes to the caller, and the block goes with the views. The team
    # copies bytes and never calls copy_.
    torch_copy(0, 1 << 40)
    batch = [patterned((300,), torch.int16, 1), patterned((7, 9), torch.float64, 2)]
    refusal = [RuntimeError]

    def copy_(self, src, non_blocking=False):
        raise refusal[0]("no kernel")  # a new one each time: none keeps its traceback

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    out = fastpin.pin_memory(batch, arena=arena)
    assert torch_copy.taken[-1] is True
    for o, i in zip(out, batch):
        assert_same(o, i)
    del out, o
    if torch_copy.via == "team":
        refusal[0] = KeyboardInterrupt
        for o, i in zip(_by_torch(torch_copy, batch, arena=arena), batch):
            assert_same(o, i)
        return
    refusal[0] = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as raised:
        fastpin.pin_memory(batch, arena=arena)
    del raised  # its traceback holds the view copy_ was called on
    settle()
    assert arena.stats()["bytes_in_use"] == 0


def test_torch_copy_leaves_what_it_cannot_take(arena, torch_copy):
    torch_copy(0, 1 << 40)
    x = patterned((4, 6), torch.float32, 1)
    batches = [
        x[:, ::2],                                      # not dense: the pipeline gathers it
        x.clone().requires_grad_(),                     # autograd
        torch.nn.Parameter(x.clone()),                  # a subclass
        patterned((3,), torch.complex64, 4).conj(),     # a lazy bit to resolve
    ]
    if torch_copy.via == "copy_":  # views of arrays are no tensors to copy_ into: the pool
        batches.append((x, patterned((5,), np.int32, 2)))
    for batch in batches:
        out = fastpin.pin_memory(batch, arena=arena)
        assert torch_copy.taken[-1] is False, type(batch)
        if not isinstance(batch, torch.Tensor):  # a Parameter comes back plain, as from torch
            assert type(out) is type(batch)
        for o, i in zip(walk_leaves(out), walk_leaves(batch)):
            assert_same(o, i)
            assert not shares_memory(o, i)
    assert fastpin.pin_memory(x.clone().requires_grad_(), arena=arena).requires_grad


def test_the_team_copies_arrays_among_the_tensors(arena, torch_copy):
    # The team copies bytes: a batch in the span with NumPy arrays in it (or
    # arrays alone) is its as well, where copy_ leaves it to the pool.
    torch_copy(256 << 10, 1 << 40)
    batches = [
        {"x": patterned((300, 1024), torch.float32, 1), "y": patterned((70_001,), np.int16, 2)},
        [patterned((512, 1024), np.uint8, 3), patterned((3, 5), np.float64, 4)],
    ]
    for batch in batches:
        out = fastpin.pin_memory(batch, arena=arena)
        assert torch_copy.taken[-1] is (torch_copy.via == "team"), type(batch)
        assert torch_copy.teamed[-1] is (torch_copy.via == "team"), type(batch)
        assert type(out) is type(batch)
        for o, i in zip(walk_leaves(out), walk_leaves(batch)):
            assert type(o) is type(i)
            assert_same(o, i)
            assert in_arena(o, arena) and not shares_memory(o, i)


def test_torch_copy_full_arena_keeps_the_policy(small_arena, torch_copy):
    torch_copy(0, 1 << 40)
    x = patterned((128 << 10,), torch.uint8, 5)
    with pytest.raises(fastpin.ArenaFullError):
        fastpin.pin_memory(x, arena=small_arena, on_full="raise")
    assert_same(fastpin.pin_memory(x, arena=small_arena, on_full="fallback"), x)
    assert not any(torch_copy.taken)


def test_default_cut_overs_from_many_threads(torch_copy):
    """Batches at both ends of the default torch_copy range (1 and 16 MiB, a
    byte either side) from 4 threads at once into the default arena, each
    checked, with the defaults as they are (CI runs this under ASan too)."""
    lo, hi = _pin.copy_tuning()["torch_copy"]
    sizes = [n + d for n in (lo, hi) for d in (-1, 0, 1)]

    def pinner(t: int) -> None:
        for i in range(6):
            nbytes = sizes[(i + t) % len(sizes)] - 64
            x = patterned((nbytes,), torch.uint8, (t << 16) + i)
            batch = [x, patterned((8,), torch.int64, (t << 16) + i + 1)]
            out = fastpin.pin_memory(batch, on_full="wait")
            assert_same(out[0], batch[0])
            assert_same(out[1], batch[1])

    before = by_torch()
    run_threads(pinner, 4)
    assert 0 < by_torch() - before < 4 * 6  # each thread 4 batches in the range, 2 out


def test_torch_copy_from_many_threads(arena, torch_copy):
    """Batches around both ends of the range from 6 threads at once, each
    checked, while the pool takes the rest."""
    torch_copy(256 << 10, 1 << 20)
    sizes = [n + d for n in (256 << 10, 1 << 20) for d in (-1, 0, 1)]

    def pinner(t: int) -> None:
        for i in range(30):
            nbytes = sizes[(i + t) % len(sizes)] - 64
            x = patterned((nbytes,), torch.uint8, (t << 16) + i)
            batch = (x, patterned((8,), torch.int64, (t << 16) + i + 1))
            out = fastpin.pin_memory(batch, arena=arena, on_full="wait")
            assert_same(out[0], batch[0])
            assert_same(out[1], batch[1])

    before = by_torch()
    run_threads(pinner, 6)
    assert 0 < by_torch() - before < 6 * 30  # two thirds of them in the range


def test_the_team_is_torch_s_own_where_its_backend_is_openmp(torch_copy):
    # torch's pip wheels for Linux run their parallel ops on GNU libgomp,
    # linked by libtorch_cpu: found there, the span is the team's by default.
    openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    assert _pin.copy_tuning()["team"] is openmp
    assert _pin._team_owner(torch) == ("libtorch_cpu." if openmp else None)
    assert _C.copy_tuning()["team_grain"] == 32 << 10 or torch_copy.via == "copy_"


def test_no_team_where_torch_has_another_backend():
    class Config:
        def __init__(self, info):
            self.info = info

        def parallel_info(self):
            if isinstance(self.info, Exception):
                raise self.info
            return self.info

    class FakeTorch:
        pass

    for info, owner in [("ATen parallel backend: native thread pool", None),
                        (RuntimeError("no parallel info"), None),
                        ("ATen parallel backend: OpenMP", "libtorch_cpu.")]:
        fake = FakeTorch()
        fake.__config__ = Config(info)
        assert _pin._team_owner(fake) == owner, info


def test_a_library_not_loaded_gives_no_team(arena, torch_copy):
    api = torch.Tensor.__dlpack_c_exchange_api__
    owner = _pin._team_owner(torch)
    try:
        assert _C.use_torch(torch.Tensor, api, "libfastpin-no-such-library.")
        assert _C.copy_tuning()["team"] is False
        torch_copy(0, 1 << 40)
        x = patterned((300_000,), torch.uint8, 8)
        assert_same(fastpin.pin_memory(x, arena=arena), x)
        assert torch_copy.taken[-1] is True and torch_copy.teamed[-1] is False  # copy_ fills
    finally:
        _C.use_torch(torch.Tensor, api, owner)
    assert _C.copy_tuning()["team"] is (owner is not None)


# A forked child of a process whose torch ran an OpenMP team: GNU libgomp's
# pool of threads does not survive fork, and a parallel region there waits
# for them forever (torch's own `a + 2` too). The child pins and exits.
_FORKED_PIN = """
import os, sys, time
import numpy as np, torch, fastpin
from fastpin import _C, _pin
torch.set_num_threads(2)
_pin.tune_copy(torch_copy=(0, 1 << 40), team_grain=int(sys.argv[1]))
x = torch.arange(1 << 20, dtype=torch.int32) * 7 + 3
arena = _C.Arena(16 << 20, cuda=False)
assert np.array_equal(fastpin.pin_memory(x, arena=arena).numpy(), x.numpy())
pid = os.fork()
if pid == 0:
    child_arena = _C.Arena(16 << 20, cuda=False)
    out = fastpin.pin_memory([x, x[:70_000]], arena=child_arena)
    ok = np.array_equal(out[0].numpy(), x.numpy()) and np.array_equal(out[1].numpy(), x[:70_000].numpy())
    os._exit(0 if ok else 3)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("CHILD", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("CHILD hung")
"""


@pytest.mark.parametrize("grain", [32 << 10, 0], ids=["team", "copy_"])
def test_torch_copy_not_in_a_forked_child(grain):
    import subprocess
    import sys

    if grain and _pin._team_owner(torch) is None:
        pytest.skip("torch's parallel backend here is not OpenMP")
    proc = subprocess.run([sys.executable, "-c", _FORKED_PIN, str(grain)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CHILD 0" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


@pytest.mark.gpu
def test_torch_copy_gives_pinned_tensors(torch_copy):
    torch_copy(0, 1 << 40)
    x = patterned((1 << 20,), torch.uint8, 6)
    out = _by_torch(torch_copy, {"x": x})
    assert out["x"].is_pinned()
    assert_same(out["x"].to("cuda", non_blocking=True).cpu(), x)


def test_tune_copy_refuses_bad_knobs(torch_copy):
    before = _pin.copy_tuning()
    with pytest.raises(TypeError, match="no knob 'spin'"):
        _pin.tune_copy(spin=1)
    with pytest.raises(ValueError, match="torch_copy"):
        _pin.tune_copy(torch_copy=(5, 1))
    with pytest.raises(ValueError, match="chunk_min"):
        _pin.tune_copy(chunk_min=1)
    assert _pin.copy_tuning() == before


def test_copy_knobs_from_the_environment():
    import os
    import subprocess
    import sys

    code = ("import fastpin; from fastpin import _pin; t = _pin.copy_tuning(); "
            "print(t['spin_ns'], t['inline_max'], t['torch_copy'], t['chunk_min_spin'])")
    env = dict(os.environ, FASTPIN_COPY="spin_ns=2K, inline_max=3M,torch_copy=1M-4M,"
               "chunk_min_spin=16K")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2048", str(3 << 20), f"({1 << 20},", f"{4 << 20})",
                                  str(16 << 10)]
    env["FASTPIN_COPY"] = "inline_max=lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "FASTPIN_COPY" in out.stderr and "inline_max" in out.stderr
