"""fastpin.collate: default_collate that stacks straight into arena blocks."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from ._arena import default_arena
from ._leaves import Plan, Stack, stackable
from ._pin import Fallback, pin_with_policy
from ._runtime import count, first, settings

__all__ = ["collate", "stackable"]


def _stack_into_arena(batch, *, collate_fn_map=None):
    # Samples that require grad go to torch, which records the stack for autograd.
    if not stackable(batch) or (torch.is_grad_enabled() and any(t.requires_grad for t in batch)):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    plan = Plan([Stack(batch)])
    try:
        block = pin_with_policy(default_arena(), plan, settings.on_full)
    except Fallback:
        count(fallbacks=1)
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    out, = plan.host(block)
    count(leaves=1, nbytes=plan.data_bytes)
    return out


_fn_map = {**default_collate_fn_map, torch.Tensor: _stack_into_arena}


def collate(batch):
    """A drop-in DataLoader collate_fn: collates like default_collate, but every
    stacked tensor is built directly in a pinned arena block, so the batch needs
    no second copy to be pinned (use it with pin_memory=False). Samples that
    require grad are stacked by torch, as default_collate does, so autograd
    records the stack and the gradient reaches each sample.

    In DataLoader worker processes it collates exactly like default_collate and
    says so once: memory pinned in a worker would not be pinned, nor even
    visible, in the main process (that needs the shared arena of zero-copy mode).
    """
    if get_worker_info() is not None:
        if first("collate in a worker"):
            warnings.warn(
                "fastpin.collate in a DataLoader worker collates like default_collate: "
                "pinned memory made in a worker is of no use to the main process. "
                "Use num_workers=0, or pin_memory=True with fastpin.install().",
                RuntimeWarning, stacklevel=2)
        return _collate(batch, collate_fn_map=default_collate_fn_map)
    out = _collate(batch, collate_fn_map=_fn_map)
    count(batches=1)
    return out
