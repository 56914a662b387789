"""A zero-copy batch's layout record: what a worker sends beside its block.

One compact binary record says where every leaf lies in the block and what
it is (offset, shape, strides, dtype codes, flags) and how the containers
nest; the objects it names (dict keys, values kept as they are, leaves not
in the block, the few dtype objects no code describes) travel beside it as
one tuple. The main process turns both into the batch in one C call
(Block.unpack); the format, and the parser that refuses a record cut short
or changed, are in csrc/fastpin.h and csrc/record.c. Here: the writer.

A structure the record cannot carry (namedtuples, dataclasses, Mapping and
Sequence subclasses, nesting past DEPTH) travels as a tree of Slot markers
instead, its leaves still made in one call (as one list).
"""
from __future__ import annotations

import struct
import sys
from typing import Any, Optional

from . import _C, _leaves
from ._dtypes import _TORCH
from ._walk import _KEEP, _LEAF, _LIST, _MAP, _TUPLE, _Flat, map_leaves, unflatten
from ._walk import nbytes as batch_nbytes

MAGIC, VERSION = 0x31525046, 1
HEADER = struct.Struct("<IHHIIIIQ")            # 32 bytes
ENTRY = struct.Struct("<QQIIIHBBBBB5x")        # 40 bytes
TENSOR, ARRAY = 1, 2
REQUIRES_GRAD = 1
LEAF, OBJECT, ORDINARY, LIST, TUPLE, DICT = range(6)
NONE = 0xFFFFFFFF
DEPTH = 512  # FP_RECORD_DEPTH
_COUNT = struct.Struct("<BI")
_CONTAINER = {_LIST: LIST, _TUPLE: TUPLE, _MAP: DICT}
_FLAT = {dict: DICT, list: LIST, tuple: TUPLE}
_TYPE = {DICT: dict, LIST: list, TUPLE: tuple}

assert HEADER.size == 32 and ENTRY.size == 40


class Slot:
    """A leaf's place in a structure the record cannot carry: its index in the
    list Block.unpack gives."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return (Slot, (self.index,))


# Per Layout (shared by every batch of one type, dtype, shape and strides):
# (itemsize, kind, type, code, bits, dtype object or None, shape + strides).
_described: dict = {}


def _describe(layout: _leaves.Layout) -> tuple:
    d = _described.get(layout)
    if d is None:
        if layout.numpy:
            dt = layout.dtype
            # Plain numbers go by type number; the rest as the dtype itself.
            plain = dt.isbuiltin == 1 and dt.isnative and dt.kind in "biufc"
            d = (dt.itemsize, ARRAY, dt.num if plain else 0, 0, 0, None if plain else dt)
        else:
            (code, bits, lanes), view_as = layout.carrier
            d = ((bits * lanes + 7) // 8, TENSOR, lanes, code, bits, view_as)
        d += (tuple(layout.shape) + tuple(layout.strides),)
        _described[layout] = d
    return d


def _leaf(x, layout, nodes: bytearray, objects: list, kept: list) -> None:
    """Leaf x's node: in the block (its layout given), or sent as it is."""
    if layout is None:
        nodes.append(ORDINARY)
        objects.append(x)
        kept.append(x)
    else:
        nodes.append(LEAF)


def _nodes(spec, leaves, layouts, nodes: bytearray, objects: list, kept: list) -> bool:
    """The structure's nodes into `nodes`, its objects into `objects` (those
    in the batch's values also into `kept`); False when the record cannot
    carry it."""
    if type(spec) is _Flat:
        nodes += _COUNT.pack(_FLAT[spec.kind], len(leaves))
        if spec.kind is dict:
            objects.extend(spec.keys)
        for x, layout in zip(leaves, layouts):
            _leaf(x, layout, nodes, objects, kept)
        return True
    it = iter(zip(leaves, layouts))
    open_ = []  # items still to come of each container open around this node
    for kind, data, keys in spec:
        while open_ and open_[-1] == 0:
            open_.pop()
        if open_:
            open_[-1] -= 1
        if kind == _LEAF:
            _leaf(*next(it), nodes, objects, kept)
        elif kind == _KEEP:
            nodes.append(ORDINARY if _leaves.is_leaf(data) else OBJECT)
            objects.append(data)
            kept.append(data)
        else:
            node = _CONTAINER.get(kind)
            if node is None or type(data) is not _TYPE[node]:
                return False
            n = keys if isinstance(keys, int) else len(keys)
            if len(open_) >= DEPTH:
                return False
            nodes += _COUNT.pack(node, n)
            if node == DICT:
                objects.extend(keys)
            open_.append(n)
    return True


def encode(spec, leaves: list, plan: "_leaves.Plan") -> tuple:
    """(record, objects, tree, nbytes) for the batch flatten gave as (spec,
    leaves), placed in a block by `plan`: tree is None where the record
    carries the structure, else the structure with a Slot for each leaf;
    nbytes, the tensor and array bytes of the whole batch (_walk.nbytes), for
    the Loader's stats, counted here rather than by a walk in the main
    process."""
    nodes = bytearray()
    objects: list = []
    kept: list = []
    layouts = plan.layouts
    tree = None
    if not _nodes(spec, leaves, layouts, nodes, objects, kept):
        nodes = bytearray(_COUNT.pack(LIST, len(leaves)))
        objects = []
        kept = [data for kind, data, _ in spec if kind == _KEEP]  # in the Slot tree
        for x, layout in zip(leaves, layouts):
            _leaf(x, layout, nodes, objects, kept)
        tree = unflatten(spec, [Slot(i) for i in range(len(leaves))])
    entries = bytearray()
    dims: list = []
    dtypes: dict = {}
    base = len(objects)
    for x, layout, offset in zip(leaves, layouts, plan.offsets):
        if layout is None:
            continue
        itemsize, kind, type_, code, bits, dtype, shape_strides = _describe(layout)
        index = NONE
        if dtype is not None:
            index = dtypes.get(dtype)
            if index is None:
                index = dtypes[dtype] = base + len(dtypes)
        flags = REQUIRES_GRAD if getattr(x, "requires_grad", False) else 0
        entries += ENTRY.pack(offset, layout.nbytes, itemsize, len(dims), index, type_, kind,
                              len(layout.shape), code, bits, flags)
        dims.extend(shape_strides)
    objects.extend(dtypes)
    record = b"".join((HEADER.pack(MAGIC, VERSION, ENTRY.size, plan.placed, len(dims),
                                   len(nodes), len(objects), 0),
                       entries, struct.pack(f"<{len(dims)}q", *dims), nodes))
    nbytes = plan.data_bytes + sum(map(batch_nbytes, kept))
    return record, tuple(objects), tree, nbytes


def decode(block: _C.Block, record: bytes, objects: tuple, tree: Optional[Any],
           ordinary=None, leaf=None) -> Any:
    """The batch a worker shipped as (record, objects, tree), over `block`:
    one C call makes every view (leaf(view) where leaf is a callable; a list:
    its items are the leaves) and the containers; leaves not in the block
    come back as ordinary(x), or as they are."""
    out = block.unpack(record, objects, ordinary, leaf)
    if tree is None:
        return out
    return map_leaves(tree, lambda x: type(x) is Slot, lambda s: out[s.index])


# ---- device mode: where each leaf lies, read once per record ----------------------

_torch_of_code: dict = {}   # (code, bits, lanes) -> torch dtype
_torch_of_num: dict = {}    # NumPy type number -> torch dtype, or None
_device_specs: dict = {}    # record -> its leaves' specs (same-shaped batches share one)
_SPECS_KEPT = 64


def _tables() -> None:
    import numpy as np

    torch = sys.modules["torch"]
    for name, code in _TORCH.items():
        if hasattr(torch, name):
            _torch_of_code[code] = getattr(torch, name)
    for c in np.typecodes["All"]:
        dt = np.dtype(c)
        if dt.kind in "biufc":
            _torch_of_num[dt.num] = _leaves.torch_dtype_of(dt)


def device_specs(record: bytes) -> list:
    """Each leaf of `record` as a device view of the block's bytes needs it:
    (offset, nbytes, torch dtype or None, index of the dtype object or None,
    whether that object is a NumPy dtype, shape, strides (in elements),
    requires grad). Read in Python (the Loader's device mode
    slices one device buffer, no host view made) and kept by record: batches
    of one structure send the same bytes."""
    specs = _device_specs.get(record)
    if specs is not None:
        return specs
    if not _torch_of_code:
        _tables()
    _, _, _, nleaves, ndims, _, _, _ = HEADER.unpack_from(record)
    dims = struct.unpack_from(f"<{ndims}q", record, HEADER.size + nleaves * ENTRY.size)
    specs = []
    for i in range(nleaves):
        (offset, nbytes, _, at, obj, type_, kind, ndim, code, bits,
         flags) = ENTRY.unpack_from(record, HEADER.size + i * ENTRY.size)
        shape, strides = dims[at:at + ndim], dims[at + ndim:at + 2 * ndim]
        if obj != NONE:
            dtype = None
        elif kind == TENSOR:
            dtype = _torch_of_code.get((code, bits, type_))
        else:
            dtype = _torch_of_num.get(type_)
        specs.append((offset, nbytes, dtype, None if obj == NONE else obj, kind == ARRAY,
                      shape, strides, bool(flags & REQUIRES_GRAD)))
    if len(_device_specs) >= _SPECS_KEPT:
        _device_specs.clear()
        _one_dtype.clear()
    _device_specs[record] = specs
    return specs


_one_dtype: dict = {}  # record -> one_dtype(record), beside _device_specs


def one_dtype(record: bytes) -> Optional[Any]:
    """The torch dtype every leaf of `record` has, where they all have one and
    the same known to torch by code (a device buffer made of it needs no view
    of another dtype); else None. Kept by record, as device_specs is."""
    try:
        return _one_dtype[record]
    except KeyError:
        pass
    specs = device_specs(record)
    dtypes = {s[2] for s in specs}
    one = dtypes.pop() if len(dtypes) == 1 and all(s[3] is None for s in specs) else None
    _one_dtype[record] = one
    return one
