"""fastpin.Loader: batches arrive on the GPU, copied on a side stream while the
previous step computes.

A background thread takes batches from the wrapped iterable and, for each,
copies every tensor leaf to the device on the Loader's copy stream (pageable
leaves staged through arena blocks in chunks, pinned leaves directly: see
_C.h2d) and records one event. `next()` makes the consumer's current stream
wait on that event (no host synchronisation) and hands the batch over with its
tensors record_stream'ed onto the consumer stream, so torch's caching
allocator does not reuse their memory while the consumer's work reads it.

One Loader per rank: a Loader binds to one GPU (its device, or the current one)
and touches no other. Its copy stream lives there, and its arena (its own, or
that GPU's default arena) is registered in that GPU's primary context, its
pages on the GPU's NUMA node; the copy threads run on that node's CPUs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Optional

import numpy as np

from . import _C, _graphs, _leaves, _numa
from ._arena import cuda_available, default_arena, device_index
from ._pin import pin_memory
from ._walk import map_leaves
from ._walk import nbytes as batch_nbytes

log = logging.getLogger("fastpin")

_STOP = object()  # end of the epoch
_POLL = 0.1       # seconds between checks of the stop flag while blocked


class _Failure:
    """An exception raised while producing a batch, re-raised by next()."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0
        self.copy_seconds = 0.0   # producer time spent in pinning / staging
        self.wait_seconds = 0.0   # consumer time spent waiting for a batch
        self.fallbacks = 0

    def as_dict(self, arena) -> dict:
        s = arena.stats()
        with self.lock:
            d = {
                "batches": self.batches,
                "bytes": self.bytes,
                "host_to_pinned_gbps": self.bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0,
                "consumer_wait_s": self.wait_seconds,
                # Batches the main process pinned by copy: workers that found
                # the shared arena full (zero-copy mode).
                "fallbacks": self.fallbacks,
                "worker_fallbacks": s.get("fallbacks", 0),
            }
        d["pool_high_water"] = s["high_water"]
        d["pool_capacity"] = s["capacity"]
        d["numa_node"] = s["numa_node"]
        return d


class Loader:
    """Wrap any iterable of batches (a DataLoader first of all) so that batches
    arrive with their tensor leaves already on `device`, in the same structure.

    device: "cuda", "cuda:N", an int or torch.device: batches are copied there on a
        side stream, `depth` batches ahead; "cuda" is the current device (under
        torchrun, call torch.cuda.set_device(local_rank) first, or name the device).
        None: batches come back pinned on the host for the current GPU (for code
        that does its own .to(..., non_blocking=True)). "cpu": batches pass through
        unchanged, prefetched in the background.
    depth: how many batches are prepared ahead of the consumer (>= 1).
    zero_copy: the DataLoader's workers collate straight into a shared, page-locked
        arena of `capacity` bytes (default: fastpin.configure's), so the main process
        copies nothing. Sets the DataLoader's collate_fn; needs a DataLoader whose
        workers have not started yet.
    """

    def __init__(self, loader: Iterable, device: Any = "cuda", depth: int = 2, *,
                 arena: Optional[_C.Arena] = None, zero_copy: bool = False,
                 capacity: Optional[int] = None):
        import torch

        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self.loader = loader
        self.depth = depth
        self._arena = arena
        self._stats = _Stats()
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
        self._placement = _numa.for_device(self._index if self._index >= 0 else None)
        _numa.pin_threads(self._placement)
        _graphs.watch()  # the blocks this Loader hands out are fenced on free
        self._active: Optional[weakref.ref] = None
        if zero_copy:
            self._setup_zero_copy(arena, capacity)

    def _check_arena(self, arena: _C.Arena) -> None:
        """An arena registered in another GPU's context would record its frees there:
        its blocks could be reused while this GPU still copies from them."""
        owner = arena.device
        if owner != self._index:
            raise ValueError(f"fastpin.Loader(device=cuda:{self._index}): the arena given is "
                             f"registered with cuda:{owner}; make it with "
                             f"_C.Arena(..., device={self._index})")

    def _setup_zero_copy(self, arena: Optional[_C.Arena], capacity: Optional[int]) -> None:
        """Make the shared arena (registered with CUDA here, before any worker
        starts) and hand the DataLoader's workers a collate_fn that writes into it."""
        from torch.utils.data import DataLoader

        from . import _zerocopy
        from ._arena import get_capacity

        if not isinstance(self.loader, DataLoader):
            raise TypeError("fastpin.Loader(zero_copy=True) needs a torch.utils.data.DataLoader, "
                            f"not {type(self.loader).__name__}")
        if getattr(self.loader, "_iterator", None) is not None:
            warnings.warn("fastpin.Loader(zero_copy=True): the DataLoader's persistent workers "
                          "already run with their own collate_fn; batches will be pinned by copy",
                          RuntimeWarning, stacklevel=3)
            return
        if arena is None:
            arena = _C.Arena(capacity or get_capacity(), shared=True, device=max(self._index, 0),
                             cuda=self._index >= 0, numa_node=self._placement.node)
        elif arena.fd < 0:
            raise ValueError("fastpin.Loader(zero_copy=True) needs a shared arena "
                             "(_C.Arena(..., shared=True))")
        _zerocopy.register(arena)
        self._arena = arena
        self.loader.collate_fn = _zerocopy.wrap_collate(self.loader.collate_fn, arena)
        self.zero_copy = True

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self):
        # One epoch at a time: a new iteration ends the previous one.
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous.close()
        epoch = _Epoch(self)
        self._active = weakref.ref(epoch)
        return epoch

    def state_dict(self) -> dict:
        """The wrapped loader's state (torchdata's StatefulDataLoader, say). Batches
        already prepared ahead count as consumed by the wrapped loader, up to depth + 1
        of them: take the state between epochs to resume exactly."""
        if not hasattr(self.loader, "state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no state_dict()")
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not hasattr(self.loader, "load_state_dict"):
            raise AttributeError(f"{type(self.loader).__name__} has no load_state_dict()")
        self.loader.load_state_dict(state)

    def __getattr__(self, name):
        # dataset, batch_size, sampler, ... of the wrapped DataLoader, as
        # training frameworks expect of a loader.
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def arena(self) -> _C.Arena:
        """The arena batches are staged or pinned in: the Loader's own, else the
        default arena of its GPU."""
        if self._arena is not None:
            return self._arena
        return default_arena(self._index if self._index >= 0 else None)

    def stats(self) -> dict:
        """batches, bytes, host_to_pinned_gbps (producer side), consumer_wait_s (time
        next() waited for a batch), fallbacks, pool_high_water, pool_capacity."""
        return self._stats.as_dict(self.arena)


class _Producer:
    """The background half of one epoch: takes batches from the source,
    prepares them and queues them, `depth` ahead of the consumer. It holds no
    reference to the consumer's iterator, so dropping that (a break) stops it."""

    def __init__(self, owner: Loader):
        import torch

        self.torch = torch
        self.device = owner.device
        self.stats = owner._stats
        # A "cpu" Loader passes batches through: it needs no arena (and must not
        # register one with a GPU).
        cpu = self.device is not None and self.device.type == "cpu"
        self.arena = owner._arena if cpu else owner.arena
        # Batches pinned or staged by copy here: in zero-copy mode, those a worker
        # could not place in the shared arena go through the GPU's default arena,
        # so they take no room the workers need (which would make more fall back).
        self.index = owner._index
        self.copy_arena = None if owner.zero_copy else self.arena
        self.zero_copy = owner.zero_copy
        self.loader = owner.loader  # the DataLoader (not its iterator): for sizing advice
        self.depth = owner.depth
        self.placement = owner._placement
        self.queue: queue.Queue = queue.Queue(maxsize=owner.depth)
        self.stop = threading.Event()
        cuda = self.device is not None and self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # The stream that will read pinned host batches (device=None), taken in
        # the consumer's thread: their blocks are reused only after it is done.
        self.consumer_stream = (torch.cuda.current_stream()
                                if self.device is None and cuda_available()
                                and torch.cuda.is_available() else None)
        # Sources that copies in flight may still read, with the batch's event.
        self.in_flight: list = []
        self.source = iter(owner.loader)
        self.thread = threading.Thread(target=self.run, name="fastpin-loader", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            if self.copy_stream is not None:
                # Before any other CUDA call of this thread: a new thread's
                # current device is 0, which this Loader must not touch. The
                # copy stream is this thread's current stream from here on, so
                # device memory made here is allocated under it (the consumer's
                # stream is added by record_stream when a batch is handed over).
                self.torch.cuda.set_device(self.device)
                self.torch.cuda.set_stream(self.copy_stream)
            # This thread copies its share of every batch (the pool helps).
            _numa.pin_this_thread(self.placement)
            while not self.stop.is_set():
                try:
                    batch = next(self.source)
                except StopIteration:
                    self.put(_STOP)
                    return
                t0 = time.perf_counter()
                item = self.prepare(batch)
                batch = None  # a zero-copy batch's block is free to go once copied
                dt = time.perf_counter() - t0
                with self.stats.lock:
                    self.stats.copy_seconds += dt
                self.put(item)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            self.put(_Failure(exc))
        finally:
            self.source = None  # a DataLoader iterator shuts its workers down
            if self.zero_copy:
                # Workers that died before their batches arrived (killed, or
                # shut down with results still queued) leave blocks behind.
                self.arena.reclaim()

    def put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def prepare(self, batch):
        if self.zero_copy:
            from . import _zerocopy

            self.arena.collect()  # only this process can see the GPU finish with blocks
            batch = _zerocopy.adopted(batch)
            if isinstance(batch, _zerocopy._Adopted) and self.copy_stream is not None:
                out = self.block_to_device(batch)
                if out is not None:
                    return out
            # Read only by the copy stream here; in host mode the user gets the
            # block, so its fence keeps covering every stream (the default).
            consumer = getattr(self.copy_stream, "cuda_stream", None)
            batch, adopted = _zerocopy.receive(batch, consumer)
            if not adopted:
                with self.stats.lock:
                    self.stats.fallbacks += 1
                    first = self.stats.fallbacks == 1
                if first:
                    self.warn_full(batch)
            elif self.device is None:
                self.count(batch)
                return batch
        if self.device is None:
            out = pin_memory(batch, arena=self.staging(), stream=self.consumer_stream)
            self.count(out)
            return out
        if self.device.type == "cpu":
            self.count(batch)
            return batch
        return self.to_device(batch)

    def staging(self) -> _C.Arena:
        """The arena batches are pinned or staged in by copy (made on first use)."""
        if self.copy_arena is None:
            self.copy_arena = default_arena(self.index if self.index >= 0 else None)
        return self.copy_arena

    def warn_full(self, batch) -> None:
        """Once per Loader: a worker found the shared arena full; say what fits."""
        from . import _zerocopy

        nbytes = batch_nbytes(batch)
        ahead = _zerocopy.batches_ahead(self.loader)
        need = _zerocopy.capacity_for(self.loader, nbytes, self.depth)
        log.warning(
            "fastpin.Loader(zero_copy=True): a DataLoader worker found the shared arena full "
            "(%.0f MB) and collated a batch of %.1f MB the ordinary way; such batches are "
            "pinned by copy in the main process, which is slower. The arena holds the "
            "workers' batches in flight (num_workers x prefetch_factor = %d), the Loader's "
            "depth and the batches you keep: for this DataLoader give it capacity=%d "
            "(%.0f MB) or more.", self.arena.capacity / 1e6, nbytes / 1e6, ahead, need, need / 1e6)

    def count(self, batch) -> None:
        nbytes = batch_nbytes(batch)
        with self.stats.lock:
            self.stats.batches += 1
            self.stats.bytes += nbytes

    def block_to_device(self, batch):
        """A batch a worker placed in the arena: one copy of its whole block into
        one device buffer, its leaves views of that buffer (no per-leaf work but
        the view). None: a leaf this path cannot take; use the ordinary one."""
        from . import _zerocopy

        block = batch.block
        buffer = self.torch.empty(block.nbytes, dtype=self.torch.uint8, device=self.device)
        tree = _zerocopy.device_views(batch, buffer)
        if tree is None:
            return None
        # The block goes back to the arena once the copy stream is past this
        # copy: its event is recorded there when the Block dies, at return.
        block.consumer_stream = self.copy_stream.cuda_stream
        copies = [(buffer.data_ptr(), block.ptr, block.nbytes, True)] if block.nbytes else []
        return tree, self.issue(copies, []), [buffer]

    def to_device(self, batch):
        torch = self.torch
        copies = []   # (dst address, src address, nbytes, src is pinned)
        keep = []     # (destination, the source it reads)
        made = []     # every device tensor made here, for record_stream later

        def leaf(given):
            x = _leaves.device_source(given)  # the leaf's type decides (one registry)
            if x is None:
                return given
            if x.device == self.device:
                return x  # there already
            if x.device.type != "cpu":
                moved = x.to(self.device, non_blocking=True)
                made.append(moved)
                return moved
            dst = torch.empty(x.shape, dtype=x.dtype, device=self.device)
            made.append(dst)
            nbytes = x.numel() * x.element_size()
            if nbytes:
                copies.append((dst.data_ptr(), x.data_ptr(), nbytes, x.is_pinned()))
                keep.append((dst, x))
            return dst

        out = map_leaves(batch, lambda x: isinstance(x, (torch.Tensor, np.ndarray)), leaf)
        return out, self.issue(copies, keep), made

    def issue(self, copies: list, keep: list):
        """Queue the copies on the copy stream (this thread's current stream) and
        return the event the consumer waits on. `keep`: (destination, source)
        pairs to copy from pageable memory should the arena have no room."""
        torch = self.torch
        try:
            # Pinned sources alone need no staging: no arena to make for them.
            staging = self.arena if all(c[3] for c in copies) else self.staging()
            _C.h2d(staging, self.copy_stream.cuda_stream, copies)
        except _C.ArenaFullError:
            # Live pinned batches fill the arena: copy from pageable memory,
            # slower, never stuck. Copies already queued stay valid.
            for dst, src in keep:
                dst.copy_(src)
            with self.stats.lock:
                self.stats.fallbacks += 1
        # Blocking: a wait on it below sleeps instead of spinning a core.
        event = torch.cuda.Event(blocking=True)
        event.record(self.copy_stream)
        in_flight = self.in_flight
        while in_flight and in_flight[0][0].query():
            in_flight.pop(0)
        in_flight.append((event, keep))
        if len(in_flight) > self.depth + 1:
            # The bus is behind: queue no further ahead of it. Every copy queued
            # keeps its source block (and its batch's device memory) held.
            in_flight.pop(0)[0].synchronize()
        with self.stats.lock:
            self.stats.batches += 1
            self.stats.bytes += sum(c[2] for c in copies)
        return event

    def shutdown(self) -> None:
        """Stop the thread and drop what it prepared; safe from any thread."""
        self.stop.set()
        while self.thread.is_alive() and threading.current_thread() is not self.thread:
            try:
                self.queue.get(timeout=_POLL)  # unblock a put on a full queue
            except queue.Empty:
                pass
            self.thread.join(timeout=_POLL)
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.in_flight.clear()


class _Epoch:
    """The consumer's iterator over one epoch."""

    def __init__(self, owner: Loader):
        self.producer = _Producer(owner)
        self.torch = self.producer.torch
        self.device = owner.device
        self.stats = owner._stats
        self.closed = False
        self._finalizer = weakref.finalize(self, self.producer.shutdown)

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            item = self.producer.queue.get()
        except BaseException:
            self.close()  # Ctrl-C while waiting: leave nothing running
            raise
        with self.stats.lock:
            self.stats.wait_seconds += time.perf_counter() - t0
        if item is _STOP:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        if self.device is None or self.device.type == "cpu":
            return item
        out, event, made = item
        stream = self.torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for t in made:
            t.record_stream(stream)
        return out

    def close(self) -> None:
        """Stop the producer and drop prepared batches (a break mid-epoch)."""
        if not self.closed:
            self.closed = True
            self._finalizer()
