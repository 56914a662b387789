"""Receiving a zero-copy batch: what a DataLoader worker ships, and how the
main process takes it over.

A worker's _zerocopy._WorkerCollate ships a _Shipped (its block and the
batch's layout record); unpickled in the main process, it adopts its block
(_adopt: the main process owns it from then on) and the batch is made from its
layout record in one C call (_record.decode): its host views (Adopted.views,
receive), or views of one device buffer that one copy of the whole block fills
(device_views, for _delivery.CopyToDevice). fastpin.install() ships with a
handover (_adopt_installed): for the pin thread (PinnedInWorkers), as host
views, or as it is, for install(device=...)'s delivery.
"""
from __future__ import annotations

from typing import Any, Optional

from . import _leaves, _pin, _record
from ._segments import _pools, _registry


class _Shipped:
    """What crosses the result queue: the block, and the batch's layout record
    with the objects it names (_record)."""

    __slots__ = ("token", "index", "nbytes", "layout", "block", "ship")

    def __init__(self, token, index, nbytes, layout, block=None, ship=None):
        self.token, self.index, self.nbytes = token, index, nbytes
        self.layout = layout  # (record, objects, tree, data bytes): _record.encode
        self.block = block    # the worker's hold, given up once pickled
        self.ship = ship      # None: for a Loader; install(): (pool id, handover)

    def __reduce__(self):
        if self.block is not None:
            # From here the main process owns the block: the worker must not
            # free it when its Block object dies.
            self.block.detach()
            self.block = None
        if self.ship is not None:
            return (_adopt_installed, (self.token, self.index, self.nbytes, *self.layout,
                                       *self.ship))
        return (_adopt, (self.token, self.index, self.nbytes, *self.layout))

    def pin_memory(self):
        return self  # DataLoader's pin thread: already pinned


class Adopted:
    """A shipped batch in the main process, its block adopted."""

    __slots__ = ("block", "record", "objects", "tree", "nbytes")

    def __init__(self, block, record, objects, tree, nbytes):
        self.block, self.record, self.objects, self.tree = block, record, objects, tree
        self.nbytes = nbytes  # the batch's tensor and array bytes

    def views(self, ordinary=None, leaf=None):
        """The batch, its leaves views of the block (leaf(view) where given),
        those not in the block ordinary(x), or as they are: one C call."""
        if not _pin._torch_seen:
            _pin._use_torch()
        return _record.decode(self.block, self.record, self.objects, self.tree, ordinary, leaf)

    def pin_memory(self):
        return self


class PinnedInWorkers(Adopted):
    """install(), with DataLoader's pin thread: a batch its worker placed in the
    shared arena, made into its host views by the pin thread, whichever pin
    function is installed when it arrives (after uninstall() too). The leaves
    the worker could not place (objects with their own pin_memory() among them)
    go through that pin function, as with the stock DataLoader."""

    __slots__ = ()

    def pin_memory(self, device=None):
        from torch.utils.data._utils import pin_memory as torch_pin

        return self.views(torch_pin.pin_memory)


def _adopt(token, index, nbytes, record, objects, tree, data_bytes):
    arena = _registry().get(token)
    if arena is None:
        raise RuntimeError(
            "fastpin: a batch arrived from a zero-copy worker, but its arena is not known in "
            "this process (unpickled outside the Loader that made it?)")
    return Adopted(arena.adopt(index, nbytes), record, objects, tree, data_bytes)


# install(): how the main process hands an adopted batch on (_Shipped.ship[1]).
VIEWS, PIN_THREAD, DELIVER = 0, 1, 2


def _adopt_installed(token, index, nbytes, record, objects, tree, data_bytes, pool, handover):
    """A batch of an iterator fastpin.install() set up, as it is unpickled in the
    main process (the pin thread, or the iterator itself where none runs): for
    the pin thread to make into views (PIN_THREAD: a PinnedInWorkers), its views
    now (VIEWS), or as it is, for install(device=...)'s delivery (DELIVER: the
    Adopted, which it copies to the device as one block)."""
    batch = _adopt(token, index, nbytes, record, objects, tree, data_bytes)
    if handover == DELIVER:
        return batch  # its step looks at the GPU's fences itself
    own = _pools.get(pool)
    if own is not None:
        own.collect()  # only this process can see the GPU finish with blocks
    if handover == PIN_THREAD:
        return PinnedInWorkers(batch.block, record, objects, tree, data_bytes)
    return receive(batch)[0]


def adopted(batch: Any) -> Any:
    """The batch as the main process holds it: an Adopted for a batch a worker
    placed in the arena (also one collated here, num_workers=0), else as it came."""
    if isinstance(batch, _Shipped):  # collated in this process (num_workers=0)
        if batch.block is not None:
            batch.block.detach()  # handed over to the adopting Block below
        batch = _adopt(batch.token, batch.index, batch.nbytes, *batch.layout)
    return batch


def receive(batch: Any, consumer_stream: Any = None) -> tuple:
    """For a batch as adopted() gives it: (batch with tensors over the adopted
    block, True), or (batch, False) for a batch that came the ordinary way (a
    worker fell back)."""
    if not isinstance(batch, Adopted):
        return batch, False
    if consumer_stream is not None:
        batch.block.consumer_stream = consumer_stream
    return batch.views(), True


def _uint8():
    import torch

    return torch.uint8


def device_views(batch: "Adopted", buffer, ordinary=None) -> Optional[Any]:
    """The batch with each leaf a view of `buffer`, a device tensor of the
    block's bytes (its length a multiple of 16 bytes; of the leaves' one dtype
    where they have one, _record.one_dtype, else uint8) that one copy fills (at the leaf's offset, with its shape and
    strides: _record.device_specs), those not in the block ordinary(x) (or as
    they are); None when a leaf has a NumPy dtype torch does not know (the
    caller then takes the ordinary path, which says so)."""
    objects = batch.objects
    # dtype -> the whole buffer viewed as it: one view a leaf, not three; the
    # buffer itself for its own dtype.
    typed: dict = {buffer.dtype: buffer}
    views = []
    for (offset, nbytes, dtype, obj, numpy, shape, strides,
         grad) in _record.device_specs(batch.record):
        if obj is not None:  # a NumPy dtype object, or a torch dtype to view as
            dtype = _leaves.torch_dtype_of(objects[obj]) if numpy else objects[obj]
        if dtype is None:
            return None
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        step = whole.element_size()
        if offset % step:  # never for fastpin's blocks (leaves are granule-aligned)
            raw = buffer.view(_uint8())  # a byte offset: slice the bytes
            view = raw[offset:offset + nbytes].view(dtype).as_strided(shape, strides)
        else:
            view = whole.as_strided(shape, strides, offset // step)
        views.append(view.requires_grad_() if grad else view)
    return batch.views(ordinary, leaf=views)
