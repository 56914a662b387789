"""fastpin.install(): DataLoader(pin_memory=True) pins through fastpin, its
workers collate straight into a shared pinned arena (zero-copy), and, with
install(device="cuda"), its batches arrive on the GPU.

Two hooks, both undone by uninstall():

- torch's pin function (torch.utils.data._utils.pin_memory.pin_memory), which
  DataLoader's pin thread and its single-process path look up at each batch,
  becomes fastpin.pin_memory.
- every DataLoader iterator runs _BaseDataLoaderIter.__init__ (torch's and
  torchdata's StatefulDataLoader's alike) before it starts its workers with
  the collate_fn that __init__ read, and before it starts its pin thread. For
  a DataLoader with pin_memory=True and workers, the hook (_on_iterator):
  - zero-copy (unless install(zero_copy=False) or FASTPIN_ZERO_COPY=0): gives
    the iterator _zerocopy's collate_fn over a self-sizing Pool (one per
    DataLoader, kept while the DataLoader lives, so later epochs find it
    sized);
  - device (install(device=...) or FASTPIN_INSTALL_DEVICE): turns its pin
    thread off and mixes _ahead.Delivering into it, so that each batch goes
    from the worker through the delivery engine (the same step as
    Loader(device)'s), copied on a side stream `_DEPTH` batches ahead in the
    consumer's own next(), ready on the consumer's current stream.
  The DataLoader itself is not touched: its collate_fn stays the user's, and
  iterators made after uninstall() are stock. An iterator keeps what it was
  given (its workers were started with it) to its end, so an epoch in flight
  finishes either way.

The second hook, once made (by install() or a Loader's first epoch), stays:
it does nothing for the iterators of a stock DataLoader iterated outside
install() and a Loader, and gives those of install() and of a Loader's own
iter() the queues of _queues (_own_queues): their workers' indices are
written into the pipe by the thread that asks for them, not by a feeder
thread woken per batch, and their result queue wakes its reader without one.

The first hook also serves fastpin.Loader: a copying Loader over a DataLoader
with workers iterates a view of it with pin_memory=True, and while such a
view's pin thread runs, torch's pin function is _dispatch, which pins that
thread's batches through the Loader's step (serve_pin_thread) and sends every
other call where it went before (fastpin's pin with install(), else torch's).

What arrives is adopted in the main process as it is unpickled
(_zerocopy._adopt_installed): with a pin thread (a GPU), as a PinnedInWorkers
whose pin_memory() gives its host views, already pinned, and pins the leaves
the worker could not place; without one (torch turns pin_memory off where
there is no accelerator) as the views themselves; delivered to a device, as
the adopted block, which the step copies as one. The batch is exact either
way, and DataLoader's per-tensor shared-memory IPC is gone in all three.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from multiprocessing import queues as mp_queues
from typing import Any, Optional

from . import _ahead, _delivery, _graphs, _numa, _queues, _torch
from ._arena import cuda_status, device_index
from ._pin import pin_memory
from ._runtime import check_bool, cuda_available, process, replaced, settings
from ._segments import shape_of

_lock = threading.Lock()
# The depth a Pool is sized for beyond the workers' batches in flight: the
# batch the user holds and the one the pin thread hands over; delivered to a
# device, the batches prepared ahead of the consumer (their blocks are freed
# once copied).
_DEPTH = 2
# What install() set, read by the hook when an iterator is made: zero_copy,
# and the device batches go to (None: pinned on the host; a torch.device of
# type cuda, its index None for the current GPU when the iterator is made).
_mode: dict = {"zero_copy": False, "device": None}


def _target():
    _torch.require("fastpin.install")
    from torch.utils.data._utils import pin_memory as module
    return module


def _iterators():
    from torch.utils.data import dataloader
    return dataloader._BaseDataLoaderIter


# The pin threads of DataLoader iterators that a copying fastpin.Loader reads
# (its view of a DataLoader with workers, pin_memory=True: _loader._own_workers):
# thread ident -> (that Thread, the epoch's pin function). While any is
# registered, torch's pin function is _dispatch, which sends those threads'
# batches to their Loader and every other call where it went before.
_pinners: dict = {}
_torch_pin: Any = None  # torch's own pin function, as first found
# Loader epochs between making a view's iterator (which starts its pin thread)
# and serving that thread; _served is notified as each registers or gives up.
_expecting = 0
_served = threading.Condition(_lock)
_WAIT = 10.0  # seconds a pin thread waits to be named before it pins as torch does


def _original(module) -> Any:
    """torch's own pin function (found in `module` the first time)."""
    global _torch_pin
    current = module.pin_memory
    if current is not pin_memory and current is not _dispatch:
        _torch_pin = current
    return _torch_pin


def _dispatch(data, device=None):
    ident, thread = threading.get_ident(), threading.current_thread()
    entry = _pinners.get(ident)
    if (entry is None or entry[0] is not thread) and _expecting and _is_pin_loop(thread):
        # A pin thread whose batch came before its Loader could name it (the
        # epoch is being made in another thread): its batches are the Loader's
        # too, so it waits to be named.
        with _served:
            _served.wait_for(lambda: not _expecting or _pinners.get(ident, (None,))[0] is thread,
                             timeout=_WAIT)
        entry = _pinners.get(ident)
    if entry is not None and entry[0] is thread:
        return entry[1](data)
    return (pin_memory if "pin_memory" in replaced else _torch_pin)(data, device)


def _is_pin_loop(thread) -> bool:
    """Whether `thread` runs DataLoader's pin loop."""
    loop = getattr(_target(), "_pin_memory_loop", None)
    return loop is not None and getattr(thread, "_target", None) is loop


class expecting_pin_thread:
    """Around making a copying Loader's epoch (its view's iterator starts the pin
    thread) and serve_pin_thread: a batch that reaches the new pin thread
    meanwhile waits for it (_dispatch), so every batch is pinned the Loader's
    way."""

    def __enter__(self):
        global _expecting
        module = _target()
        with _lock:
            _original(module)
            _expecting += 1
            _refresh(module)

    def __exit__(self, *exc):
        global _expecting
        with _lock:
            _expecting -= 1
            _refresh(_target())
            _served.notify_all()


def _refresh(module) -> None:
    """torch's pin function as install() and the registered pin threads want it
    (under _lock)."""
    module.pin_memory = (_dispatch if _pinners or _expecting else
                         pin_memory if "pin_memory" in replaced else _torch_pin)


def serve_pin_thread(it, pinner) -> None:
    """DataLoader iterator `it`'s pin thread (if it runs one) pins through
    pinner(batch) from now on, until `it` is gone; a later call (persistent
    workers, the next epoch) replaces the pinner."""
    thread = getattr(it, "_pin_memory_thread", None)
    if thread is None or thread.ident is None:
        return
    module = _target()
    with _lock:
        _original(module)
        # A stale entry (a thread gone, its ident reused) is this one's now.
        first = _pinners.get(thread.ident, (None,))[0] is not thread
        _pinners[thread.ident] = (thread, pinner)
        _refresh(module)
        _served.notify_all()
    if first:
        weakref.finalize(it, _release, thread.ident, thread).atexit = False


def _release(ident: int, thread) -> None:
    with _lock:
        entry = _pinners.get(ident)
        if entry is not None and entry[0] is thread:
            del _pinners[ident]
            _refresh(_target())


def install(zero_copy: Optional[bool] = None, device: Any = None) -> None:
    """Make every DataLoader with pin_memory=True pin through fastpin.pin_memory,
    and (zero_copy, default True unless FASTPIN_ZERO_COPY=0) collate in its
    workers straight into a shared pinned arena when it has workers.

    device: "cuda", "cuda:N", N or a torch.device of type cuda (default: None,
    or FASTPIN_INSTALL_DEVICE): every iterator made from now on of a
    DataLoader with pin_memory=True and workers yields its batches already on
    that GPU ("cuda": the current one when the iterator is made, so one
    process per GPU under torchrun gets its own), in the same structure:
    copied on a side stream 2 batches ahead of the loop, the loop's current
    stream made to wait on each; a copy still running when its batch is handed
    over is waited for on the host too, so that a side stream of the user's
    own (timm's prefetcher) sees the batch whole. The loop's own
    .to(device, non_blocking=True) is then a no-op. The GPU memory held is
    those batches, returned when the iterator ends (its end, del, a new epoch,
    its workers shut down). A StatefulDataLoader's iterator takes no batch
    ahead (its state counts what it handed over), its copy still on the side
    stream. Without a usable GPU, install(device=...) raises at once.

    DataLoader's pin thread (and its single-process path) look up
    torch.utils.data._utils.pin_memory.pin_memory at each batch, so loaders
    already made switch over too; zero-copy and device delivery apply to every
    iterator made from now on, of DataLoaders made before too. Idempotent (a
    second call sets zero_copy and device as it says); undone by uninstall()."""
    module = _target()
    zero_copy = settings.zero_copy if zero_copy is None else check_bool("zero_copy", zero_copy)
    cuda = _cuda_device(settings.install_device if device is None else device)
    with _lock:
        if "pin_memory" not in replaced:
            replaced["pin_memory"] = _original(module)
            _refresh(module)
        _mode.update(zero_copy=zero_copy, device=cuda)
        _hook_iterators()
        if not zero_copy:
            process.installed_pools.clear()


def uninstall() -> None:
    """Restore PyTorch's own pinning function, and its own iterators for
    DataLoaders iterated from now on (one in flight finishes its epoch as it
    began; fastpin.Loader's own iterators keep sending indices without a feeder
    thread: see IndexQueue)."""
    with _lock:
        if "pin_memory" in replaced:
            replaced.pop("pin_memory")
            _refresh(_target())
        _mode.update(zero_copy=False, device=None)
        process.installed_pools.clear()  # each goes once its iterators are gone


def installed() -> bool:
    return "pin_memory" in replaced


def _cuda_device(device: Any):
    """install()'s `device` as a torch.device of type cuda (index None: the
    current GPU when an iterator is made), or None; raises at once where no
    GPU is usable, saying why."""
    if device is None:
        return None
    torch = sys.modules["torch"]
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError("fastpin.install: device must be None, 'cuda', 'cuda:N', an int or a "
                        f"torch.device, not {device!r}")
    try:
        cuda = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except RuntimeError as exc:
        raise ValueError(f"fastpin.install: device={device!r}: {exc}") from None
    if cuda.type != "cuda":
        raise ValueError(f"fastpin.install(device={device!r}): batches are delivered to a CUDA "
                         "GPU ('cuda' or 'cuda:N'); leave device unset for pinned host batches")
    _check_gpu(device)
    _graphs.watch()  # the blocks it hands out are fenced on free
    return cuda


def _check_gpu(device: Any) -> None:
    torch = sys.modules["torch"]
    if not (cuda_available() and torch.cuda.is_available()):
        raise RuntimeError(f"fastpin.install(device={device!r}): no usable CUDA GPU here "
                           f"({cuda_status().reason}); leave device unset for pinned host batches")


def _hook_iterators() -> None:
    """Every DataLoader iterator runs _on_iterator once its __init__ has read
    the loader (under _lock; once a process: the hook does nothing for the
    iterators of a stock DataLoader iterated outside a Loader and install())."""
    if "iterator_init" in replaced:
        return
    iterators = _iterators()
    original = replaced["iterator_init"] = iterators.__init__

    def __init__(self, loader, *args, **kwargs):
        original(self, loader, *args, **kwargs)
        _on_iterator(self, loader)

    __init__.__wrapped__ = original
    iterators.__init__ = __init__


_making = threading.local()  # .loader: in a Loader's iter() of its source (loader_source)


@contextlib.contextmanager
def loader_source():
    """Around a fastpin.Loader's iter() of its source: a DataLoader iterator
    made meanwhile in this thread sends its indices through IndexQueues."""
    with _lock:
        _hook_iterators()
    _making.loader = getattr(_making, "loader", 0) + 1
    try:
        yield
    finally:
        _making.loader -= 1


def _on_iterator(it, loader) -> None:
    """DataLoader iterator `it`, just made from `loader` and before it starts its
    workers and its pin thread: what a Loader or install() asks of it."""
    if getattr(it, "_num_workers", 0) <= 0:
        return
    if getattr(_making, "loader", 0):
        _own_queues(it)
        return  # the Loader does the rest
    if not (installed() and getattr(loader, "pin_memory", False)):
        return
    _own_queues(it, close_pipes=True)
    from . import _zerocopy

    if isinstance(it._collate_fn, _zerocopy._WorkerCollate):
        return  # a fastpin.Loader's own view of the DataLoader, made in another thread
    zero_copy, device = _mode["zero_copy"], _mode["device"]
    if device is not None:
        _deliver(it, loader, zero_copy, device)
    elif zero_copy:
        _zero_copy(it, loader, _zerocopy.PIN_THREAD if getattr(it, "_pin_memory", False)
                   else _zerocopy.VIEWS)


def _zero_copy(it, loader, handover: int, index: Optional[int] = None):
    """Give `it` the collate_fn that places batches in the shared arena (the
    pool of `loader`, for GPU `index`: None, the current one); (that pool,
    the delivery stats of its iterators)."""
    from . import _zerocopy

    pool, stats = _pool_for(loader, index)
    it._collate_fn = _zerocopy.wrap_collate(it._collate_fn, pool, (pool.directory[0], handover))
    # The iterator holds the pool (its workers write into it) to its end; then,
    # its workers shut down, what they held and nobody adopted goes back.
    weakref.finalize(it, pool.reclaim).atexit = False
    return pool, stats


def _deliver(it, loader, zero_copy: bool, device) -> None:
    """`it` hands its batches over on `device` through the delivery engine."""
    from . import _zerocopy

    index = device.index if device.index is not None else _current_device()
    pool, stats = (_zero_copy(it, loader, _zerocopy.DELIVER, index) if zero_copy
                   else (None, _delivery.Stats()))
    # A StatefulDataLoader's state counts the batches its iterator handed
    # over: none is taken from it ahead of the consumer.
    depth = 0 if callable(getattr(it, "state_dict", None)) else _DEPTH
    target = _delivery.Target(
        _torch.require("fastpin.install").device("cuda", index), index, depth, stats,
        pool=pool, loader=shape_of(loader), pin_objects=True, who="fastpin.install(device=...)")
    _ahead.deliver_from(it, _delivery.choose(target, zero_copy)(), depth)


def _current_device() -> int:
    return sys.modules["torch"].cuda.current_device()


def _pool_for(loader, index: Optional[int] = None) -> tuple:
    """(the self-sizing pool of `loader`'s iterators, made on first use for GPU
    `index` (None: the current one), kept while `loader` lives (a weak key: the
    pool holds only what sizing needs, never the DataLoader); the delivery
    stats of its iterators)."""
    from . import _zerocopy

    index = device_index(None) if index is None else index
    try:
        cached = process.installed_pools.get(loader)
    except TypeError:  # unhashable: a pool for this iterator alone
        cached = None
    if cached is not None and cached[0] == index:
        cached[1].reclaim()  # blocks a previous epoch's killed workers held
        return cached[1], cached[2]
    make = _zerocopy.shared_maker(index, _numa.for_device(index if index >= 0 else None).node)
    pool = _zerocopy.Pool(make, loader=shape_of(loader), depth=_DEPTH,
                          cap=_zerocopy.default_cap(index >= 0))
    pool.warn_fallbacks = True  # no Loader here to say so: the pool does (tell_fallbacks)
    stats = _delivery.Stats()
    try:
        process.installed_pools[loader] = (index, pool, stats)
    except TypeError:
        pass
    return pool, stats


def _own_queues(it, close_pipes: bool = False) -> None:
    """From its first batch's indices on, DataLoader iterator `it` (being made:
    its queues and workers come next, made by torch) sends them through
    IndexQueues, and its result queue is a ResultQueue here. With
    `close_pipes` (install(); a Loader sees to its own: _producer), the pipes
    of its persistent workers are closed once it is gone."""
    ref = weakref.ref(it)

    def first(*args, **kwargs):
        it = ref()
        del it._try_put_index  # the class's from now on
        if close_pipes:
            _queues.pipes_closed_at_end(it)
        for q in getattr(it, "_index_queues", ()):
            if type(q) is mp_queues.Queue and q._thread is None and q._wlock is not None:
                q.__class__ = _queues.IndexQueue
        q = getattr(it, "_worker_result_queue", None)
        if type(q) is mp_queues.Queue and q._thread is None:
            q.__class__ = _queues.ResultQueue
        return it._try_put_index(*args, **kwargs)

    it._try_put_index = first
