"""fastpin.Loader: batches arrive on the GPU, copied on a side stream while the
previous step computes.

Each epoch has a producer (_producer._Producer: a background thread and a
queue, `depth` batches ahead) that takes batches from the wrapped iterable and
hands each to the Loader's mode (_delivery: pass through, pin on the host, copy
to the device, adopt what zero-copy workers placed), chosen once when the
Loader is made; the consumer's iterator (_Epoch) hands the prepared batches
over. Leaving an epoch never waits on the source (_producer). On a device, the
mode copies every leaf on the Loader's copy stream and records one event;
`next()` makes the consumer's current stream wait on it (no host
synchronisation) and record_stream's the batch's tensors onto that stream.

One Loader per rank: a Loader binds to one GPU (its device, or the current one)
and touches no other. Its copy stream lives there, and its arena (its own, or
that GPU's default arena) is registered in that GPU's primary context, its
pages on the GPU's NUMA node; the copy threads run on that node's CPUs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Iterable, Optional, Union

from . import _C, _ahead, _delivery, _graphs, _install, _numa, _torch
from ._arena import cuda_available, default_arena, device_index, made_default_arena
from ._grow import GrowingArena
from ._producer import _POLL, _STOP, _end_here, _Failure, _Producer, _worker_backed
from ._runtime import check_capacity, check_int, process, settings
from ._segments import shape_of

log = logging.getLogger("fastpin")

class Loader:
    """Wrap any iterable of batches (a DataLoader first of all) so that batches
    arrive with their tensor leaves already on `device`, in the same structure.

    device: "cuda", "cuda:N", an int or torch.device: batches are copied there on a
        side stream, `depth` batches ahead; "cuda" is the current device (under
        torchrun, call torch.cuda.set_device(local_rank) first, or name the device).
        None: batches come back pinned on the host for the current GPU (for code
        that does its own .to(..., non_blocking=True)). "cpu": batches pass through
        unchanged, prefetched in the background: the source's own objects are
        handed over, up to depth + 1 batches after the source made them. A source
        that refills one buffer for every batch (common in custom loaders) has
        overwritten them by then: give such a source depth=0.
        On a GPU, the copying path (zero_copy=False, or a DataLoader zero-copy does
        not apply to) over a DataLoader with workers iterates a shallow copy of it
        with pin_memory=True (settings as when wrapped): its pin thread receives
        and pins each batch into fastpin's arena, as stock splits the work.
        A DataLoader with persistent_workers=True: the Loader iterates a shallow copy
        of it with persistent workers of its own (as zero_copy does, below), so that
        two Loaders over it, or a Loader beside a plain `for b in dl`, each get every
        batch; take a StatefulDataLoader's state through the Loader's state_dict().
    depth: how many batches are prepared ahead of the consumer (default 2). 0: no
        prefetch and no thread; each batch is taken from the source, and copied or
        pinned, in the consumer's own thread when next() asks for it, as the plain
        loop would (safe with sources that reuse their buffers).
    zero_copy: the DataLoader's workers collate straight into a shared, page-locked
        arena, so the main process copies nothing. Default (None): on for a
        DataLoader with workers and no `arena` given (FASTPIN_ZERO_COPY=0 turns the
        default off); other sources (lists, generators, num_workers=0) take the
        copying path; False opts out. With no `capacity` (or `arena`) given, the
        arena sizes itself: it takes no memory until the first batch, then grows
        (by adding registered segments, made in this process, that the workers
        open) to what the workers have in flight for the batches they
        make, capacity_for(): (num_workers x prefetch_factor + depth + 6) blocks
        of the largest batch, never past `max_capacity` (default
        fastpin._zerocopy.default_cap(): FASTPIN_ZERO_COPY_MAX_BYTES, else a
        quarter of the memory and, where it applies, half of RLIMIT_MEMLOCK).
        `capacity`: one arena of exactly that many bytes, made up front. Either
        way a worker that finds no room falls back to the ordinary path (the
        batch is pinned by copy here, and counted): slower, never stuck.
        The DataLoader itself is left as it was: the Loader iterates a shallow
        copy of it (same dataset, sampler, generator and settings as when
        wrapped) whose workers run fastpin's collate_fn, with workers of its own,
        so plain iteration of the DataLoader and other Loaders over it are
        unaffected; take a StatefulDataLoader's state through the Loader's
        state_dict(). With persistent_workers=True the Loader's workers persist
        across its epochs and end with the Loader; a new Loader over the same
        DataLoader starts workers of its own. The shared arena (no `arena`
        given) is kept with the DataLoader, as install() keeps its own: a new
        Loader every epoch takes the one the last made (no page-locking and
        registering again), one made while another Loader reads it, or holds
        it unread (two made for zip), makes its own; it goes when the
        DataLoader does.

    Leaving an epoch (break, an exception, Ctrl-C, a new iter(), interpreter exit)
    never waits on the source: a DataLoader's workers are shut down when the epoch
    is dropped, as the DataLoader's own iterator does it (bounded joins, then
    kill), and a thread still inside a slow source finishes its batch there and
    drops it. Any number of threads may draw from one epoch; each sees its end.
    """

    def __init__(self, loader: Iterable, device: Any = "cuda", depth: int = 2, *,
                 arena: Optional[_C.Arena] = None, zero_copy: Optional[bool] = None,
                 capacity: Optional[int] = None, max_capacity: Optional[int] = None):
        torch = _torch.require("fastpin.Loader")

        depth = check_int("fastpin.Loader: depth", depth, 0, None, "0 (no prefetch) or more batches")
        if zero_copy is None:
            zero_copy = arena is None and _zero_copy_applies(loader)
        elif not isinstance(zero_copy, bool):
            raise TypeError(f"fastpin.Loader: zero_copy must be True or False, not {zero_copy!r}")
        if arena is not None and not isinstance(arena, (_C.Arena, GrowingArena)):
            raise TypeError("fastpin.Loader: arena must be a fastpin._C.Arena or None, not "
                            f"{type(arena).__name__}")
        if capacity is not None:
            if not zero_copy:
                raise ValueError(
                    "fastpin.Loader: capacity sizes the shared arena of zero_copy=True and means "
                    "nothing without it; size the arena batches are pinned in with "
                    "fastpin.configure(capacity=...) or pass arena=fastpin._C.Arena(nbytes)")
            capacity = check_capacity(capacity, "fastpin.Loader: capacity")
        if device is not None and not isinstance(device, (str, int, torch.device)) \
                or isinstance(device, bool):
            raise TypeError("fastpin.Loader: device must be None, 'cpu', 'cuda', 'cuda:N', an int "
                            f"or a torch.device, not {device!r}")
        self.loader = loader
        self.depth = depth
        self._arena = arena
        self._stats = _delivery.Stats()
        self.zero_copy = False
        if device is None:
            self.device = None
        else:
            self.device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
            if self.device.type == "cuda":
                if not (cuda_available() and torch.cuda.is_available()):
                    raise RuntimeError(
                        f"fastpin.Loader(device={device!r}): no usable CUDA GPU here "
                        f"({_C.cuda_status()['reason']}); use device='cpu' or device=None")
                if self.device.index is None:
                    self.device = torch.device("cuda", torch.cuda.current_device())
            elif self.device.type != "cpu":
                raise ValueError(f"fastpin.Loader supports cuda and cpu devices, not {device!r}")
        # The GPU this Loader serves (-1: none), and where its memory and copy
        # threads go: its arena is that GPU's, and no other GPU is touched.
        self._index = (self.device.index if self.device is not None and self.device.type == "cuda"
                       else device_index(None) if self.device is None else -1)
        if arena is not None and self._index >= 0 and arena.registered:
            self._check_arena(arena)
        self._pin_thread = self._pins_in_thread()
        self._source: Any = _own_workers(loader, self._pin_thread)  # what an epoch iterates
        self._placement = _numa.for_device(self._index if self._index >= 0 else None)
        _numa.pin_threads(self._placement)
        _graphs.watch()  # the blocks this Loader hands out are fenced on free
        self._pid = os.getpid()  # the process whose epochs, arena and pool these are
        self._active: Optional[weakref.ref] = None
        self._producer: Optional[weakref.ref] = None
        self._pool: Any = None  # zero-copy: the shared arena's segments (_zerocopy.Pool)
        if zero_copy:
            self._setup_zero_copy(arena, capacity, max_capacity)
        # What is done to each batch (_delivery): a step made for each epoch.
        self._target = _delivery.Target(
            self.device, self._index, depth, self._stats,
            arena=None if self.zero_copy else self._arena, pool=self._pool, loader=self.loader)
        self._mode = _delivery.choose(self._target, self.zero_copy)

    def _pins_in_thread(self) -> bool:
        """Whether a copying epoch over a DataLoader with workers has the
        DataLoader's pin thread receive and pin each batch (through this
        Loader's step: _delivery's pin_received), as the stock DataLoader
        splits its work, the consumer's next() then only copying pinned
        memory to the device: wherever batches are pinned, on a GPU."""
        return ((self.device is None or self.device.type == "cuda")
                and cuda_available() and _torch.require("fastpin.Loader").cuda.is_available())

    def _check_arena(self, arena: _C.Arena) -> None:
        """An arena registered in another GPU's context would record its frees there:
        its blocks could be reused while this GPU still copies from them."""
        owner = arena.device
        if owner != self._index:
            raise ValueError(f"fastpin.Loader(device=cuda:{self._index}): the arena given is "
                             f"registered with cuda:{owner}; make it with "
                             f"_C.Arena(..., device={self._index})")

    def _setup_zero_copy(self, arena: Optional[_C.Arena], capacity: Optional[int],
                         max_capacity: Optional[int]) -> None:
        """Make the shared arena's pool (its segments registered with CUDA here,
        never in a worker) and the view of the DataLoader whose workers write
        into it."""
        from torch.utils.data import DataLoader

        from . import _zerocopy

        if not isinstance(self.loader, DataLoader):
            raise TypeError("fastpin.Loader(zero_copy=True) needs a torch.utils.data.DataLoader, "
                            f"not {type(self.loader).__name__}")
        if arena is not None and arena.fd < 0:
            raise ValueError("fastpin.Loader(zero_copy=True) needs a shared arena "
                             "(_C.Arena(..., shared=True))")
        if max_capacity is not None and max_capacity <= 0:
            raise ValueError(f"max_capacity must be positive, not {max_capacity}")
        index, node = self._index, self._placement.node
        cap = max_capacity or _zerocopy.default_cap(index >= 0)

        def make():
            return _zerocopy.Pool(_zerocopy.shared_maker(index, node),
                                  loader=shape_of(self.loader), depth=self.depth, arena=arena,
                                  capacity=capacity, cap=cap)

        self._pool = (make() if arena is not None
                      else _shared_pool(self, (index, node, self.depth, capacity, cap), make))
        # Its workers' fallbacks before this Loader (a pool taken over): not its own.
        self._fallbacks_before = (self._pool.stats() or {}).get("fallbacks", 0)
        self._arena = self._pool.newest()  # None while a self-sizing pool is empty
        self._source = _zerocopy.dataloader_view(
            self.loader, _zerocopy.wrap_collate(self.loader.collate_fn, self._pool))
        self.zero_copy = True

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self):
        if self._pid != os.getpid():
            self._in_forked_child()
        # One epoch at a time: a new iteration ends the previous one.
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()
        # The previous epoch's thread, if it still runs (it may be inside the
        # source after a break): the new one does not read the source beside it.
        producer = self._producer() if self._producer is not None else None
        epoch = _Epoch(self, producer)
        self._active = weakref.ref(epoch)
        self._producer = weakref.ref(epoch.producer)
        return epoch

    def _in_forked_child(self) -> None:
        """First iter() in a process forked from the one that made this Loader
        (os.fork, a 'fork' multiprocessing.Process): the parent's epoch threads
        do not exist here (nor may its locks be taken: one may have been held
        at fork), and zero-copy's shared arena is the parent's, registered in
        the parent's CUDA context, its blocks adopted there only. So this
        process's epochs start afresh and take the copy path, with workers of
        their own (the DataLoader's own collate_fn); the parent's Loader is
        untouched."""
        self._pid = os.getpid()
        self._active = self._producer = None
        self._stats = _delivery.Stats()
        if self.zero_copy:
            log.info("fastpin.Loader: iterated in a process forked from the one that made it; "
                     "zero-copy's shared arena is that process's, so this one's batches take "
                     "the copy path (make a Loader here for zero-copy in this process)")
            self._pool = self._arena = None
            self._source = _own_workers(self.loader, self._pin_thread)
            self.zero_copy = False
        self._target = _delivery.Target(
            self.device, self._index, self.depth, self._stats,
            arena=None if self.zero_copy else self._arena, pool=self._pool, loader=self.loader)
        self._mode = _delivery.choose(self._target, self.zero_copy)

    def state_dict(self) -> dict:
        """The wrapped loader's state (torchdata's StatefulDataLoader, say). Batches
        already prepared ahead count as consumed by the wrapped loader, up to depth + 1
        of them: take the state between epochs to resume exactly."""
        if not hasattr(self.loader, "state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no state_dict()")
        return self._source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not hasattr(self.loader, "load_state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no load_state_dict()")
        self._source.load_state_dict(state)

    def __getattr__(self, name):
        # dataset, batch_size, sampler, ... of the wrapped DataLoader, as
        # training frameworks expect of a loader.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def arena(self) -> Union[_C.Arena, GrowingArena, None]:
        """The arena batches are staged or pinned in: the Loader's own, else the
        default arena of its GPU (a GrowingArena unless a capacity is configured).
        Zero-copy: the shared arena's newest segment (None while a self-sizing one
        has seen no batch)."""
        if self._pool is not None:
            return self._pool.newest()  # None until a self-sizing pool's first batch
        if self._arena is not None:
            return self._arena
        return default_arena(self._index if self._index >= 0 else None)

    def stats(self) -> dict:
        """batches, bytes, host_to_pinned_gbps (producer side), consumer_wait_s (time
        next() waited for a batch), fallbacks, pool_high_water, pool_capacity (0
        while no arena is made: reading stats makes and page-locks nothing)."""
        if self._pool is not None:
            s = self._pool.stats()
            if s is not None and self._fallbacks_before:
                s["fallbacks"] -= self._fallbacks_before
            return self._stats.as_dict(s)
        arena = self._arena
        if arena is None and not (self.device is not None and self.device.type == "cpu"):
            arena = made_default_arena(self._index if self._index >= 0 else None)
        return self._stats.as_dict(arena.stats() if arena is not None else None)


def _zero_copy_applies(loader) -> bool:
    """zero_copy's default: a DataLoader with worker processes (unless
    FASTPIN_ZERO_COPY=0); other sources, and a DataLoader without workers, take
    the copying path. An object that only passes for a DataLoader (Accelerate's
    DataLoaderShard wraps one: isinstance says yes, its type does not) iterates
    another DataLoader than the view zero-copy would make of it."""
    from torch.utils.data import DataLoader

    return (issubclass(type(loader), DataLoader) and loader.num_workers > 0
            and settings.zero_copy)


def _shared_pool(owner: Loader, key: tuple, make) -> Any:
    """The zero-copy pool of `owner`: the one an earlier Loader over the same
    DataLoader made with the same settings (`key`), so that a new Loader every
    epoch (`for b in fastpin.Loader(dl)`) does not page-lock and register its
    arena again each epoch; kept while the DataLoader lives (a weak key: the
    pool holds only its shape), as install() keeps its own. A Loader made while
    another one reads that pool, or holds it and has not been read yet (two
    made for zip(a, b)), makes its own: a pool is sized for one Loader's
    batches in flight."""
    with process.lock:
        try:
            table = process.loader_pools.setdefault(owner.loader, {})
        except TypeError:  # unhashable, or no weak reference to it: kept nowhere
            table = {}
        entry = table.get(key)
        if entry is None or not any(_reading(user) or user._active is None
                                    for user in entry[1]):
            if entry is None:
                users: "weakref.WeakSet[Loader]" = weakref.WeakSet()
                table[key] = entry = (make(), users)
            else:
                entry[0].reclaim()  # blocks a previous epoch's killed workers held
            entry[1].add(owner)
            return entry[0]
    return make()  # beside one that reads it or holds it unread: its own, made outside the lock


def _reading(loader: Loader) -> bool:
    """Whether an epoch of `loader` is under way (made, not ended or closed);
    `loader._active` is None until its first epoch."""
    epoch = loader._active() if loader._active is not None else None
    return epoch is not None and not epoch.closed


def _own_workers(loader, pin_thread: bool = False):
    """What a Loader's epochs iterate: `loader`, or a shallow copy of it
    (_zerocopy.dataloader_view) for a DataLoader with persistent workers, so
    that the Loader's persistent workers are its own (the DataLoader keeps one
    persistent iterator, and two Loaders, or a Loader and a plain `for b in
    dl`, reading it at once would each take the other's batches), and with
    `pin_thread` (Loader._pins_in_thread) for a DataLoader with workers, the
    copy with pin_memory=True: its pin thread receives each batch and pins it
    through the Loader's step. Zero-copy makes its own view
    (Loader._setup_zero_copy)."""
    from torch.utils.data import DataLoader

    pin_thread = (pin_thread and issubclass(type(loader), DataLoader)
                  and loader.num_workers > 0)
    if not (pin_thread or isinstance(loader, DataLoader) and loader.persistent_workers):
        return loader
    from ._zerocopy import dataloader_view

    view = dataloader_view(loader, loader.collate_fn)
    if pin_thread:
        view.__dict__["pin_memory"] = True
    return view

class _Epoch:
    """The consumer's iterator over one epoch. Any number of threads may draw
    from it; each sees the end. Where the source has worker processes (a
    DataLoader with workers: they run ahead already), and with depth=0, each
    batch is taken from the source and prepared in the consumer's own next(),
    `depth` batches ahead (_ahead.Ahead); else the producer's thread does
    it, a queue ahead. Closing it never waits on the source: see
    _Producer.shutdown and _end_here, run when the epoch is dropped (as a
    DataLoader iterator shuts its workers down in __del__)."""

    def __init__(self, owner: Loader, previous: Optional[_Producer] = None):
        # A copying epoch over a view with pin_memory=True (_own_workers): its
        # pin thread pins each batch through this epoch's step.
        pins = owner._pin_thread and not owner.zero_copy
        with _install.expecting_pin_thread() if pins else contextlib.nullcontext():
            self.producer = _Producer(owner, previous, start=False)
            if pins:
                _install.serve_pin_thread(self.producer.source, self.producer.mode.pin_received)
        self.deliver = self.producer.mode.deliver
        self.stats = owner._stats
        self.closed = False
        self.ahead: Optional[_ahead.Ahead] = None
        if owner.depth == 0 or _worker_backed(self.producer.source):
            self.ahead = _ahead.Ahead(self.producer.mode, owner.depth, owner._stats)
            self.ready = _ahead.ready_of(self.producer.source)
            self.lock = threading.Lock()  # one thread at a time in the source
            self._finalizer = weakref.finalize(self, _end_here, self.producer)
        else:
            self.producer.start()
            self._finalizer = weakref.finalize(self, self.producer.shutdown)
        # At interpreter exit, nothing is joined or shut down (the exit hook
        # stops the thread; multiprocessing terminates the workers), as with
        # the DataLoader, whose __del__ does nothing once Python is exiting.
        self._finalizer.atexit = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        if self.ahead is not None:
            return self._next_here()
        return self.deliver(self._next_queued())

    def _next_here(self):
        """The batch, taken and prepared here, `depth` ahead (_ahead.Ahead)."""
        with self.lock:
            if self.closed:
                raise StopIteration
            try:
                return self.ahead.next(self.producer.source.__next__, self.ready)
            except BaseException:
                self.close()  # its end, its error or Ctrl-C: the epoch is over
                raise

    def _next_queued(self):
        producer = self.producer
        t0 = time.perf_counter()
        try:
            while True:
                # Timed: Ctrl-C raises here at once, and a thread that drew the
                # end (or the producer's error) ends every other thread's wait.
                if self.closed:
                    raise StopIteration
                try:
                    item = producer.queue.get(timeout=_POLL)
                    break
                except queue.Empty:
                    if producer.queue.empty() and (producer.parked.is_set()
                                                   or not producer.thread.is_alive()):
                        self.close()  # stopped without a word (interpreter exit)
                        raise StopIteration from None
        except StopIteration:
            raise
        except BaseException:
            self.close()  # Ctrl-C while waiting: stop, but wait for nothing
            raise
        with self.stats.lock:
            self.stats.wait_seconds += time.perf_counter() - t0
        if item is _STOP:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            exc, item.exc = item.exc, None
            try:
                raise exc
            finally:
                # No cycle through this frame: the error's traceback holds the
                # source's frames (a DataLoader iterator), freed with the error.
                del exc, item
        return item

    def close(self) -> None:
        """Stop the epoch and drop prepared batches; waits for nothing. The
        source's workers are shut down when the epoch is dropped."""
        if not self.closed:
            self.closed = True
            if self.ahead is not None:
                self.ahead.clear()
            self.producer.halt()
