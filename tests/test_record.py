"""Zero-copy's layout record (fastpin/_record.py writes it, csrc/record.c checks
it, Block.unpack in csrc/block_record.c makes the batch from it in one C call):
what a worker ships comes back as what the ordinary path (fastpin.pin_memory)
gives, type for type and byte for byte; a record cut short or changed is
refused with a clear error and never makes a view past its block."""
import collections
import ctypes
import dataclasses
import gc
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastpin
from conftest import patterned, settle
from fastpin import _C, _pin, _record, _walk, _zerocopy
from fastpin._dtypes import torch_carrier

MB = 1 << 20
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (4, 0, 2), (1, 1, 1, 33)]


def _torch_dtypes():
    """Every torch dtype fastpin places: DLPack's, and the shells (sub-byte and
    bit types) carried as unsigned bytes and viewed back."""
    seen = []
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype) and d not in seen and torch_carrier(d) is not None:
            seen.append(d)
    return seen


TORCH_DTYPES = _torch_dtypes()
NUMPY_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                np.int64, np.uint64, np.float16, np.float32, np.float64, np.longdouble,
                np.complex64, np.complex128, ">i4", ">f8", ">c16", "S5", "U3", "M8[ns]", "m8[s]",
                np.dtype([("a", "<i4"), ("b", "<f8", (2,)), ("c", "S3")]),
                np.dtype([("x", "u1"), ("y", ">u2")], align=True)]


@pytest.fixture
def shared():
    arena = _C.Arena(64 * MB, shared=True, cuda=False)
    _zerocopy.register(arena)
    yield arena
    settle()
    arena.collect()
    assert arena.stats()["blocks_in_use"] == 0
    assert arena.is_valid()


@pytest.fixture
def copies():
    """The ordinary path's arena."""
    return _C.Arena(64 * MB, cuda=False)


def shipped(batch, arena):
    """`batch` as a zero-copy worker ships it (pickled, as across the result
    queue) and the main process adopts it: an Adopted."""
    block, *layout = _zerocopy._pack(batch, arena)
    out = pickle.loads(pickle.dumps(_zerocopy._Shipped(arena.token, block.index, block.nbytes,
                                                       layout, block)))
    assert isinstance(out, _zerocopy.Adopted)
    return out


def zero_copy(batch, arena):
    out, adopted = _zerocopy.receive(shipped(batch, arena))
    assert adopted
    return out


def raw(t: torch.Tensor) -> bytes:
    """The bytes a dense tensor spans (both paths give dense leaves)."""
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def same(out, ref, where="batch"):
    """`out` is what `ref` is: the same types all the way down, each tensor or
    array of the same dtype, shape, strides and bytes."""
    assert type(out) is type(ref), (where, type(out), type(ref))
    if isinstance(ref, torch.Tensor):
        assert (out.dtype, out.shape, out.stride(), out.requires_grad) == \
            (ref.dtype, ref.shape, ref.stride(), ref.requires_grad), where
        assert raw(out) == raw(ref), where
    elif isinstance(ref, np.ndarray):
        assert (out.dtype, out.shape, out.strides) == (ref.dtype, ref.shape, ref.strides), where
        assert out.tobytes() == ref.tobytes(), where
    elif isinstance(ref, dict):
        assert list(out) == list(ref), where
        for k in ref:
            same(out[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(out) == len(ref), where
        for i, (o, r) in enumerate(zip(out, ref)):
            same(o, r, f"{where}[{i}]")
    elif dataclasses.is_dataclass(ref):
        for f in dataclasses.fields(ref):
            same(getattr(out, f.name), getattr(ref, f.name), f"{where}.{f.name}")
    else:
        assert out == ref, where


def data_bytes(batch) -> int:
    """_walk.nbytes(batch) (what the Loader's stats count), by a walk that
    does not recurse: batches here nest deeper than Python's frames allow."""
    arrays = _walk.flatten(batch, lambda x: isinstance(x, (torch.Tensor, np.ndarray)))[1]
    return sum(map(_walk.nbytes, arrays))


def inside(x, block) -> bool:
    """x's bytes lie in the block (an empty tensor has no address to check)."""
    ptr = x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data
    n = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else x.nbytes
    return n == 0 or block.ptr <= ptr and ptr + n <= block.ptr + block.nbytes


def _leaves(tree):
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [leaf for x in tree for leaf in _leaves(x)]
    return [tree] if isinstance(tree, (torch.Tensor, np.ndarray)) else []


# ---- every leaf ----------------------------------------------------------------

def _torch_leaves(dtype, seed):
    leaves = [patterned(shape, dtype, seed + i) for i, shape in enumerate(SHAPES)]
    leaves.append(patterned((3, 5), dtype, seed + 20).t())  # dense, permuted
    # channels_last by a view: dense permuted strides, any dtype.
    leaves.append(patterned((2, 4, 5, 3), dtype, seed + 21).permute(0, 3, 1, 2))
    gathered = patterned((6, 8), dtype, seed + 22)[::2, 1::3]
    try:
        gathered.contiguous()
    except (RuntimeError, TypeError):
        pass  # no copy kernel for this dtype: neither path can gather it
    else:
        leaves.append(gathered)
    return leaves


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype(dtype, shared, copies):
    batch = {"leaves": _torch_leaves(dtype, 3)}
    out = zero_copy(batch, shared)
    same(out, fastpin.pin_memory(batch, arena=copies))
    assert out["leaves"][9].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
def test_every_numpy_dtype(dtype, shared, copies):
    batch = [patterned(shape, dtype, seed) for seed, shape in enumerate(SHAPES)]
    batch.append(patterned((6, 8), dtype, 30)[::2, 1::3])  # gathered
    out = zero_copy(batch, shared)
    same(out, fastpin.pin_memory(batch, arena=copies))
    assert all(o.flags.writeable for o in out)


def test_what_the_record_cannot_carry_keeps_its_path(shared, copies):
    """Leaves with their own rules: a leaf that requires grad comes back a
    leaf that requires grad, arrays of objects and masked arrays as they were
    shipped (as the ordinary path leaves them)."""
    w = patterned((4, 3), torch.float32, 5).requires_grad_()
    obj = np.array([1, "x", None], dtype=object)
    m = np.ma.masked_array(patterned((2, 3), np.float64, 6), mask=[[1, 0, 0], [0, 1, 0]])
    batch = {"w": w, "obj": obj, "m": m, "deeper": [{"m": m}]}
    assert _zerocopy._pack(batch, shared)[4] == data_bytes(batch)
    out = zero_copy(batch, shared)
    assert out["w"].requires_grad and out["w"].is_leaf and torch.equal(out["w"], w)
    assert type(out["obj"]) is np.ndarray and out["obj"].tolist() == obj.tolist()
    same(out["m"], fastpin.pin_memory(m, arena=copies))
    assert out["m"].mask.tolist() == m.mask.tolist()


# ---- structures ---------------------------------------------------------------

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    img: torch.Tensor
    meta: dict


def _deep(depth, leaf):
    tree = leaf
    for d in range(depth):
        tree = [tree, d] if d % 3 == 0 else ({"k": tree, "d": d} if d % 3 == 1 else (tree,))
    return tree


def _structures():
    t = lambda seed, shape=(3, 4): patterned(shape, torch.int32, seed)  # noqa: E731
    return {
        "leaf": t(1),
        "dict": {"a": t(2), "b": patterned((5,), np.float32, 3), "label": 7, "name": "x",
                 "none": None, "ratio": 0.25, "raw": b"\x01\x02", 3: t(4), (1, 2): True},
        "nested": [{"a": (t(5), [t(6), "s"]), "b": []}, (), [[t(7)]], {}],
        "deep50": _deep(50, t(8)),
        "deep512": [_deep(511, t(9))],
        "empty": [],
    }


def _carried_elsewhere():
    t = lambda seed: patterned((2, 3), torch.float64, seed)  # noqa: E731
    return {
        "namedtuple": {"p": Pair(t(1), [t(2)])},
        "ordered": collections.OrderedDict(a=t(3), b=4),
        "dataclass": [Sample(t(5), {"id": 3, "v": t(6)})],
        "deep520": _deep(520, t(7)),  # past the record's 512 (pickle's own limit is near)
    }


@pytest.mark.parametrize("name", list(_structures()))
def test_structures_the_record_carries(name, shared, copies):
    batch = _structures()[name]
    block, record, objects, tree, nbytes = _zerocopy._pack(batch, shared)
    assert tree is None  # the record carries the structure: no object per leaf
    assert nbytes == data_bytes(batch)  # what the Loader's stats count
    del block
    out = zero_copy(batch, shared)
    same(out, fastpin.pin_memory(batch, arena=copies))


@pytest.mark.parametrize("name", list(_carried_elsewhere()))
def test_structures_beside_the_record(name, shared, copies):
    """Containers the record has no node for travel as a tree of slots; the
    leaves are still made in one call."""
    batch = _carried_elsewhere()[name]
    block, record, objects, tree, nbytes = _zerocopy._pack(batch, shared)
    assert tree is not None
    assert nbytes == data_bytes(batch)
    del block
    out = zero_copy(batch, shared)
    same(out, fastpin.pin_memory(batch, arena=copies))


def test_a_thousand_leaves(shared, copies):
    dtypes = [torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.uint8, np.int16,
              np.float64, ">u4"]
    batch = {f"f{i}": patterned((i % 5, 3) if i % 7 else (), dtypes[i % len(dtypes)], i)
             for i in range(1000)}
    adopted = shipped(batch, shared)
    assert len(adopted.record) < 80 * 1000  # compact: 40 bytes a leaf and its dims
    out = adopted.views()
    same(out, fastpin.pin_memory(batch, arena=copies))
    assert all(inside(x, adopted.block) for x in out.values())


def test_device_views_read_what_host_views_read(shared):
    """Device mode's views (here of a CPU tensor holding the block's bytes, as one
    copy would fill a device buffer) are the host views' offsets, shapes,
    strides and dtypes."""
    batch = {"cl": patterned((2, 4, 5, 3), torch.uint8, 1).permute(0, 3, 1, 2),
             "w": patterned((7, 3), torch.float32, 2).requires_grad_(),
             "a": patterned((11,), np.int16, 3),
             "u3": patterned((4,), torch.uint3, 4) if hasattr(torch, "uint3") else None,
             "t": patterned((3, 4), torch.float64, 5).t(), "n": 5}
    adopted = shipped(batch, shared)
    block = adopted.block
    buffer = torch.from_dlpack(block.dlpack(0, (block.nbytes,), (1,), 1, 8, 1))
    views = _zerocopy.device_views(adopted, buffer)
    host = adopted.views()
    for k, want in host.items():
        got = views[k]
        if isinstance(want, np.ndarray):
            want = torch.from_numpy(want)
        elif not isinstance(want, torch.Tensor):
            assert got == want
            continue
        assert (got.dtype, got.shape, got.stride(), got.requires_grad) == \
            (want.dtype, want.shape, want.stride(), want.requires_grad), k
        assert raw(got) == raw(want), k
    del views, buffer
    # A structured dtype torch has no dtype for: the ordinary path, said by None.
    batch = {"s": patterned((3,), np.dtype([("a", "<i4"), ("b", "<f8")]), 6)}
    adopted = shipped(batch, shared)
    buffer = torch.from_dlpack(adopted.block.dlpack(0, (adopted.block.nbytes,), (1,), 1, 8, 1))
    assert _zerocopy.device_views(adopted, buffer) is None


# ---- through DataLoader workers ----------------------------------------------------

def _batch(i):
    """A batch of every kind of leaf, its own pattern per index."""
    return {"img": patterned((2, 3, 4, 4), torch.uint8, i).to(memory_format=torch.channels_last),
            "x": patterned((4, 5), torch.bfloat16, i + 1).t(),
            "b": patterned((6,), torch.bool, i + 2), "s": patterned((), torch.float64, i + 3),
            "u3": patterned((5,), torch.uint3, i + 4) if hasattr(torch, "uint3") else i,
            "arr": [patterned((3, 2), ">f4", i + 5),
                    patterned((2,), np.dtype([("a", "<i2"), ("b", "S3")]), i + 6)],
            "e": torch.empty(0, 4), "meta": ("id", i, None, _deep(50, patterned(3, np.int8, i)))}


def _as_is(batch):
    return batch


class _Batches(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return _batch(i)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_ship_records(start, copies):
    dl = DataLoader(_Batches(), batch_size=None, num_workers=2, multiprocessing_context=start,
                    collate_fn=_as_is)
    loader = fastpin.Loader(dl, device=None, zero_copy=True, capacity=16 * MB)
    seen = 0
    for i, batch in enumerate(loader):
        same(batch, fastpin.pin_memory(_batch(i), arena=copies), f"batch {i}")
        arena = loader.arena
        assert all(arena.base <= (x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data)
                   < arena.base + arena.capacity for x in _leaves(batch) if x.nbytes)
        seen += 1
    assert seen == 12
    stats = loader.stats()
    assert stats["fallbacks"] == 0 and stats["worker_fallbacks"] == 0


# ---- records that lie ------------------------------------------------------------

def _small():
    return {"a": patterned((3, 4), torch.float32, 1), "b": [patterned((5,), np.int16, 2), "s"],
            "c": patterned((2, 2), np.dtype([("x", "<i4"), ("y", ">f8")]), 3),
            "d": patterned((4,), torch.uint3, 4) if hasattr(torch, "uint3") else 0}


def test_a_truncated_record_is_refused(shared):
    adopted = shipped(_small(), shared)
    record = adopted.record
    for n in range(len(record)):
        with pytest.raises(ValueError, match="layout record"):
            adopted.block.unpack(record[:n], adopted.objects)
    # Lengthened too: the header says how long it is.
    with pytest.raises(ValueError, match="truncated or corrupt"):
        adopted.block.unpack(record + b"\0", adopted.objects)
    assert adopted.views()["a"].shape == (3, 4)  # the block is still good


def test_every_changed_byte_is_refused_or_stays_in_the_block(shared):
    """A fuzzer's flips, byte by byte: the C call refuses the record (a clear
    error: ValueError from the parser, or torch's or NumPy's own for a dtype
    code they refuse) or makes views inside the block, never past it, and
    drops every hold it took (the fixture checks no block is left)."""
    _pin._use_torch()  # through torch's exchange API, as the Loader does
    adopted = shipped(_small(), shared)
    record, objects, block = adopted.record, adopted.objects, adopted.block
    refused = taken = 0
    for i in range(len(record)):
        for flip in (0x01, 0x80, 0xff):
            bad = bytearray(record)
            bad[i] ^= flip
            try:
                out = block.unpack(bytes(bad), objects)
            except (ValueError, TypeError, RuntimeError, BufferError) as e:
                assert str(e)
                refused += 1
                continue
            taken += 1
            for leaf in _leaves(out):
                assert inside(leaf, block), (i, flip)
            del out
    assert refused and taken


def test_objects_that_do_not_match_are_refused(shared):
    adopted = shipped(_small(), shared)
    record, objects, block = adopted.record, adopted.objects, adopted.block
    with pytest.raises(ValueError, match="objects"):
        block.unpack(record, objects[:-1])
    with pytest.raises(ValueError, match="objects"):
        block.unpack(record, objects + (None,))
    # The structured dtype travels as an object; in its place a non-dtype.
    at = next(i for i, o in enumerate(objects) if isinstance(o, np.dtype))
    wrong = objects[:at] + ("not a dtype",) + objects[at + 1:]
    with pytest.raises(ValueError, match="dtype object"):
        block.unpack(record, wrong)
    # One of another size, or one holding references: never over raw memory.
    for dtype in (np.dtype("<i8"), np.dtype([("x", "<i4"), ("o", object)])):
        wrong = objects[:at] + (dtype,) + objects[at + 1:]
        with pytest.raises(ValueError, match="raw memory"):
            block.unpack(record, wrong)
    with pytest.raises(TypeError):
        block.unpack(bytearray(record), objects)
    # Leaves given (device mode): one for each the record describes.
    n = len(_leaves(adopted.views()))
    assert _leaves(block.unpack(record, objects, None, list(range(n)))) == []
    for wrong in ([], list(range(n + 1))):
        with pytest.raises(ValueError, match="leaves given"):
            block.unpack(record, objects, None, wrong)


def test_a_record_for_a_bigger_block_is_refused(shared):
    """A record read against a smaller block than the one it was written for
    (a worker's index or size mixed up): refused, nothing made."""
    batch = {"a": patterned((64, 64), torch.float32, 1), "b": patterned((3,), torch.int64, 2)}
    adopted = shipped(batch, shared)
    small = shared.pin([(0, 4096)], 1)[0]
    with pytest.raises(ValueError, match="past the block"):
        small.unpack(adopted.record, adopted.objects)
    del small
    gc.collect()


def test_encode_is_what_the_parser_reads(shared):
    """The writer's constants are the C core's (fastpin.h)."""
    batch = {"a": patterned((2, 3), torch.int16, 1)}
    _, record, objects, tree, _ = _zerocopy._pack(batch, shared)
    assert record[:4] == b"FPR1" and _record.HEADER.size == 32 and _record.ENTRY.size == 40
    assert objects == ("a",) and tree is None
