"""Delivery: what happens to a batch between its source and the consumer, for
fastpin.Loader and fastpin.install(device=...) alike.

    Target          where batches go and what a step needs to get them there
    a step          one small strategy per mode, chosen once (choose):
      PassThrough     device="cpu": the source's batches as they are
      PinHost         device=None: pinned in the staging arena, for the user's
                      own .to(..., non_blocking=True)
      CopyToDevice    device="cuda:N": every leaf copied on the copy stream; the
                      consumer's stream waits on the copy's event
      Adopt           zero-copy, around one of the three: a batch a worker placed
                      in the shared arena is taken over (_adoption; to the
                      device: one copy of its whole block into one buffer, the
                      leaves views of it, made in one C call); one that fell
                      back goes the inner step's way

A step's prepare() receives, unpacks, copies and fences one batch; deliver()
hands it over in the consumer's thread (the consumer's current stream waits on
the copy's event, the batch's device memory is record_stream'ed onto it).
Two drivers call them. Where the source has worker processes, they run ahead
already: _ahead.Ahead does the main process's small part in the consumer's
next() (install(device=...) mixes _ahead.Delivering into a DataLoader iterator:
its _next_data() is Ahead's). Where the source itself works in this process
(num_workers=0, generators, lists), the Loader's producer thread (_producer)
runs prepare() instead, a queue ahead.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from . import _C, _adoption, _leaves, _record, _torch
from ._ahead import NoRoomAhead, preparing_ahead
from ._arena import as_core_arena, cuda_available, default_arena, policy
from ._pin import pin_memory
from ._runtime import cgroup_memory_limit, first, memory_room
from ._segments import advice_for, batches_ahead, capacity_for
from ._walk import map_leaves
from ._walk import nbytes as batch_nbytes

log = logging.getLogger("fastpin")


class Stats:
    """A Loader's counters, across its epochs; written by its producers and
    consumers, under the lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0
        self.pinned_bytes = 0     # of them, those pinned or staged by copy here
        self.copy_seconds = 0.0   # producer time spent in pinning / staging
        self.wait_seconds = 0.0   # consumer time spent waiting for a batch
        self.fallbacks = 0

    def count(self, nbytes: int, pinned: int = 0) -> None:
        """A batch of `nbytes`, `pinned` of them copied into pinned memory here."""
        with self.lock:
            self.batches += 1
            self.bytes += nbytes
            self.pinned_bytes += pinned

    def fallback(self) -> bool:
        """Count a batch that went the ordinary way; True for the first one."""
        with self.lock:
            self.fallbacks += 1
            return self.fallbacks == 1

    def as_dict(self, s: Any) -> dict:
        # s: the arena's stats. None: no arena made yet (nothing pinned, or a
        # "cpu" Loader), and reading stats makes none.
        if s is None:
            s = {"high_water": 0, "capacity": 0, "numa_node": -1}
        with self.lock:
            d = {
                "batches": self.batches,
                "bytes": self.bytes,
                # None: nothing was pinned by copy (a "cpu" Loader, batches that
                # all came in the shared arena, or none yet).
                "host_to_pinned_gbps": (self.pinned_bytes / self.copy_seconds / 1e9
                                        if self.pinned_bytes and self.copy_seconds else None),
                "consumer_wait_s": self.wait_seconds,
                # Batches that found their arena full and went the ordinary
                # way, in every mode: host mode pinned by torch, device mode
                # copied from pageable memory, zero-copy a worker that found
                # the shared arena full (in device mode such a batch that
                # then finds the staging arena full too counts twice).
                "fallbacks": self.fallbacks,
                "worker_fallbacks": s.get("fallbacks", 0),
            }
        d["pool_high_water"] = s["high_water"]
        d["pool_capacity"] = s["capacity"]
        d["numa_node"] = s["numa_node"]
        return d


@dataclasses.dataclass
class Target:
    """Where one Loader's or one installed DataLoader iterator's batches go, and
    what its steps need to get them there."""

    device: Any                  # a torch.device (cuda or cpu), or None: pinned on the host
    index: int                   # the GPU served (-1: none); its arenas, its copy stream
    depth: int                   # batches prepared ahead of the consumer
    stats: "Stats"
    arena: Any = None            # the arena to pin or stage in (None: the GPU's default one)
    pool: Any = None             # zero-copy: the shared arena's segments (_segments.Pool)
    loader: Any = None           # the DataLoader (its num_workers, prefetch_factor): advice
    # install(): objects with their own pin_memory() are asked to pin themselves,
    # as DataLoader's pin thread asks them, where the batch goes to a device.
    pin_objects: bool = False
    who: str = "fastpin.Loader"  # what the warnings name


def choose(target: Target, zero_copy: bool) -> Callable[[], "PassThrough"]:
    """The step for `target` (made anew for each epoch: it holds the epoch's
    copies in flight)."""
    device = target.device
    if device is None:
        step = PinHost
    elif device.type == "cpu":
        step = PassThrough
    else:
        step = CopyToDevice
    if not zero_copy:
        return lambda: step(target)
    return lambda: Adopt(target, step(target, zero_copy=True))


class PassThrough:
    """device="cpu": the source's batches, prefetched, as they are."""

    copy_stream = None  # the stream this mode's copies go on (None: no GPU work)

    def __init__(self, target: Target, zero_copy: bool = False):
        self.stats = target.stats

    def in_thread(self) -> None:
        """The producer's thread starts (before any other CUDA call there)."""

    def prepare(self, batch):
        self.stats.count(batch_nbytes(batch))
        return batch

    def prepare_here(self, batch):
        """prepare() in the consumer's thread (Ahead)."""
        return self.prepare(batch)

    # pin_received(batch), where a step has it: pins a batch in the pin thread
    # of the DataLoader iterator the step reads (a copying Loader's view of a
    # DataLoader with workers: _loader._own_workers), before the consumer's
    # prepare() takes it; _install.serve_pin_thread routes that thread there.
    pin_received = None

    def from_block(self, batch):
        """A zero-copy batch, its block adopted (still in its block's terms):
        what the queue gets, or None to take its leaves (from_adopted)."""
        return None

    def from_adopted(self, batch, nbytes: int):
        """A zero-copy batch whose leaves lie in the adopted block, of `nbytes`
        tensor and array bytes (as its worker counted them)."""
        self.stats.count(nbytes)
        return batch

    def deliver(self, item):
        """In the consumer's thread: the batch of a queued item."""
        return item

    def forget(self) -> None:
        """The producer's thread is gone: drop what copies in flight held."""

    def end(self) -> None:
        """The producer's thread ends (not at interpreter exit)."""


class PinHost(PassThrough):
    """device=None: every batch pinned in the staging arena. Zero-copy: only
    those its worker could not place in the shared arena (counted there)."""

    def __init__(self, target: Target, zero_copy: bool = False):
        import torch

        super().__init__(target)
        self.staging = _Staging(target, zero_copy)
        self.counted = zero_copy
        # The stream that will read the pinned batches, taken in the consumer's
        # thread: their blocks are reused only after it is done.
        self.consumer_stream = (torch.cuda.current_stream()
                                if cuda_available() and torch.cuda.is_available() else None)

    def prepare(self, batch):
        out = self.pin(batch)
        nbytes = batch_nbytes(out)
        self.stats.count(nbytes, pinned=nbytes)
        return out

    def pin(self, batch):
        """pin_memory into the staging arena. A batch it pins the ordinary way
        (the arena full, or the batch over its cap) is a fallback, counted
        here unless its worker's fallback was (zero-copy)."""
        # Ahead of the batch to hand over, in the consumer's own thread, the
        # room may be held by the batches before this one, which no wait here
        # would see handed over: it waits for its turn instead (NoRoomAhead).
        later = (lambda: self.prepare(batch)) if preparing_ahead.get() else None
        return _pin_counted(batch, self.staging, self.consumer_stream, self.stats, self.counted,
                            later)

    def pin_received(self, batch):
        """In the DataLoader's pin thread: the batch pinned there (prepare()
        then finds it pinned and hands it on as it is)."""
        return _timed(self.stats, self.pin, batch)


def _timed(stats: Stats, pin, *args):
    """pin(*args), its time added to the stats' copy time (pin_received: the
    pin thread's share, beside the consumer's)."""
    t0 = time.perf_counter()
    try:
        return pin(*args)
    finally:
        dt = time.perf_counter() - t0
        with stats.lock:
            stats.copy_seconds += dt


def _pin_counted(batch, staging: "_Staging", stream, stats: Stats, counted: bool,
                 later: Optional[Callable[[], Any]] = None):
    """pin_memory of `batch` into staging's arena as the policy says; a batch
    pinned the ordinary way (the arena full) counted as a fallback in `stats`
    unless `counted` (a zero-copy worker's fallback was). A batch a copy of
    which would not fit the cgroup's memory goes on unpinned (counted too).
    `later`, for a batch prepared ahead: no wait for room, NoRoomAhead(later)
    where there is none."""
    if _no_memory_for(batch):
        stats.fallback()
        return batch  # unpinned: a copy would take what the cgroup does not have
    arena = staging.arena()
    if later is not None:
        try:
            return pin_memory(batch, arena=arena, stream=stream, on_full="raise")
        except _C.ArenaFullError:
            raise NoRoomAhead(later) from None
    if counted or policy()["on_full"] != "fallback":
        return pin_memory(batch, arena=arena, stream=stream)
    try:
        return pin_memory(batch, arena=arena, stream=stream, on_full="raise")
    except _C.ArenaFullError:
        stats.fallback()
        return pin_memory(batch, arena=arena, stream=stream, on_full="fallback")


def _no_memory_for(batch) -> bool:
    """Whether a copy of `batch` would take more than its cgroup's memory limit
    leaves (_runtime.memory_room; never where no limit binds): the batch then
    goes on unpinned, as it came, rather than have the kernel kill the process
    without a word. Said once."""
    room = memory_room()
    if room is None:
        return False
    nbytes = batch_nbytes(batch)
    if nbytes <= room:
        return False
    if first("copy: cgroup"):
        log.warning("fastpin.Loader: a copy of this %d-byte batch would take more than the "
                    "%d bytes its cgroup's memory limit of %d bytes leaves (after an eighth kept "
                    "free), and the kernel would kill the process: such batches are handed over "
                    "unpinned, as the source made them (counted in stats()['fallbacks']). Give "
                    "the job more memory, or hold fewer batches at once (the DataLoader's "
                    "num_workers x prefetch_factor, the Loader's depth)",
                    nbytes, room, cgroup_memory_limit())
    return True


class _Staging:
    """The arena a mode pins or stages batches in by copy. Zero-copy: the GPU's
    default arena, made on first use, so that the batches a worker could not
    place take no room the workers need (which would make more fall back);
    else the Loader's arena (its GPU's default arena where it has none of its
    own, made on first use too)."""

    def __init__(self, target: Target, zero_copy: bool):
        self.index = target.index
        self.copy_arena = None if zero_copy else target.arena

    def arena(self) -> _C.Arena:
        if self.copy_arena is None:
            self.copy_arena = default_arena(self.index if self.index >= 0 else None)
        return self.copy_arena


class CopyToDevice(PassThrough):
    """device="cuda:N": each batch's leaves copied to the device on the copy
    stream (pageable ones staged through arena blocks in chunks, pinned ones
    directly: see _C.h2d), one event recorded; the consumer's stream waits on
    it and the batch's tensors are record_stream'ed onto it."""

    def __init__(self, target: Target, zero_copy: bool = False):
        import torch

        super().__init__(target)
        self.torch = torch
        self.device = target.device
        self.index = target.device.index
        self.depth = target.depth
        self.pin_objects = target.pin_objects
        self.staging = _Staging(target, zero_copy)
        # Where pinned sources lie (they need no staging): the Loader's arena,
        # or the shared arena's newest segment.
        self.pool = target.pool if zero_copy else None
        self.pinned = self.staging.copy_arena
        self.copy_stream = torch.cuda.Stream(self.device)
        self.current = _torch.CurrentStream(torch, self.index)
        # Sources that copies in flight may still read, with the batch's event.
        self.in_flight: list = []

    def in_thread(self) -> None:
        # A new thread's current device is 0, which this Loader must not touch.
        # The copy stream is this thread's current stream from here on, so
        # device memory made here is allocated under it (the consumer's stream
        # is added by record_stream when a batch is handed over).
        self.torch.cuda.set_device(self.device)
        self.torch.cuda.set_stream(self.copy_stream)

    def on_copy_stream(self, prepare, batch):
        """prepare(batch) in the consumer's thread (Ahead), the copy stream its
        current stream meanwhile. Where the consumer's current device is this
        one (the usual case) only the stream is swapped and put back: the
        context managers that also switch devices cost several times that."""
        current = self.current
        previous = current.swap(self.copy_stream)
        if previous is None:  # another device is current
            cuda = self.torch.cuda
            with cuda.device(self.device), cuda.stream(self.copy_stream):
                return prepare(batch)
        try:
            return prepare(batch)
        finally:
            current.restore(previous)

    def prepare_here(self, batch):
        return self.on_copy_stream(self.prepare, batch)

    def pin_received(self, batch):
        """In the DataLoader's pin thread: the batch pinned in the staging
        arena, so that prepare() copies it to the device straight from there
        (its source kept alive until the copy is done: in_flight)."""
        return _timed(self.stats, _pin_counted, batch, self.staging, None, self.stats, False)

    def deliver(self, item):
        """The consumer's current stream waits on the batch's copy, and its
        device memory is record_stream'ed onto that stream (freed, it is reused
        only once the stream is past its use). A copy still running (issued
        `depth` batches ago: the bus is behind, and the consumer would wait for
        it anyway) is also waited for here, so that the batch is whole for
        every stream, as a pinned host batch is: code that reads it on a side
        stream of its own without waiting on the current one (timm's
        PrefetchLoader normalises there) reads no byte early."""
        out, event, made = item
        stream = self.current.stream()
        stream.wait_event(event)
        if not event.query():
            event.synchronize()  # a blocking event: the thread sleeps
        for t in made:
            t.record_stream(stream)
        return out

    def forget(self) -> None:
        self.in_flight.clear()

    def prepare(self, batch):
        torch, device = self.torch, self.device
        copies = []   # (dst address, src address, nbytes, src is pinned)
        keep = []     # (destination, the source it reads)
        made = []     # every device tensor made here, for record_stream later

        def leaf(given):
            if not isinstance(given, (torch.Tensor, np.ndarray)):
                return given.pin_memory()  # install(): it pins itself (is_leaf)
            x = _leaves.device_source(given)  # the leaf's type decides (one registry)
            if x is None:
                return given
            if x.device == device:
                return x  # there already
            if x.device.type != "cpu":
                moved = x.to(device, non_blocking=True)
                made.append(moved)
                return moved
            dst = torch.empty(x.shape, dtype=x.dtype, device=device)
            made.append(dst)
            nbytes = x.numel() * x.element_size()
            if nbytes:
                copies.append((dst.data_ptr(), x.data_ptr(), nbytes, x.is_pinned()))
                keep.append((dst, x))
            return dst

        out = map_leaves(batch, self.is_leaf, leaf)
        return out, self.issue(copies, keep), made

    def is_leaf(self, x) -> bool:
        """What prepare() takes as a leaf: tensors and arrays; for install(),
        objects with their own pin_memory() too."""
        return isinstance(x, (self.torch.Tensor, np.ndarray)) or (
            self.pin_objects and _leaves.is_leaf(x))

    def ordinary(self, made: list):
        """For a zero-copy batch's leaves that are not in its block (Block.unpack's
        `ordinary`): tensors and arrays copied to the device on the copy stream
        (each device tensor added to `made`), objects with their own pin_memory()
        asked to pin themselves (install()), the rest as they are."""
        torch, device = self.torch, self.device

        def move(x):
            if not isinstance(x, (torch.Tensor, np.ndarray)):
                return x.pin_memory() if self.pin_objects and _leaves.is_leaf(x) else x
            src = _leaves.device_source(x)
            if src is None or src.device == device:
                return x if src is None else src
            moved = src.to(device, non_blocking=True)
            made.append(moved)
            return moved

        return move

    def from_adopted(self, batch, nbytes: int):
        return self.prepare(batch)

    def from_block(self, batch):
        """One copy of the whole block into one device buffer, its leaves views
        of that buffer (no per-leaf work but the view). None: a leaf this path
        cannot take; use the ordinary one."""
        block = batch.block
        # Whole 16 bytes: every dtype can view all of it (device_views). Made
        # of the leaves' dtype where they share one: no view of it to make.
        nbytes = -(-block.nbytes // 16) * 16
        dtype = _record.one_dtype(batch.record) or self.torch.uint8
        buffer = self.torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=self.device)
        made = [buffer]  # the views share its memory: it alone is record_stream'ed
        tree = _adoption.device_views(batch, buffer, self.ordinary(made))
        if tree is None:
            return None
        # The block goes back to the arena once the copy stream is past this
        # copy: its event is recorded there when the Block dies, at return.
        block.consumer_stream = self.copy_stream.cuda_stream
        copies = [(buffer.data_ptr(), block.ptr, block.nbytes, True)] if block.nbytes else []
        return tree, self.issue(copies, []), made

    def issue(self, copies: list, keep: list):
        """Queue the copies on the copy stream (this thread's current stream) and
        return the event the consumer waits on. `keep`: (destination, source)
        pairs to copy from pageable memory should the arena have no room."""
        try:
            # Pinned sources alone need no staging: no arena to make for them.
            pinned = self.pinned if self.pool is None else self.pool.newest()
            staging = (pinned if pinned is not None and all(c[3] for c in copies)
                       else self.staging.arena())
            _C.h2d(as_core_arena(staging), self.copy_stream.cuda_stream, copies)
        except _C.ArenaFullError:
            # Live pinned batches fill the arena: copy from pageable memory,
            # slower, never stuck. Copies already queued stay valid.
            for dst, src in keep:
                dst.copy_(src)
            self.stats.fallback()
        # Blocking: a wait on it below sleeps instead of spinning a core.
        event = self.torch.cuda.Event(blocking=True)
        event.record(self.copy_stream)
        in_flight = self.in_flight
        while in_flight and in_flight[0][0].query():
            in_flight.pop(0)
        in_flight.append((event, keep))
        if len(in_flight) > self.depth + 1:
            # The bus is behind: queue no further ahead of it. Every copy queued
            # keeps its source block (and its batch's device memory) held.
            in_flight.pop(0)[0].synchronize()
        # Pinned sources (zero-copy's block) are copied to the device, not pinned here.
        self.stats.count(sum(c[2] for c in copies), pinned=sum(c[2] for c in copies if not c[3]))
        return event


class Adopt:
    """zero_copy=True: the DataLoader's workers collated into the shared arena.
    A batch they placed there is taken over (no copy on the host); one that
    fell back (the arena was full) is counted, warned about once, and goes the
    way of the `inner` mode."""

    def __init__(self, target: Target, inner: PassThrough):
        self.inner = inner
        self.stats = target.stats
        self.pool = target.pool
        self.loader = target.loader  # the DataLoader (not its iterator): for sizing advice
        self.depth = target.depth
        self.who = target.who
        self.copy_stream = inner.copy_stream
        # Read only by the copy stream where there is one; on the host the user
        # gets the block, so its fence keeps covering every stream (the default).
        self.consumer = getattr(self.copy_stream, "cuda_stream", None)
        self.in_thread, self.deliver, self.forget = inner.in_thread, inner.deliver, inner.forget

    def prepare(self, batch):
        self.pool.collect()  # only this process can see the GPU finish with blocks
        batch = _adoption.adopted(batch)
        inner = self.inner
        if isinstance(batch, _adoption.Adopted):
            out = inner.from_block(batch)
            if out is not None:
                return out
        nbytes = batch.nbytes if isinstance(batch, _adoption.Adopted) else 0
        batch, placed = _adoption.receive(batch, self.consumer)
        if placed:
            return inner.from_adopted(batch, nbytes)
        if self.stats.fallback():
            self.warn_full(batch)
        return inner.prepare(batch)

    def prepare_here(self, batch):
        if self.copy_stream is None:
            return self.prepare(batch)
        return self.inner.on_copy_stream(self.prepare, batch)

    def end(self) -> None:
        """The epoch's thread ends: workers that died before their batches
        arrived (killed, or shut down with results still queued) leave blocks
        behind."""
        self.pool.reclaim()

    def warn_full(self, batch) -> None:
        """Once per Loader: a worker found the shared arena full; say what fits."""
        nbytes = batch_nbytes(batch)
        ahead = batches_ahead(self.loader)
        need = capacity_for(self.loader, nbytes, self.depth)
        pool = self.pool
        if advice_for(pool):
            advice = advice_for(pool)
        elif pool.fixed:
            advice = f"for this DataLoader give it capacity={need} ({need / 1e6:.0f} MB) or more."
        elif pool.capacity < need:
            advice = (f"it sizes itself, up to max_capacity={pool.cap} bytes (or "
                      f"FASTPIN_ZERO_COPY_MAX_BYTES); for this DataLoader raise that to {need} "
                      f"({need / 1e6:.0f} MB) or more.")
        else:
            advice = ("it sized itself for these batches: the batches you keep alive hold the "
                      f"rest; keep fewer, or give capacity={need + pool.capacity} or more.")
        log.warning(
            "%s, zero-copy: a DataLoader worker found the shared arena full "
            "(%.0f MB) and collated a batch of %.1f MB the ordinary way; such batches are "
            "pinned by copy in the main process, which is slower. The arena holds the "
            "workers' batches in flight (num_workers x prefetch_factor = %d), the Loader's "
            "depth and the batches you keep: %s", self.who, pool.capacity / 1e6, nbytes / 1e6,
            ahead, advice)
