"""fastpin.install(): DataLoader(pin_memory=True) pins through fastpin, and its
workers collate straight into a shared pinned arena (zero-copy).

Two hooks, both undone by uninstall():

- torch's pin function (torch.utils.data._utils.pin_memory.pin_memory), which
  DataLoader's pin thread and its single-process path look up at each batch,
  becomes fastpin.pin_memory.
- zero-copy (unless install(zero_copy=False) or FASTPIN_ZERO_COPY=0): every
  DataLoader iterator runs _BaseDataLoaderIter.__init__ (torch's and
  torchdata's StatefulDataLoader's alike) before it starts its workers with
  the collate_fn that __init__ read. For a DataLoader with pin_memory=True and
  workers, the hook gives that iterator _zerocopy's collate_fn over a
  self-sizing Pool (one per DataLoader, kept while the DataLoader lives, so
  later epochs find it sized). The DataLoader itself is not touched: its
  collate_fn stays the user's, and iterators made after uninstall() are
  stock. An iterator keeps its collate_fn (its workers were started with
  it) and its pool to its end, so an epoch in flight finishes either way.

What arrives is adopted in the main process as it is unpickled
(_zerocopy._adopt_installed): with a pin thread (a GPU), as a PinnedInWorkers
whose pin_memory() gives its host views, already pinned, and pins the leaves
the worker could not place; without one (torch turns pin_memory off where
there is no accelerator) as the views themselves: the batch is exact either
way, and DataLoader's per-tensor shared-memory IPC is gone in both.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

from . import _torch
from ._pin import pin_memory
from ._runtime import check_bool, process, replaced, settings

_lock = threading.Lock()
# The depth a Pool is sized for beyond the workers' batches in flight: the
# batch the user holds and the one the pin thread hands over.
_DEPTH = 2


def _target():
    _torch.require("fastpin.install")
    from torch.utils.data._utils import pin_memory as module
    return module


def _iterators():
    from torch.utils.data import dataloader
    return dataloader._BaseDataLoaderIter


def install(zero_copy: Optional[bool] = None) -> None:
    """Make every DataLoader with pin_memory=True pin through fastpin.pin_memory,
    and (zero_copy, default True unless FASTPIN_ZERO_COPY=0) collate in its
    workers straight into a shared pinned arena when it has workers.

    DataLoader's pin thread (and its single-process path) look up
    torch.utils.data._utils.pin_memory.pin_memory at each batch, so loaders
    already made switch over too; zero-copy applies to every iterator made from
    now on, of DataLoaders made before too. Idempotent (a second call sets
    zero_copy as it says); undone by uninstall()."""
    module = _target()
    zero_copy = settings.zero_copy if zero_copy is None else check_bool("zero_copy", zero_copy)
    iterators = _iterators()
    with _lock:
        if "pin_memory" not in replaced:
            replaced["pin_memory"] = module.pin_memory
            module.pin_memory = pin_memory
        if zero_copy and "iterator_init" not in replaced:
            original = replaced["iterator_init"] = iterators.__init__

            def __init__(self, loader, *args, **kwargs):
                original(self, loader, *args, **kwargs)
                _zero_copy(self, loader)

            __init__.__wrapped__ = original
            iterators.__init__ = __init__
        elif not zero_copy and "iterator_init" in replaced:
            iterators.__init__ = replaced.pop("iterator_init")
            process.installed_pools.clear()


def uninstall() -> None:
    """Restore PyTorch's own pinning function and iterators (for iterators made
    from now on; one in flight finishes its epoch as it began)."""
    with _lock:
        if "pin_memory" in replaced:
            _target().pin_memory = replaced.pop("pin_memory")
        if "iterator_init" in replaced:
            _iterators().__init__ = replaced.pop("iterator_init")
        process.installed_pools.clear()  # each goes once its iterators are gone


def installed() -> bool:
    return "pin_memory" in replaced


def _zero_copy(it, loader) -> None:
    """Give DataLoader iterator `it`, just made from `loader` and before it starts
    its workers, the collate_fn that places batches in the shared arena."""
    if not (getattr(loader, "pin_memory", False) and getattr(it, "_num_workers", 0) > 0):
        return
    from . import _zerocopy

    collate = it._collate_fn
    if isinstance(collate, _zerocopy._WorkerCollate):
        return  # a fastpin.Loader's own view of the DataLoader
    pool = _pool_for(loader)
    it._collate_fn = _zerocopy.wrap_collate(
        collate, pool, (pool.directory[0], bool(getattr(it, "_pin_memory", False))))
    # The iterator holds the pool (its workers write into it) to its end; then,
    # its workers shut down, what they held and nobody adopted goes back.
    weakref.finalize(it, pool.reclaim).atexit = False


def _pool_for(loader):
    """The self-sizing pool of `loader`'s iterators, made on first use for the
    current GPU, kept while `loader` lives (a weak key: the pool holds only
    what sizing needs, never the DataLoader)."""
    import types

    from . import _numa, _zerocopy
    from ._arena import device_index

    index = device_index(None)
    try:
        cached = process.installed_pools.get(loader)
    except TypeError:  # unhashable: a pool for this iterator alone
        cached = None
    if cached is not None and cached[0] == index:
        cached[1].reclaim()  # blocks a previous epoch's killed workers held
        return cached[1]
    make = _zerocopy.shared_maker(index, _numa.for_device(index if index >= 0 else None).node)
    shape = types.SimpleNamespace(num_workers=loader.num_workers,
                                  prefetch_factor=loader.prefetch_factor)
    pool = _zerocopy.Pool(make, loader=shape, depth=_DEPTH, cap=_zerocopy.default_cap(index >= 0))
    pool.warn_fallbacks = True  # no Loader here to say so: the pool does (tell_fallbacks)
    try:
        process.installed_pools[loader] = (index, pool)
    except TypeError:
        pass
    return pool
