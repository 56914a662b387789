"""What a Loader does to each batch: one small strategy per mode, chosen once
in Loader.__init__ (choose) and made for each epoch by its producer.

    PassThrough     device="cpu": the source's batches as they are
    PinHost         device=None: pinned in the staging arena, for the user's
                    own .to(..., non_blocking=True)
    CopyToDevice    device="cuda:N": every leaf copied on the copy stream; the
                    consumer's stream waits on the copy's event
    Adopt           zero_copy=True, around one of the three: a batch a worker
                    placed in the shared arena is taken over (to the device: one
                    copy of its whole block); one that fell back goes the inner
                    mode's way

A strategy's prepare() runs in the producer's thread (depth=0: the
consumer's, through prepare_here()), deliver() in the consumer's; the thread,
the queue and shutdown are the producer's (_loader), never a mode's.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import numpy as np

from . import _C, _leaves
from ._arena import as_core_arena, cuda_available, default_arena, policy
from ._pin import pin_memory
from ._runtime import cgroup_memory_limit, first, memory_room
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


def choose(device: Any, zero_copy: bool):
    """The strategy of a Loader for `device` (a torch.device, or None): a
    callable of the Loader that makes the strategy of one epoch."""
    if device is None:
        mode = PinHost
    elif device.type == "cpu":
        mode = PassThrough
    else:
        mode = CopyToDevice
    if not zero_copy:
        return lambda owner: mode(owner)
    return lambda owner: Adopt(owner, mode(owner, zero_copy=True))


class PassThrough:
    """device="cpu": the source's batches, prefetched, as they are."""

    copy_stream = None  # the stream this mode's copies go on (None: no GPU work)

    def __init__(self, owner, zero_copy: bool = False):
        self.stats = owner._stats

    def in_thread(self) -> None:
        """The producer's thread starts (before any other CUDA call there)."""

    def prepare(self, batch):
        self.stats.count(batch_nbytes(batch))
        return batch

    def prepare_here(self, batch):
        """prepare() in the consumer's thread (depth=0)."""
        return self.prepare(batch)

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

    def __init__(self, owner, zero_copy: bool = False):
        import torch

        super().__init__(owner)
        self.staging = _Staging(owner, zero_copy)
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
        if _no_memory_for(batch):
            self.stats.fallback()
            return batch  # unpinned: a copy would take what the cgroup does not have
        arena = self.staging.arena()
        stream = self.consumer_stream
        if self.counted or policy()["on_full"] != "fallback":
            return pin_memory(batch, arena=arena, stream=stream)
        try:
            return pin_memory(batch, arena=arena, stream=stream, on_full="raise")
        except _C.ArenaFullError:
            self.stats.fallback()
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
    else the Loader's arena, made when the epoch starts."""

    def __init__(self, owner, zero_copy: bool):
        self.index = owner._index
        self.copy_arena = None if zero_copy else owner.arena

    def arena(self) -> _C.Arena:
        if self.copy_arena is None:
            self.copy_arena = default_arena(self.index if self.index >= 0 else None)
        return self.copy_arena


class CopyToDevice(PassThrough):
    """device="cuda:N": each batch's leaves copied to the device on the copy
    stream (pageable ones staged through arena blocks in chunks, pinned ones
    directly: see _C.h2d), one event recorded; the consumer's stream waits on
    it and the batch's tensors are record_stream'ed onto it."""

    def __init__(self, owner, zero_copy: bool = False):
        import torch

        super().__init__(owner)
        self.torch = torch
        self.device = owner.device
        self.depth = owner.depth
        self.staging = _Staging(owner, zero_copy)
        # Where pinned sources lie (they need no staging): the Loader's arena,
        # or the shared arena's newest segment.
        self.pool = owner._pool if zero_copy else None
        self.pinned = self.staging.copy_arena
        self.copy_stream = torch.cuda.Stream(self.device)
        # Sources that copies in flight may still read, with the batch's event.
        self.in_flight: list = []

    def in_thread(self) -> None:
        # A new thread's current device is 0, which this Loader must not touch.
        # The copy stream is this thread's current stream from here on, so
        # device memory made here is allocated under it (the consumer's stream
        # is added by record_stream when a batch is handed over).
        self.torch.cuda.set_device(self.device)
        self.torch.cuda.set_stream(self.copy_stream)

    @contextlib.contextmanager
    def here(self):
        """The copy stream made current in the consumer's thread (depth=0)."""
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            yield

    def prepare_here(self, batch):
        with self.here():
            return self.prepare(batch)

    def deliver(self, item):
        out, event, made = item
        stream = self.torch.cuda.current_stream(self.device)
        stream.wait_event(event)
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

        out = map_leaves(batch, lambda x: isinstance(x, (torch.Tensor, np.ndarray)), leaf)
        return out, self.issue(copies, keep), made

    def from_adopted(self, batch, nbytes: int):
        return self.prepare(batch)

    def from_block(self, batch):
        """One copy of the whole block into one device buffer, its leaves views
        of that buffer (no per-leaf work but the view). None: a leaf this path
        cannot take; use the ordinary one."""
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

    def __init__(self, owner, inner: PassThrough):
        self.inner = inner
        self.stats = owner._stats
        self.pool = owner._pool
        self.loader = owner.loader  # the DataLoader (not its iterator): for sizing advice
        self.depth = owner.depth
        self.copy_stream = inner.copy_stream
        # Read only by the copy stream where there is one; on the host the user
        # gets the block, so its fence keeps covering every stream (the default).
        self.consumer = getattr(self.copy_stream, "cuda_stream", None)
        self.in_thread, self.deliver, self.forget = inner.in_thread, inner.deliver, inner.forget

    def prepare(self, batch):
        from . import _zerocopy

        self.pool.collect()  # only this process can see the GPU finish with blocks
        batch = _zerocopy.adopted(batch)
        inner = self.inner
        if isinstance(batch, _zerocopy.Adopted):
            out = inner.from_block(batch)
            if out is not None:
                return out
        nbytes = batch.nbytes if isinstance(batch, _zerocopy.Adopted) else 0
        batch, adopted = _zerocopy.receive(batch, self.consumer)
        if adopted:
            return inner.from_adopted(batch, nbytes)
        if self.stats.fallback():
            self.warn_full(batch)
        return inner.prepare(batch)

    def prepare_here(self, batch):
        if self.copy_stream is None:
            return self.prepare(batch)
        with self.inner.here():
            return self.prepare(batch)

    def end(self) -> None:
        """The epoch's thread ends: workers that died before their batches
        arrived (killed, or shut down with results still queued) leave blocks
        behind."""
        self.pool.reclaim()

    def warn_full(self, batch) -> None:
        """Once per Loader: a worker found the shared arena full; say what fits."""
        from . import _zerocopy

        nbytes = batch_nbytes(batch)
        ahead = _zerocopy.batches_ahead(self.loader)
        need = _zerocopy.capacity_for(self.loader, nbytes, self.depth)
        pool = self.pool
        if _zerocopy.advice_for(pool):
            advice = _zerocopy.advice_for(pool)
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
            "fastpin.Loader(zero_copy=True): a DataLoader worker found the shared arena full "
            "(%.0f MB) and collated a batch of %.1f MB the ordinary way; such batches are "
            "pinned by copy in the main process, which is slower. The arena holds the "
            "workers' batches in flight (num_workers x prefetch_factor = %d), the Loader's "
            "depth and the batches you keep: %s", pool.capacity / 1e6, nbytes / 1e6, ahead, advice)
