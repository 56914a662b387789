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


def map_leaves(data: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """Rebuild `data` with fn applied to every object is_leaf accepts.

    Containers keep their types, as torch's pin_memory does, except that a
    tuple stays a tuple: dict/Mapping (mutable ones are copied and updated, so
    subclasses keep their extra state), namedtuple, tuple, list/Sequence,
    dataclass instances. Strings, bytes and everything else pass through.
    """
    if is_leaf(data):
        return fn(data)
    if isinstance(data, (str, bytes, bytearray)):
        return data
    recurse = lambda x: map_leaves(x, is_leaf, fn)  # noqa: E731
    if isinstance(data, collections.abc.Mapping):
        items = {k: recurse(v) for k, v in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            clone = copy.copy(data)
            clone.update(items)
            return clone
        try:
            return type(data)(items)
        except TypeError:
            return items
    if isinstance(data, tuple):
        items = [recurse(v) for v in data]
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        try:
            return type(data)(items)
        except TypeError:
            return tuple(items)
    if isinstance(data, collections.abc.Sequence):
        items = [recurse(v) for v in data]
        if isinstance(data, list) and type(data) is list:
            return items
        if isinstance(data, collections.abc.MutableSequence):
            clone = copy.copy(data)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        try:
            return type(data)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        clone = copy.copy(data)
        for field in dataclasses.fields(data):
            # object.__setattr__ also works for frozen dataclasses.
            object.__setattr__(clone, field.name, recurse(getattr(data, field.name)))
        return clone
    return data
