"""fastpin.pin_memory: a batch's tensor and array leaves into one arena block."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from . import _C, _graphs
from ._arena import cuda_available, default_arena, policy
from ._dtypes import torch_carrier
from ._walk import flatten, unflatten

log = logging.getLogger("fastpin")

_counters_lock = threading.Lock()
_counters = {"batches": 0, "leaves": 0, "bytes": 0, "fallbacks": 0}


def _count(batches: int = 0, leaves: int = 0, nbytes: int = 0, fallbacks: int = 0) -> None:
    with _counters_lock:
        _counters["batches"] += batches
        _counters["leaves"] += leaves
        _counters["bytes"] += nbytes
        _counters["fallbacks"] += fallbacks


def counters() -> dict:
    with _counters_lock:
        return dict(_counters)


def _is_dense(sizes, strides) -> bool:
    """True when the elements fill their span exactly once (a permutation of a
    contiguous layout, channels_last included), so one memcpy copies them."""
    expected = 1
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# A leaf's plan: how it gets into the block, and how it comes back out.
_COPY, _GATHER, _KEEP, _TORCH, _CUSTOM = range(5)


class _Leaf:
    __slots__ = ("obj", "how", "nbytes", "source", "wrap", "grad", "input")

    def __init__(self, obj, how, nbytes=0, source=0, wrap=None, grad=None, input=None):
        self.obj = obj          # what is copied: the input, plain, detached, conj resolved
        self.input = obj if input is None else input  # the input leaf (the ordinary path's)
        self.how = how          # one of _COPY, _GATHER, _KEEP, _TORCH, _CUSTOM
        self.nbytes = nbytes    # bytes it takes in the block
        self.source = source    # address memcpy reads from (_COPY only)
        self.wrap = wrap        # the subclass the output is viewed as, or None
        self.grad = grad        # the input the output's grad_fn leads to, or None


# Array subclasses whose view of the block is all they are; any other (masked
# arrays, memmaps, ...) is returned unchanged, as torch's pin_memory does.
_ARRAY_VIEWS = (np.matrix, np.recarray)

_subclass_rules: dict = {}


def _subclass_rule(cls, torch):
    """How a torch.Tensor subclass comes back from Tensor.pin_memory(): "plain"
    (its __torch_function__ is disabled, as Parameter's: a plain tensor), "wrap"
    (torch's default __torch_function__ converts results to the subclass), or
    None (its own __torch_function__ or __torch_dispatch__: torch's path)."""
    rule = _subclass_rules.get(cls, False)
    if rule is False:
        function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        dispatch = getattr(cls, "__torch_dispatch__", None)
        dispatch = getattr(dispatch, "__func__", dispatch)
        if dispatch is not getattr(torch.Tensor, "__torch_dispatch__", None):
            rule = None
        elif function is torch._C._disabled_torch_function_impl:
            rule = "plain"
        elif function is torch.Tensor.__torch_function__.__func__:
            rule = "wrap"
        else:
            rule = None
        _subclass_rules[cls] = rule
    return rule


_grad_function = None


def _attach_grad(src, out):
    """`out` (the pinned copy of `src`) as torch's pin_memory gives it back
    for an input that requires grad: a non-leaf whose gradient flows to src."""
    global _grad_function
    if _grad_function is None:
        import torch

        class PinMemory(torch.autograd.Function):
            @staticmethod
            def forward(ctx, src, holder):
                return holder[0]

            @staticmethod
            def backward(ctx, grad):
                return grad, None

        _grad_function = PinMemory
    return _grad_function.apply(src, [out])


def _plan_tensor(t, torch) -> _Leaf:
    given = t
    if t.device.type != "cpu":
        raise ValueError(
            f"fastpin.pin_memory: a tensor on {t.device} cannot be pinned; "
            "only CPU tensors can (as with torch.Tensor.pin_memory)")
    wrap = None
    if type(t) is not torch.Tensor:
        rule = _subclass_rule(type(t), torch)
        if rule is None:
            return _Leaf(t, _TORCH)
        wrap = type(t) if rule == "wrap" else None
        t = t.as_subclass(torch.Tensor)
    if (t.layout != torch.strided or t.is_quantized or t.is_nested
            or torch_carrier(t.dtype) is None):
        return _Leaf(given, _TORCH)
    if cuda_available() and t.is_pinned():
        return _Leaf(given, _KEEP)
    grad = t if t.requires_grad and torch.is_grad_enabled() else None
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() or _is_dense(t.shape, t.stride()):
        return _Leaf(t, _COPY, nbytes, t.data_ptr() if nbytes else 0, wrap, grad, given)
    return _Leaf(t, _GATHER, nbytes, 0, wrap, grad, given)


def _plan_array(a: np.ndarray) -> _Leaf:
    wrap = None
    if type(a) is not np.ndarray:
        if type(a) not in _ARRAY_VIEWS:
            return _Leaf(a, _KEEP)
        wrap = type(a)
    if a.dtype.hasobject:
        return _Leaf(a, _KEEP)  # references, not data: nothing to pin
    if a.flags.c_contiguous:
        return _Leaf(a, _COPY, a.nbytes, a.ctypes.data if a.nbytes else 0, wrap)
    return _Leaf(a, _GATHER, a.nbytes, 0, wrap)


def _contiguous_strides(shape) -> tuple:
    """Row-major strides, in elements, of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(strides[::-1])


def _tensor_out(block, offset, leaf: _Leaf, torch):
    t = leaf.obj
    (code, bits, lanes), view_as = torch_carrier(t.dtype)
    shape = tuple(t.shape)
    # Dense permuted layouts (channels_last) keep their strides; contiguous
    # ones get canonical strides (size-1 dims may carry any stride in torch).
    dense_permuted = leaf.how == _COPY and not t.is_contiguous()
    strides = t.stride() if dense_permuted else _contiguous_strides(shape)
    out = torch.from_dlpack(block.dlpack(offset, shape, strides, code, bits, lanes))
    if view_as is not None:
        out = out.view(view_as)
    if leaf.how == _GATHER:
        out.copy_(t)
    if leaf.grad is not None:
        out = _attach_grad(leaf.grad, out)
    return out.as_subclass(leaf.wrap) if leaf.wrap is not None else out


def _array_out(block, offset, leaf: _Leaf):
    a = leaf.obj
    strides = [s * a.itemsize for s in _contiguous_strides(a.shape)]
    out = block.numpy(offset, a.shape, strides, a.dtype)
    if leaf.how == _GATHER:
        np.copyto(out, a)
    return out.view(leaf.wrap) if leaf.wrap is not None else out


def _torch_pin(t):
    """The ordinary path: torch's own pinning (or a copy where no GPU can pin)."""
    if not cuda_available():
        return t.clone()
    if t.is_quantized:
        # torch's own pin_memory fails on these with a message about copies.
        raise TypeError(f"fastpin.pin_memory: quantized tensors ({t.dtype}) cannot be pinned, "
                        "by fastpin or by torch; pin t.int_repr() instead")
    return t.pin_memory()


_fence_any_state = None


def _fence_any() -> bool:
    """Whether a block's free fence covers every stream (the driver has
    cuCtxRecordEvent); remembered, the driver does not change."""
    global _fence_any_state
    if _fence_any_state is None:
        _fence_any_state = bool(_C.cuda_status().get("fence_any"))
    return _fence_any_state


class _Fallback(Exception):
    """The policy says: pin this batch the ordinary way."""


_warned_too_big = False


def _pin_with_policy(arena, sources, on_full: str, align: int = _C.GRANULE):
    """arena.pin(sources, align), or what the full-arena policy says instead
    (raises _Fallback when that is the ordinary path)."""
    global _warned_too_big
    total = sum((n + align - 1) // align * align for _, n in sources)
    if total > arena.capacity:
        message = (f"a batch of {total} bytes cannot be pinned in an arena of "
                   f"{arena.capacity} bytes: raise the cap with fastpin.configure(capacity=...) "
                   "or FASTPIN_ARENA_BYTES")
        if on_full != "fallback":
            raise _C.ArenaFullError(message)
        if not _warned_too_big:
            _warned_too_big = True
            log.warning("fastpin: %s; such batches are pinned the ordinary way", message)
        raise _Fallback
    deadline = None
    delay = 0.0005
    while True:
        try:
            return arena.pin(sources, align)
        except _C.ArenaFullError as e:
            if on_full == "fallback":
                log.debug("fastpin: %s; pinning this batch the ordinary way", e)
                raise _Fallback from None
            if on_full == "raise":
                raise
            # "wait": until the consumer frees batches, within the timeout.
            now = time.monotonic()
            if deadline is None:
                deadline = now + policy()["wait_timeout"]
            if now >= deadline:
                raise _C.ArenaFullError(
                    f"{e}; waited {policy()['wait_timeout']:g} s for room "
                    "(fastpin.configure(on_full=..., wait_timeout=...))") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            arena.collect()


def pin_memory(data: Any, device: Optional[str] = None, *,
               arena: Optional[_C.Arena] = None, stream: Any = None,
               on_full: Optional[str] = None) -> Any:
    """Return `data` with every tensor and NumPy array leaf copied into page-locked
    memory, in one block of fastpin's arena, by its copy threads with the GIL
    released. The structure comes back as it went in (see _walk.map_leaves); torch
    tensors stay torch tensors and arrays stay arrays; tensors already pinned come
    back unchanged; objects with a pin_memory() method are asked to pin
    themselves. `device` ("cuda", "cuda:N", an int; DataLoader's pin thread passes
    "cuda" with its device current) picks the GPU's default arena, whose frees wait
    for that GPU's copies; None: the current GPU. The memory is pinned for every
    GPU either way. Non-contiguous inputs come back contiguous
    (dense permuted layouts such as channels_last keep their strides).

    The block is reused only after its tensors are gone and every GPU copy
    queued before that, on any stream of the device, has finished (a fence over
    the device's whole context), so a non_blocking copy from it is safe on
    whatever stream it is issued: the default one, a prefetcher's side stream,
    an ExternalStream. `stream` (a torch.cuda.Stream or a raw handle) is needed
    only with a driver older than CUDA 12.5, whose fence covers the default
    stream alone (fastpin.cuda_status().fence_any is False there): name the
    stream your copies run on.

    on_full overrides fastpin.configure(on_full=...) for this call: "fallback",
    "wait" or "raise" (see configure)."""
    if not _graphs.watching:
        _graphs.watch()
    if on_full is not None and on_full not in ("fallback", "wait", "raise"):
        raise ValueError(f"on_full must be 'fallback', 'wait' or 'raise', not {on_full!r}")
    torch = sys.modules.get("torch")
    tensor_type = torch.Tensor if torch is not None else ()

    def is_leaf(x):
        return (isinstance(x, (np.ndarray, tensor_type))
                or (not isinstance(x, type) and hasattr(x, "pin_memory")))

    spec, inputs = flatten(data, is_leaf)  # one walk: the rebuild uses this record
    leaves = []
    for x in inputs:
        if isinstance(x, tensor_type):
            leaves.append(_plan_tensor(x, torch))
        elif isinstance(x, np.ndarray):
            leaves.append(_plan_array(x))
        else:
            leaves.append(_Leaf(x, _CUSTOM))
    pinned = [leaf for leaf in leaves if leaf.how in (_COPY, _GATHER)]
    block, offsets = None, ()
    if pinned:
        arena = arena if arena is not None else default_arena(device)
        try:
            block, offsets = _pin_with_policy(arena, [(leaf.source, leaf.nbytes) for leaf in pinned],
                                              on_full or policy()["on_full"])
        except _Fallback:
            for leaf in pinned:
                leaf.how = _TORCH
            pinned = []
            _count(fallbacks=1)
        if block is not None and stream is not None and not _fence_any():
            # An old driver fences the default stream alone: add the one named.
            block.consumer_stream = getattr(stream, "cuda_stream", stream)
    results = iter(offsets)

    def build(leaf: _Leaf):
        if leaf.how in (_COPY, _GATHER):
            offset = next(results)
            if isinstance(leaf.obj, np.ndarray):
                return _array_out(block, offset, leaf)
            return _tensor_out(block, offset, leaf, torch)
        if leaf.how == _TORCH:
            if isinstance(leaf.input, np.ndarray):
                return leaf.input.copy()
            return _torch_pin(leaf.input)
        if leaf.how == _CUSTOM:
            return leaf.obj.pin_memory()
        return leaf.input

    out = unflatten(spec, [build(leaf) for leaf in leaves])
    _count(batches=1, leaves=len(pinned), nbytes=sum(leaf.nbytes for leaf in pinned))
    return out
