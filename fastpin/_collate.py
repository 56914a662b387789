"""fastpin.collate: default_collate that stacks straight into arena blocks."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from ._arena import default_arena, policy
from ._dtypes import torch_carrier
from ._pin import _contiguous_strides, _count, _Fallback, _pin_with_policy

_warned_worker = False


def stackable(batch) -> bool:
    """Whether fastpin can stack these samples into a block itself: dense CPU
    tensors of one shape and a dtype it exports; the rest goes to torch."""
    elem = batch[0]
    return not (elem.device.type != "cpu" or elem.layout != torch.strided or elem.is_nested
                or elem.is_quantized or torch_carrier(elem.dtype) is None
                or any(t.shape != elem.shape or t.dtype != elem.dtype or t.device != elem.device
                       for t in batch))


def _stack_into_arena(batch, *, collate_fn_map=None):
    if not stackable(batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    elem = batch[0]
    (code, bits, lanes), view_as = torch_carrier(elem.dtype)
    nbytes = elem.numel() * elem.element_size()
    sources = [(t.data_ptr() if nbytes and t.is_contiguous() and not (t.is_conj() or t.is_neg())
                else 0, nbytes) for t in batch]
    try:
        block, _ = _pin_with_policy(default_arena(), sources, policy()["on_full"], 1)
    except _Fallback:
        _count(fallbacks=1)
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    shape = (len(batch), *elem.shape)
    out = torch.from_dlpack(block.dlpack(0, shape, _contiguous_strides(shape), code, bits, lanes))
    if view_as is not None:
        out = out.view(view_as)
    for i, (t, (address, _)) in enumerate(zip(batch, sources)):
        if nbytes and not address:
            out[i].copy_(t)
    _count(leaves=1, nbytes=nbytes * len(batch))
    return out


_fn_map = {**default_collate_fn_map, torch.Tensor: _stack_into_arena}


def collate(batch):
    """A drop-in DataLoader collate_fn: collates like default_collate, but every
    stacked tensor is built directly in a pinned arena block, so the batch needs
    no second copy to be pinned (use it with pin_memory=False).

    In DataLoader worker processes it collates exactly like default_collate and
    says so once: memory pinned in a worker would not be pinned, nor even
    visible, in the main process (that needs the shared arena of zero-copy mode).
    """
    global _warned_worker
    if get_worker_info() is not None:
        if not _warned_worker:
            _warned_worker = True
            warnings.warn(
                "fastpin.collate in a DataLoader worker collates like default_collate: "
                "pinned memory made in a worker is of no use to the main process. "
                "Use num_workers=0, or pin_memory=True with fastpin.install().",
                RuntimeWarning, stacklevel=2)
        return _collate(batch, collate_fn_map=default_collate_fn_map)
    out = _collate(batch, collate_fn_map=_fn_map)
    _count(batches=1)
    return out
