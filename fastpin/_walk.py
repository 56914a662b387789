"""Walking nested batches: the containers DataLoader batches are made of."""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
from typing import Any, Callable


def nbytes(data: Any) -> int:
    """Bytes of every tensor and ndarray leaf of a nested batch (without
    rebuilding it: callers count every batch)."""
    import numpy as np
    import torch

    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, np.ndarray):
        return data.nbytes
    if isinstance(data, dict):
        return sum(nbytes(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(nbytes(v) for v in data)
    if isinstance(data, (str, bytes, int, float)) or data is None:
        return 0
    total = 0

    def add(leaf):
        nonlocal total
        total += nbytes(leaf)

    map_leaves(data, lambda v: isinstance(v, (torch.Tensor, np.ndarray)), add)
    return total


# A batch's structure, as flatten() records it: its nodes in preorder, each
# a leaf (_LEAF), a value kept as it is, or a container with what rebuilding
# it needs (the original, for its type and extra state, and its keys or
# length). unflatten() reads it backwards with a stack, so neither walk
# recurses: nesting is bounded by memory, not by Python's frame limit.
_LEAF, _KEEP, _MAP, _NAMEDTUPLE, _TUPLE, _LIST, _SEQ, _DATACLASS = range(8)
_LEAF_NODE = (_LEAF, None, None)

# Deeper than this is taken for a batch that contains itself.
MAX_DEPTH = 100_000


class _Flat:
    """The spec of a plain dict, list or tuple of leaves (most DataLoader
    batches): its keys or length, rebuilt in one step. Not shared between
    batches: looking one up would compare keys, which may be any hashable."""

    __slots__ = ("kind", "keys")

    def __init__(self, kind: type, keys: Any):
        self.kind, self.keys = kind, keys


def flatten(data: Any, is_leaf: Callable[[Any], bool]) -> tuple:
    """One walk of `data`: (spec, leaves), the structure and the objects
    is_leaf accepts, in order. Each container is iterated once, so keys and
    values always pair up (a Mapping that iterates in another order each time
    still rebuilds right)."""
    if is_leaf(data):
        return [_LEAF_NODE], [data]
    kind = type(data)
    if kind is dict or kind is list or kind is tuple:
        leaves = list(data.values()) if kind is dict else list(data)
        if all(map(is_leaf, leaves)):
            # A plain dict's keys and values come from one table, in one order.
            return _Flat(kind, tuple(data) if kind is dict else len(leaves)), leaves
    spec: list = []
    leaves: list = []
    stack = [(data, 0)]
    while stack:
        x, depth = stack.pop()
        if is_leaf(x):
            spec.append(_LEAF_NODE)
            leaves.append(x)
            continue
        if isinstance(x, (str, bytes, bytearray)):
            spec.append((_KEEP, x, None))
            continue
        if isinstance(x, collections.abc.Mapping):
            items = list(x.items())
            spec.append((_MAP, x, [k for k, _ in items]))
            children: Any = [v for _, v in items]
        elif isinstance(x, tuple):
            spec.append((_NAMEDTUPLE if hasattr(x, "_fields") else _TUPLE, x, len(x)))
            children = x
        elif isinstance(x, collections.abc.Sequence):
            children = list(x)
            spec.append((_LIST if type(x) is list else _SEQ, x, len(children)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            names = [field.name for field in dataclasses.fields(x)]
            spec.append((_DATACLASS, x, names))
            children = [getattr(x, name) for name in names]
        else:
            spec.append((_KEEP, x, None))
            continue
        if depth >= MAX_DEPTH:
            raise RecursionError(f"fastpin: a batch nested more than {MAX_DEPTH} deep "
                                 "(does it contain itself?)")
        stack.extend((child, depth + 1) for child in reversed(children))
    return spec, leaves


def _rebuild(kind: int, data: Any, keys: Any, items: list) -> Any:
    """One container of `data`'s type, its children replaced by `items`."""
    if kind == _MAP:
        mapping = dict(zip(keys, items))
        if isinstance(data, collections.abc.MutableMapping):
            clone = copy.copy(data)
            clone.update(mapping)
            return clone
        try:
            return type(data)(mapping)
        except TypeError:
            return mapping
    if kind == _NAMEDTUPLE:
        return type(data)(*items)
    if kind == _TUPLE:
        if type(data) is tuple:
            return tuple(items)
        try:
            return type(data)(items)
        except TypeError:
            return tuple(items)
    if kind == _LIST:
        return items
    if kind == _SEQ:
        if isinstance(data, collections.abc.MutableSequence):
            clone = copy.copy(data)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        try:
            return type(data)(items)
        except TypeError:
            return items
    clone = copy.copy(data)  # a dataclass
    for name, item in zip(keys, items):
        # object.__setattr__ also works for frozen dataclasses.
        object.__setattr__(clone, name, item)
    return clone


def unflatten(spec: Any, leaves: list) -> Any:
    """The structure `spec` records, with `leaves` (in flatten's order) in it."""
    if type(spec) is _Flat:
        if spec.kind is dict:
            return dict(zip(spec.keys, leaves))
        return leaves if spec.kind is list else tuple(leaves)
    if len(spec) == 1 and spec[0][0] == _LEAF:
        return leaves[0]
    values: list = []
    push, pop = values.append, values.pop
    next_leaf = len(leaves)
    for kind, data, keys in reversed(spec):
        if kind == _LEAF:
            next_leaf -= 1
            push(leaves[next_leaf])
        elif kind == _KEEP:
            push(data)
        else:
            n = keys if isinstance(keys, int) else len(keys)
            if n:
                items = values[-n:][::-1]
                del values[-n:]
            else:
                items = []
            push(_rebuild(kind, data, keys, items))
    return pop()


def map_leaves(data: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """Rebuild `data` with fn applied to every object is_leaf accepts.

    Containers keep their types, as torch's pin_memory does, except that a
    tuple stays a tuple: dict/Mapping (mutable ones are copied and updated, so
    subclasses keep their extra state), namedtuple, tuple, list/Sequence,
    dataclass instances. Strings, bytes and everything else pass through.
    """
    spec, leaves = flatten(data, is_leaf)
    return unflatten(spec, [fn(leaf) for leaf in leaves])
