"""The one leaf pipeline: how a batch's leaves get into one arena block and back.

A batch is planned once: one walk (_walk.flatten) gives its structure and its
leaves; each leaf goes to the handler its type picks from one registry
(after SPDL's offload handlers): the handler says whether the leaf can lie in
a block and how (its Layout), where its bytes are read from, and how a host
view or a device view of the block gives it back. What no handler places in
a block takes the handler's ordinary path (torch's own pinning, or the leaf
unchanged). pack() lays every placed leaf into one block by one rule: each
leaf starts at a GRANULE-aligned offset, its pieces (the samples of a stacked
leaf) back to back. pin_memory, collate, the zero-copy workers and their
adoption, and the Loader's device copy all read the same plan.

Layouts are cached by what they depend on (type, dtype, shape, strides), so
the second and later batches of one structure skip the per-leaf planning.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from . import _C
from ._arena import cuda_available
from ._dtypes import torch_carrier

GRANULE = _C.GRANULE

def contiguous_strides(shape) -> tuple:
    """Row-major strides, in elements, of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(strides[::-1])


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


class Layout:
    """Where one leaf's bytes lie in a block, relative to its start, and what
    it comes back as. Made by a handler; shared by the leaves of every batch
    with the same type, dtype, shape and strides; small, and picklable (the
    zero-copy workers ship it)."""

    __slots__ = ("numpy", "dtype", "shape", "strides", "nbytes", "dense", "wrap", "carrier")

    def __init__(self, numpy, dtype, shape, strides, nbytes, dense, wrap=None):
        self.numpy = numpy      # True: an ndarray comes back; False: a torch tensor
        self.dtype = dtype      # the torch dtype, or the NumPy dtype object (fields kept)
        self.shape = shape      # tuple of sizes
        self.strides = strides  # in elements, of the view (contiguous, or the dense permutation)
        self.nbytes = nbytes    # bytes it takes
        self.dense = dense      # True: one memcpy from the source's address copies it
        self.wrap = wrap        # the subclass the view is given back as, or None
        # torch: ((code, bits, lanes), dtype to .view() as after import, or None)
        self.carrier = None if numpy else torch_carrier(dtype)

    def __reduce__(self):
        return (Layout, (self.numpy, self.dtype, self.shape, self.strides, self.nbytes,
                         self.dense, self.wrap))

    def host(self, block, offset: int):
        """A view of the leaf over `block` (not yet the subclass)."""
        if self.numpy:
            itemsize = self.dtype.itemsize
            return block.numpy(offset, self.shape, [s * itemsize for s in self.strides],
                               self.dtype)
        (code, bits, lanes), view_as = self.carrier
        out = _from_capsule()(block.dlpack(offset, self.shape, self.strides, code, bits, lanes))
        return out.view(view_as) if view_as is not None else out

    def device(self, buffer, offset: int):
        """A view of the leaf over `buffer`, a device tensor of the block's bytes;
        None where torch has no dtype for it."""
        dtype = _torch_dtype(self)
        if dtype is None:
            return None
        region = buffer[offset:offset + self.nbytes].view(dtype)
        if self.strides == contiguous_strides(self.shape):
            return region.view(self.shape)
        return region.as_strided(self.shape, self.strides)


_from_capsule_fn = None


def _from_capsule():
    """torch.from_dlpack for a capsule (what it calls for one, without its checks
    of the other kinds of argument)."""
    global _from_capsule_fn
    if _from_capsule_fn is None:
        import torch

        _from_capsule_fn = getattr(torch._C, "_from_dlpack", torch.from_dlpack)
    return _from_capsule_fn


_numpy_to_torch: dict = {}


def _torch_dtype(layout: Layout):
    """The torch dtype a leaf becomes on the device; None: torch has none for it."""
    if not layout.numpy:
        return layout.dtype
    return torch_dtype_of(layout.dtype)


def torch_dtype_of(dtype):
    """The torch dtype of NumPy dtype `dtype` on the device; None: torch has none."""
    if dtype not in _numpy_to_torch:
        import torch

        try:
            _numpy_to_torch[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
        except TypeError:
            _numpy_to_torch[dtype] = None
    return _numpy_to_torch[dtype]


# ---- the handlers --------------------------------------------------------------

class Handler:
    """What one kind of leaf does in the pipeline (override what differs).

    layout(x): its Layout, or None to take the ordinary path.
    source(x, layout): (address a memcpy reads, or 0 to gather after; the
        object to read from when gathering).
    out(view, x, layout): the leaf given back from its host view.
    ordinary(x): what the leaf becomes when it is not placed in a block.
    """

    stacks = False  # True: placed from several pieces (pieces(), gather_pieces())

    def layout(self, x) -> Optional[Layout]:
        return None

    def source(self, x, layout: Layout):
        return 0, x

    def gather(self, view, src) -> None:
        raise NotImplementedError

    def pieces(self, x, layout: Layout) -> list:
        raise NotImplementedError  # stacks only

    def gather_pieces(self, view, x, pieces) -> None:
        raise NotImplementedError  # stacks only

    def out(self, view, x, layout: Layout):
        return view

    def ordinary(self, x):
        return x

    def pinned(self, x) -> bool:
        """Whether x is page-locked already (then it comes back unchanged)."""
        return False

    def device_source(self, x):
        """For the Loader's copy to a device: the tensor whose bytes the leaf
        sends (contiguous where it is on the CPU), or None: it stays as it is."""
        return None


class _SelfPinning(Handler):
    """Objects with their own pin_memory() method: asked to pin themselves."""

    def ordinary(self, x):
        return x.pin_memory()


class _Arrays(Handler):
    """NumPy arrays, np.matrix and record arrays (their view of the block is
    all they are): placed unless they hold object references."""

    def __init__(self, wrap=None):
        self.wrap = wrap
        self.layouts: dict = {}

    def layout(self, a) -> Optional[Layout]:
        key = (a.dtype, a.shape, a.flags.c_contiguous)
        layout = self.layouts.get(key)
        if layout is None:
            if a.dtype.hasobject:
                return None  # references, not data: nothing to pin
            layout = self.layouts[key] = Layout(True, a.dtype, a.shape, contiguous_strides(a.shape),
                                                a.nbytes, a.flags.c_contiguous, self.wrap)
        return layout

    def source(self, a, layout: Layout):
        return (a.ctypes.data if layout.dense and layout.nbytes else 0), a

    def gather(self, view, src) -> None:
        np.copyto(view, src)

    def out(self, view, a, layout: Layout):
        return view.view(self.wrap) if self.wrap is not None else view

    def ordinary(self, a):
        return a if a.dtype.hasobject else a.copy()

    def device_source(self, a):
        # As the copy path always gave them: tensors (torch says so for a
        # dtype it has not, such as a structured one).
        return None if a.dtype.hasobject else _torch().from_numpy(np.ascontiguousarray(a))


class _KeptArrays(_Arrays):
    """Array subclasses fastpin does not place (masked arrays, memmaps, ...):
    passed through unchanged, as torch's pin_memory leaves them. The Loader
    still sends their data to a device, as it does any array's, except a
    masked array's (its data alone would unmask it)."""

    def layout(self, a):
        return None

    def ordinary(self, a):
        return a

    def device_source(self, a):
        return None if isinstance(a, np.ma.MaskedArray) else super().device_source(a)


_grad_function = None


def _attach_grad(src, out):
    """`out` (the pinned copy of `src`) as torch's pin_memory gives it back for
    an input that requires grad: a non-leaf whose gradient flows to src."""
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


class _Tensors(Handler):
    """Dense CPU torch tensors of a dtype fastpin exports (and subclasses that
    Tensor.pin_memory() converts with torch's default __torch_function__, or
    gives back plain, as Parameter); nested, sparse, quantized tensors and
    subclasses with their own __torch_function__ take torch's path."""

    def __init__(self, wrap=None):
        self.wrap = wrap
        self.layouts: dict = {}
        self.strided = _torch().strided  # made with torch imported: it has a tensor

    def layout(self, t) -> Optional[Layout]:
        if not t.is_cpu:
            raise ValueError(
                f"fastpin.pin_memory: a tensor on {t.device} cannot be pinned; "
                "only CPU tensors can (as with torch.Tensor.pin_memory)")
        if t.is_nested or t.layout is not self.strided:
            return None
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            key = (t.dtype, t.shape)  # the common case: the strides follow
            resolve = False
        else:
            resolve = t.is_conj() or t.is_neg()
            key = (t.dtype, t.shape, t.stride(), resolve)  # type: ignore[assignment]
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = self._make(t, resolve)
        return layout

    def _make(self, t, resolve: bool) -> Optional[Layout]:
        if torch_carrier(t.dtype) is None:
            return None
        shape = tuple(t.shape)
        nbytes = t.numel() * t.element_size()
        contiguous = t.is_contiguous()
        dense = not resolve and (contiguous or _is_dense(shape, t.stride()))
        # Dense permuted layouts (channels_last) keep their strides; contiguous
        # ones get canonical strides (size-1 dims may carry any stride in torch).
        strides = t.stride() if dense and not contiguous else contiguous_strides(shape)
        return Layout(False, t.dtype, shape, strides, nbytes, dense, self.wrap)

    @staticmethod
    def pinned(t) -> bool:
        return cuda_available() and t.is_pinned()

    def source(self, t, layout: Layout):
        if layout.dense:
            return (t.data_ptr() if layout.nbytes else 0), t
        if t.requires_grad:
            t = t.detach()
        return 0, (t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t)

    def gather(self, view, src) -> None:
        view.copy_(src)

    def out(self, view, t, layout: Layout):
        if t.requires_grad and _torch().is_grad_enabled():
            view = _attach_grad(t, view)
        return view.as_subclass(self.wrap) if self.wrap is not None else view

    def device_source(self, t):
        if t.is_cpu and (not t.is_contiguous() or t.is_conj() or t.is_neg()):
            return t.contiguous().resolve_conj().resolve_neg()
        return t

    def ordinary(self, t):
        if self.pinned(t):
            return t
        if not cuda_available():
            return t.clone()
        if t.is_quantized:
            # torch's own pin_memory fails on these with a message about copies.
            raise TypeError(f"fastpin.pin_memory: quantized tensors ({t.dtype}) cannot be "
                            "pinned, by fastpin or by torch; pin t.int_repr() instead")
        return t.pin_memory()


class _TorchPath(_Tensors):
    """Tensor subclasses with their own __torch_function__ or __torch_dispatch__:
    torch's pinning, whatever they are."""

    def layout(self, t):
        return None


class _Subclass(_Tensors):
    """A torch.Tensor subclass that fastpin can place: planned as the plain
    tensor it views, given back as torch would (self.wrap, or plain)."""

    def layout(self, t):
        return super().layout(t.as_subclass(_torch().Tensor))

    def source(self, t, layout):
        return super().source(t.as_subclass(_torch().Tensor), layout)


def _torch():
    return sys.modules["torch"]


class Stack:
    """A leaf to be stacked from samples of one shape and dtype (collate):
    placed as one tensor, its samples back to back."""

    __slots__ = ("samples",)

    def __init__(self, samples):
        self.samples = samples


class _Stacks(Handler):
    stacks = True

    def __init__(self):
        self.layouts: dict = {}

    def layout(self, s: Stack) -> Optional[Layout]:
        first = s.samples[0]
        key = (len(s.samples), first.dtype, first.shape)
        layout = self.layouts.get(key)
        if layout is None:
            shape = (len(s.samples), *first.shape)
            layout = self.layouts[key] = Layout(
                False, first.dtype, shape, contiguous_strides(shape),
                first.numel() * first.element_size() * len(s.samples), True)
        return layout

    def pieces(self, s: Stack, layout: Layout):
        """(address or 0, nbytes) of each sample."""
        n = layout.nbytes // len(s.samples)
        return [(t.data_ptr() if n and t.is_contiguous() and not (t.is_conj() or t.is_neg())
                 else 0, n) for t in s.samples]

    def gather_pieces(self, view, s: Stack, pieces) -> None:
        for i, (t, (address, n)) in enumerate(zip(s.samples, pieces)):
            if n and not address:
                view[i].copy_(t)

    def ordinary(self, s: Stack):
        from torch.utils.data._utils.collate import collate_tensor_fn

        return collate_tensor_fn(s.samples)


def stackable(batch) -> bool:
    """Whether fastpin can stack these samples into a block itself: dense CPU
    tensors of one shape and a dtype it exports; the rest goes to torch."""
    torch = _torch()
    elem = batch[0]
    return not (type(elem) is not torch.Tensor or not elem.is_cpu
                or elem.layout != torch.strided or elem.is_nested
                or torch_carrier(elem.dtype) is None
                or any(type(t) is not torch.Tensor or t.shape != elem.shape
                       or t.dtype != elem.dtype or t.device != elem.device for t in batch))


# ---- the registry -------------------------------------------------------------

_handlers: dict = {np.ndarray: _Arrays(), np.matrix: _Arrays(np.matrix),
                   np.recarray: _Arrays(np.recarray), Stack: _Stacks()}


def register(cls: type, handler: Handler) -> None:
    """Handle leaves of exactly type `cls` with `handler`."""
    _handlers[cls] = handler


def _subclass_rule(cls, torch):
    """How a torch.Tensor subclass comes back from Tensor.pin_memory(): "plain"
    (its __torch_function__ is disabled, as Parameter's), "wrap" (torch's default
    __torch_function__ converts results to the subclass), or None (its own
    __torch_function__ or __torch_dispatch__: torch's path)."""
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    dispatch = getattr(cls, "__torch_dispatch__", None)
    if getattr(dispatch, "__func__", dispatch) is not getattr(torch.Tensor, "__torch_dispatch__",
                                                              None):
        return None
    if function is torch._C._disabled_torch_function_impl:
        return "plain"
    if function is torch.Tensor.__torch_function__.__func__:
        return "wrap"
    return None


def handler_for(cls: type) -> Optional[Handler]:
    """The handler of leaves of type `cls`; None: not a leaf (a container or a
    value that passes through). Decided once per type."""
    try:
        return _handlers[cls]
    except KeyError:
        pass
    handler: Optional[Handler] = None
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(cls, torch.Tensor):
        if cls is torch.Tensor:
            handler = _Tensors()
        else:
            rule = _subclass_rule(cls, torch)
            if rule is None:
                handler = _TorchPath()
            else:
                handler = _Subclass(cls if rule == "wrap" else None)
    elif issubclass(cls, np.ndarray):
        handler = _KeptArrays()
    elif issubclass(cls, type):
        handler = None  # a class with a pin_memory attribute is not asked
    elif hasattr(cls, "pin_memory"):
        handler = _SELF_PINNING
    elif cls not in _NEVER_LEAVES:
        handler = _MAYBE  # instances may have one of their own (__getattr__, slots)
    _handlers[cls] = handler
    return handler


_SELF_PINNING = _SelfPinning()
_MAYBE = Handler()  # marker: ask the instance
_NEVER_LEAVES = frozenset((dict, list, tuple, str, bytes, bytearray, int, float, complex, bool,
                           type(None)))


def is_leaf(x) -> bool:
    """Whether the pipeline takes `x` as a leaf (what flatten stops at)."""
    handler = handler_for(type(x))
    if handler is _MAYBE:
        return hasattr(x, "pin_memory")
    return handler is not None


def _handler(x) -> Handler:
    handler = handler_for(type(x))
    assert handler is not None, "flatten gave a leaf no handler takes"
    return _SELF_PINNING if handler is _MAYBE else handler


# ---- a batch's plan -------------------------------------------------------------

class Plan:
    """One batch, planned: its leaves, each with its handler and Layout (None:
    the ordinary path), and where each placed leaf starts in the block."""

    __slots__ = ("leaves", "handlers", "layouts", "offsets", "nbytes", "data_bytes", "sources",
                 "reads")

    def __init__(self, leaves: list, keep_pinned: bool = True):
        self.leaves = leaves
        self.handlers: list[Handler] = []
        self.layouts: list[Optional[Layout]] = []
        self.offsets: list[int] = []
        self.sources: list[tuple[int, int]] = []   # (address, nbytes) for Arena.pin, align 1
        self.reads: list[Any] = []    # per placed leaf: what a gather reads (or pieces)
        handlers, layouts, offsets = self.handlers, self.layouts, self.offsets
        sources, reads = self.sources, self.reads
        check_pinned = keep_pinned and cuda_available()  # asks CUDA: not in workers
        offset = data = 0
        for x in leaves:
            h = _handlers.get(type(x))
            if h is None or h is _MAYBE:
                h = _handler(x)
            handlers.append(h)
            layout = h.layout(x)
            if layout is not None and check_pinned and h.pinned(x):
                layout = None  # pinned already: comes back unchanged
            layouts.append(layout)
            if layout is None:
                offsets.append(-1)
                continue
            gap = -offset % GRANULE
            if gap:
                sources.append((0, gap))
                offset += gap
            offsets.append(offset)
            if h.stacks:
                pieces = h.pieces(x, layout)
                sources.extend(pieces)
                reads.append(pieces)
            else:
                address, read = h.source(x, layout)
                sources.append((address, layout.nbytes))
                reads.append(None if address else read)
            offset += layout.nbytes
            data += layout.nbytes
        self.nbytes = offset      # the block's bytes, padding included
        self.data_bytes = data    # the leaves' own

    @property
    def placed(self) -> int:
        return len(self.reads)

    def host(self, block) -> list:
        """Every leaf given back over `block` (None: not placed in a block)."""
        outs = []
        reads = iter(self.reads)
        for x, h, layout, offset in zip(self.leaves, self.handlers, self.layouts, self.offsets):
            if layout is None:
                outs.append(h.ordinary(x))
                continue
            view = layout.host(block, offset)
            read = next(reads)
            if h.stacks:
                h.gather_pieces(view, x, read)
            elif read is not None:
                h.gather(view, read)
            outs.append(h.out(view, x, layout))
        return outs

    def fill(self, block) -> None:
        """Copy what memcpy could not (gathers, stacked pieces) into `block`."""
        reads = iter(self.reads)
        for x, h, layout, offset in zip(self.leaves, self.handlers, self.layouts, self.offsets):
            if layout is None:
                continue
            read = next(reads)
            if h.stacks:
                if not all(address for address, n in read if n):
                    h.gather_pieces(layout.host(block, offset), x, read)
            elif read is not None:
                h.gather(layout.host(block, offset), read)

    def ordinary(self) -> list:
        """Every leaf the ordinary way (no block: the arena was full)."""
        return [h.ordinary(x) for h, x in zip(self.handlers, self.leaves)]


def device_source(x):
    """The Loader's device copy of one tensor or array leaf: the tensor whose
    bytes it sends, or None where the leaf passes through unchanged (object
    arrays, masked arrays, memmaps)."""
    return _handler(x).device_source(x)


def device_views(refs: list, buffer) -> Optional[list]:
    """The leaves of (offset, Layout) refs as views of `buffer`, a device tensor
    of the block's bytes; None when one has a dtype torch does not know."""
    outs = []
    for offset, layout in refs:
        view = layout.device(buffer, offset)
        if view is None:
            return None
        outs.append(view)
    return outs

