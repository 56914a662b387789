"""The default arena when no capacity is set: segments that grow with the live batches.

A GrowingArena starts as one small segment (an arena, page-locked once) and
adds bigger ones as the live batches need, never past its cap: a new segment
holds as much as all the others together (the total doubles), and at least
four of the batch that asked, in whole 2 MiB. When one is added, the older
segments whose blocks are all free are released (none of them had room for
that batch); blocks keep their own segment alive, so a tensor over one stays
valid. It answers what pin_memory, collate and the Loader ask of an arena
(pin_tree, pin_batch, pin, alloc, collect, stats), so that a fixed _C.Arena
and a growing one are used alike.

The fast path is the newest segment's own C call. Only when that is full are
the older segments tried; then pin() and alloc(), which know the size, add a
segment under the lock and copy after letting it go. pin_tree and pin_batch
never grow: a full arena sends pin_memory to its Python pipeline, whose pin()
does (once per growth, not per batch). Where the driver refuses to page-lock
a new segment (RLIMIT_MEMLOCK), one warning, and the arena grows no more:
batches that find no room take the on_full policy, as past the cap.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from . import _C
from ._runtime import cgroup_memory_limit, first, memory_room

log = logging.getLogger("fastpin")

_GRAIN = 2 << 20      # segments are whole multiples of 2 MiB
_BATCHES = 4          # a new segment holds at least this many of the batch that asked
# Summed over the segments in stats() (the others are the newest segment's).
_SUMMED = ("capacity", "bytes_in_use", "bytes_requested", "high_water", "bytes_pending",
           "allocs", "failed", "waits", "blocks_in_use", "blocks_pending", "max_blocks",
           "fallbacks", "lock_recoveries", "reclaimed", "blocks_foreign")


def _empty(arena: _C.Arena) -> bool:
    """No block of `arena` is in use or waits for the GPU."""
    s = arena.stats()
    return not (s["blocks_in_use"] or s["blocks_pending"] or s["bytes_in_use"]
                or s["bytes_pending"])


class GrowingArena:
    """One GPU's default arena, in segments (newest first), from `start` bytes
    up to `cap`; make(nbytes) makes (and page-locks) a segment."""

    def __init__(self, make: Callable[[int], _C.Arena], start: int, cap: int):
        self.make = make
        self.cap = cap
        self.refused: Optional[str] = None  # why the driver refused a segment: no more growth
        # Why the last growth found too little memory left in the cgroup (None:
        # it did not); unlike a refusal, the next growth tries again.
        self.tight: Optional[str] = None
        # Newest first. Replaced whole under the lock, never changed in place:
        # a pin reads it once, without the lock.
        self.segments: tuple = (make(min(start, cap)),)
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"<fastpin GrowingArena: {self.capacity} bytes in {len(self.segments)} "
                f"segments, cap {self.cap}>")

    @property
    def newest(self) -> _C.Arena:
        return self.segments[0]

    @property
    def capacity(self) -> int:
        """The bytes the segments hold now (the most they may: cap)."""
        return sum(a.capacity for a in self.segments)

    @property
    def registered(self) -> bool:
        return all(a.registered for a in self.segments)

    @property
    def device(self) -> int:
        return self.segments[0].device

    # ---- placing a batch -------------------------------------------------------------

    def pin_tree(self, data: Any, check_pinned: bool, *span: int) -> Any:
        segments = self.segments
        try:
            return segments[0].pin_tree(data, check_pinned, *span)
        except _C.ArenaFullError:
            return self._place(segments[0], _C.Arena.pin_tree, (data, check_pinned, *span))

    def pin_batch(self, leaves: list, check_pinned: bool, *span: int) -> Optional[list]:
        segments = self.segments
        try:
            return segments[0].pin_batch(leaves, check_pinned, *span)
        except _C.ArenaFullError:
            return self._place(segments[0], _C.Arena.pin_batch, (leaves, check_pinned, *span))

    def pin(self, sources, *align):
        segments = self.segments
        try:
            return segments[0].pin(sources, *align)
        except _C.ArenaFullError:
            # Each source's padding to the alignment at most a granule (the default).
            need = sum(n for _, n in sources) + len(sources) * max((_C.GRANULE, *align))
            return self._place(segments[0], _C.Arena.pin, (sources, *align), need)

    def alloc(self, nbytes: int) -> _C.Block:
        segments = self.segments
        try:
            return segments[0].alloc(nbytes)
        except _C.ArenaFullError:
            return self._place(segments[0], _C.Arena.alloc, (nbytes,), nbytes)

    def _place(self, tried: _C.Arena, method, args: tuple, need: Optional[int] = None):
        """method(segment, *args) in the segments other than `tried`, newest first,
        then (`need` bytes given) in a segment added for it; ArenaFullError when
        none has room and none may be added."""
        segments = self.segments
        for arena in segments:
            if arena is not tried:
                try:
                    return method(arena, *args)
                except _C.ArenaFullError:
                    pass
        while need is not None:
            with self.lock:
                if self.segments is segments and not self._grow(need):
                    break
                segments = self.segments
            try:   # the copy runs without the lock: other threads pin meanwhile
                return method(segments[0], *args)
            except _C.ArenaFullError:
                pass   # other threads filled the new segment first: grow again
        raise _C.ArenaFullError(self._no_room(need))

    def _grow(self, need: int) -> bool:
        """Add a segment with room for a block of `need` bytes (under the lock);
        False at the cap or once the driver has refused one."""
        if self.refused:
            return False
        block = _C.block_size(max(need, 1))
        held = self.capacity
        keep = tuple(a for a in self.segments if not _empty(a))
        room = self.cap - sum(a.capacity for a in keep)
        add = min(-(-max(held, _BATCHES * block) // _GRAIN) * _GRAIN, room)
        if add < block:
            return False
        add = self._within_cgroup(add, block)
        if add < block:
            return False
        try:
            arena = self.make(add)
        except (_C.FastpinError, OSError) as e:
            self.refused = str(e)
            log.warning("fastpin: the default arena could not grow by %d bytes (%s); it stays "
                        "at %d bytes, and batches that find it full take the on_full policy. "
                        "Raise the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK; a container's "
                        "--ulimit memlock=-1), or free memory on the machine",
                        add, self.refused, held)
            return False
        self.segments = (arena, *keep)
        self.tight = None
        log.debug("fastpin: the default arena grew by %d bytes to %d (%d segments) for a "
                  "batch of %d bytes", add, self.capacity, len(self.segments), need)
        return True

    def _within_cgroup(self, add: int, block: int) -> int:
        """`add` bytes, or less (whole grains, at least `block`: else 0) where the
        cgroup's limit leaves less room (_runtime.memory_room): a segment is
        resident once used (at once where page-locked), and past the limit the
        kernel kills the process without a word. Batches that find no room take
        the on_full policy meanwhile; the next growth looks again."""
        room = memory_room()
        if room is None or add <= room:
            return add
        fits = room // _GRAIN * _GRAIN
        if fits >= block:
            return fits
        self.tight = (f"its cgroup's memory limit of {cgroup_memory_limit()} bytes leaves "
                      f"{room} bytes (after an eighth kept free) for a segment of {add}")
        if first("default arena: cgroup"):
            log.warning("fastpin: the default arena cannot grow: %s; it stays at %d bytes, "
                        "and batches that find it full take the on_full policy (fallback: "
                        "pinned the ordinary way). Give the job more memory, or hold fewer "
                        "batches at once (the DataLoader's num_workers x prefetch_factor, the "
                        "Loader's depth)", self.tight, self.capacity)
        return 0

    def _no_room(self, need: Optional[int]) -> str:
        what = f"{need} bytes" if need is not None else "a batch"
        why = ("the driver refused to page-lock more: raise the locked-memory limit "
               "(ulimit -l)" if self.refused
               else f"{self.tight}: give the job more memory" if self.tight
               else f"it grows no further than its cap of {self.cap} bytes: for more, give a "
                    "fixed arena with fastpin.configure(capacity=...) or FASTPIN_ARENA_BYTES")
        return (f"no room for {what} in the default arena ({self.capacity} bytes in "
                f"{len(self.segments)} segments, {self.stats()['bytes_in_use']} in use by "
                f"live batches): {why}")

    # ---- what an arena answers -------------------------------------------------------

    def collect(self) -> None:
        for arena in self.segments:
            arena.collect()

    def is_valid(self) -> bool:
        return all(arena.is_valid() for arena in self.segments)

    def stats(self) -> dict:
        """The segments' stats summed (capacity, bytes_in_use, high_water, ...; the
        newest's numa_node), with the count of segments and the cap."""
        per = [a.stats() for a in self.segments]
        out = dict(per[0])
        for key in _SUMMED:
            out[key] = sum(p.get(key, 0) for p in per)
        classes: dict = {}
        for p in per:
            for size, n in p.get("class_blocks", {}).items():
                classes[size] = classes.get(size, 0) + n
        out["class_blocks"] = classes
        out["registered"] = all(p["registered"] for p in per)
        out["segments"], out["cap"] = len(per), self.cap
        return out
