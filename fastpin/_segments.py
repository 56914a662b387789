"""The segments of zero-copy's shared arena: the registry of the arenas whose
blocks may be adopted in this process, and the Pool of one Loader's workers.

A self-sizing Pool starts empty. A worker whose batch finds no room the pool
was not yet sized for asks the main process for more through a small shared
directory (a memfd of 8-byte words) and waits; a thread there (the grower)
adds a segment (another shared arena, registered once) so that the pool
holds capacity_for() that batch, never more than its cap, and the workers
open it: those started before it existed through the creator's
/proc/<pid>/fd, or, where that is refused, they fall back until the next
epoch's workers, which carry every segment. Attaching an arena in a worker
is _zerocopy's (its prefault, its thread count); this module is handed the
function that does it.
"""
from __future__ import annotations

import logging
import mmap
import os
import select
import struct
import threading
import time
import types
import weakref
from typing import Callable, Optional

from . import _C, _numa
from ._runtime import cgroup_memory_limit, machine_cap, memory_room, process, zero_copy_max_bytes

log = logging.getLogger("fastpin")

# This process's registries, held by _runtime (a forked child's are empty):
# the arenas it made whose blocks may arrive here, by token.
_arenas = process.shared


def _registry() -> "weakref.WeakValueDictionary[int, _C.Arena]":
    """The arenas this process registered (none of a parent's, after fork)."""
    return _arenas


def register(arena: _C.Arena) -> None:
    """Let blocks of `arena` shipped by workers be adopted in this process."""
    _registry()[arena.token] = arena


# ---- the directory of a self-sizing pool ----------------------------------------
#
# A small shared memfd through which workers ask the main process for room and
# learn of the segments (shared arenas) it adds. Fields are 8-byte words; the
# main process writes a segment's entry before it raises `count`.
_DIR_COUNT, _DIR_SERVED, _DIR_WANTED, _DIR_CLOSED, _DIR_FALLBACKS = 0, 8, 16, 24, 32
# Raised by the main process each time it has looked at the GPU's fences
# (Pool.collect) for the workers: a worker that finds the pool full of blocks
# the GPU still reads wakes it, and waits for this to move.
_DIR_COLLECTED = 40
# Why the pool could not grow when a worker last asked (_LIMIT_*), for the
# error of a batch that fell back and then found no room in /dev/shm.
_DIR_LIMIT = 48
_LIMIT_NONE, _LIMIT_REFUSED, _LIMIT_TIGHT = 0, 1, 2
# The block size a first stage was made for, while it is the only segment and
# the rest is still to come (0 otherwise): it holds the first batches in the
# order the loop takes them (_Directory.stage_blocks).
_DIR_STAGE = 56
_DIR_ENTRIES = 64           # then (fd in the creator, token, capacity) per segment
_MAX_SEGMENTS = 64
_DIR_BYTES = _DIR_ENTRIES + 24 * _MAX_SEGMENTS
_CAPPED = 1 << 62           # _DIR_SERVED once the pool can grow no more
# How long a worker waits for the main process to add a segment before it
# falls back: registering a few GB takes a second or two.
GROW_WAIT_S = 30.0
# An empty pool growing by much first gets a stage of this (or two blocks),
# then at once the rest: the first batches wait for the stage's registration,
# not for room for every batch in flight (stage_of).
STAGE_MIN_BYTES = 256 << 20
# How long a worker waits for the GPU to finish with blocks the main process
# freed (a consumer's copies queued behind its compute) before it falls back.
FREE_WAIT_S = 10.0


def _word(view, at: int) -> int:
    return struct.unpack_from("<Q", view, at)[0]


def _set_word(view, at: int, value: int) -> None:
    struct.pack_into("<Q", view, at, value)


def _open_segment(creator: int, fd: int) -> int:
    """A segment made after this worker started: opened through the creator's
    descriptor table (the same file, so the same memory). Raises OSError where
    that is not permitted (another user, a hardened /proc)."""
    return os.open(f"/proc/{creator}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


class _Directory:
    """A worker's view of a pool's directory: the segments it has attached,
    newest first, and the way to ask for more."""

    def __init__(self, fd: int, wake: int, creator: int, carried: dict, attach):
        self.map = mmap.mmap(fd, _DIR_BYTES)
        self.attach = attach     # (fd, token) -> the arena attached in this process
        self.wake, self.creator, self.carried = wake, creator, carried
        self.seen = 0
        self.arenas: list = []   # newest first

    def refresh(self) -> list:
        """Attach the segments added since the last look; returns them, newest first."""
        before = self.seen
        count = min(_word(self.map, _DIR_COUNT), _MAX_SEGMENTS)
        while self.seen < count:
            at = _DIR_ENTRIES + 24 * self.seen
            fd, token = _word(self.map, at), _word(self.map, at + 8)
            own = _registry().get(token)
            if own is None and token in self.carried:
                own = self.attach(self.carried[token], token)
            if own is None:
                try:
                    local = _open_segment(self.creator, fd)
                except OSError:
                    break  # not reachable from here: batches that need it fall back
                try:
                    own = self.attach(local, token)
                finally:
                    os.close(local)
            self.arenas.insert(0, own)
            self.seen += 1
        return self.arenas[:self.seen - before]

    def stage_blocks(self) -> Optional[int]:
        """While a first stage is the pool's only segment and the rest is still
        being made: how many of the blocks it was made for it holds; else None.
        Read before the count, which the main process raises before it clears
        the stage (a worker that sees the stage sees it alone)."""
        block = _word(self.map, _DIR_STAGE)
        if not block or _word(self.map, _DIR_COUNT) != 1:
            return None
        return _word(self.map, _DIR_ENTRIES + 16) // block

    def may_grow(self, need: int) -> bool:
        """Whether the main process has yet to size the pool for blocks of `need`."""
        return not _word(self.map, _DIR_CLOSED) and _word(self.map, _DIR_SERVED) < need

    def ask(self, need: int) -> bool:
        """Ask for room for blocks of `need` bytes; wait (bounded) for the answer.
        True when the pool grew (a stage, or sized for `need`, or can grow no
        more): its new segments are then in the list refresh() reads."""
        deadline = time.monotonic() + GROW_WAIT_S
        delay, wake = 0.0005, True
        seen = _word(self.map, _DIR_COUNT)
        while time.monotonic() < deadline and not _word(self.map, _DIR_CLOSED):
            if _word(self.map, _DIR_SERVED) >= need:   # grown for it, or at the cap
                return True
            # A new segment that can hold the block: try it.
            count = min(_word(self.map, _DIR_COUNT), _MAX_SEGMENTS)
            while seen < count:
                if _word(self.map, _DIR_ENTRIES + 24 * seen + 16) >= need:
                    return True
                seen += 1
            # Racy between workers (a plain read, then write): a request that
            # another worker's smaller one overwrote is made again.
            if _word(self.map, _DIR_WANTED) < need:
                _set_word(self.map, _DIR_WANTED, need)
                wake = True
            if wake:
                try:
                    os.eventfd_write(self.wake, 1)
                except OSError:
                    return False
                wake = False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return False

    def wait_for_frees(self, deadline: float, attempt: int = 0) -> bool:
        """The pool is full and sized: if some of its blocks are freed but still
        read by the GPU (pending on their fences), ask the main process to look
        at the fences again, and wait until it has (only it can see them pass:
        it looks on its own only when a zero-copy batch arrives, and none may
        arrive while every worker waits). True: try the segments again; False
        (nothing pending, the pool closed, or past `deadline`): fall back.
        `attempt`: how many times this batch has waited already; later looks
        come less often (up to 50 a second), so a GPU far behind does not keep
        the main process's thread collecting, and holding the GIL, nonstop."""
        if time.monotonic() >= deadline or not any(
                a.stats()["blocks_pending"] for a in self.arenas):
            return False
        if attempt:
            time.sleep(min(0.0005 * 2 ** min(attempt, 6), 0.02))
        served = _word(self.map, _DIR_COLLECTED)
        try:
            os.eventfd_write(self.wake, 1)
        except OSError:
            return False
        end, delay = min(deadline, time.monotonic() + 0.05), 0.0002
        while _word(self.map, _DIR_COLLECTED) == served and time.monotonic() < end:
            if _word(self.map, _DIR_CLOSED):
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        return True

    def count_fallback(self) -> None:
        if self.arenas:
            self.arenas[0].count_fallback()
        else:
            # Before this worker has a segment to count in; racy, so a lower bound.
            _set_word(self.map, _DIR_FALLBACKS, _word(self.map, _DIR_FALLBACKS) + 1)
        try:
            os.eventfd_write(self.wake, 1)  # the main process says so (Pool.tell_fallbacks)
        except OSError:
            pass


_directories = process.directories   # pool id -> _Directory, in workers
_pools = process.pools               # pool id -> Pool, in the process that made it


def directory_for(directory: tuple, segments: list, attach) -> "Optional[_Directory]":
    """This process's view of the pool directory `directory` (pool id, dir fd,
    wake fd, creator pid) that _WorkerCollate carries, made on first use and
    refreshed; None once that pool is gone (collating in its own process)."""
    pool, dir_fd, wake, creator = directory
    if creator == os.getpid():
        # Collating in the main process (num_workers=0): the pool's own
        # view, which goes with the pool.
        own = _pools.get(pool)
        if own is None:
            return None
        if own.local is None:
            own.local = _Directory(dir_fd, wake, creator, {}, attach)
        view = own.local
    else:
        view = _directories.get(pool)
        if view is None:
            carried = dict((token, fd) for fd, token in segments)
            view = _directories[pool] = _Directory(dir_fd, wake, creator, carried, attach)
    view.refresh()
    return view


def batches_ahead(loader) -> int:
    """Batches a DataLoader's workers hold at once (num_workers x prefetch_factor;
    one when it collates in this process)."""
    return (loader.prefetch_factor or 2) * loader.num_workers if loader.num_workers else 1


def shape_of(loader) -> types.SimpleNamespace:
    """What sizing needs of DataLoader `loader` (batches_ahead), without holding it."""
    return types.SimpleNamespace(num_workers=loader.num_workers,
                                 prefetch_factor=loader.prefetch_factor)


def capacity_for(loader, batch_bytes: int, depth: int) -> int:
    """Bytes of shared arena that zero-copy over `loader` needs for batches of
    `batch_bytes`: the workers' batches in flight, the Loader's depth, and 6 more
    (one being copied, copies queued on the bus, slack), each block its size class."""
    return _C.block_size(max(batch_bytes, 1)) * (batches_ahead(loader) + depth + 6)


_MiB = 1 << 20


def _whole_2mib(n: int) -> int:
    """`n` bytes rounded up to whole 2 MiB (what segments are made of)."""
    return -(-n // (2 * _MiB)) * 2 * _MiB


def stage_of(add: int, have: int, block: int, segments: int) -> tuple:
    """(bytes to add now, whether that is all) for a pool holding `have` bytes
    in `segments` segments that is to grow by `add` for blocks of `block`
    bytes: an empty pool growing by more than a stage and a half first takes a
    stage (STAGE_MIN_BYTES, or two blocks if more; whole 2 MiB), the rest
    after it; any other growth is made whole."""
    step = _whole_2mib(max(STAGE_MIN_BYTES, 2 * block))
    if have or add <= step + step // 2 or segments >= _MAX_SEGMENTS - 2:
        return add, True
    return step, False


def default_cap(registered: bool) -> int:
    """The most a self-sizing shared arena grows to, bytes: FASTPIN_ZERO_COPY_MAX_BYTES,
    else machine_cap(registered)."""
    value = zero_copy_max_bytes()
    return value if value is not None else machine_cap(registered)


def _close_directory(creator: int, view, fds: tuple, wake: int) -> None:
    """A pool's end (in the process that made it): workers stop waiting for it."""
    if os.getpid() != creator:
        return  # a forked child's copy: the pool is its parent's
    try:
        _set_word(view, _DIR_CLOSED, 1)
        os.eventfd_write(wake, 1)  # the grower thread wakes, sees it, and closes up
    except (OSError, ValueError):
        pass


class Pool:
    """The shared arena of one Loader's workers: one or more segments (shared
    arenas, each registered with CUDA once, in this process).

    Fixed (capacity or arena given): one segment, made up front. Self-sizing
    (neither given): no memory until the first batch. A worker that finds no
    room for a batch the pool has not yet been sized for asks through the
    directory and waits (at most GROW_WAIT_S); a thread here adds a segment
    towards capacity_for(loader, that batch, depth) in all, never more than
    `cap`, and workers open it (spawned before it existed: through
    /proc/<this pid>/fd). An empty pool that is to grow by much grows in two
    segments (stage_of), the second made at once after the first, so that the
    first batches need not wait for the whole; the pool is marked sized for the
    batch (served) after the second. A pool sized for the batch that is simply
    full of batches in flight falls back at once, as a fixed one does: never a
    deadlock.
    """

    def __init__(self, make: Callable[[int], _C.Arena], *, loader, depth: int, cap: int,
                 arena: Optional[_C.Arena] = None, capacity: Optional[int] = None):
        self.make = make
        self.loader, self.depth = loader, depth
        self.segments: list = []   # _C.Arena, newest first
        self.carried: list = []    # (fd, token) of each, newest first: what workers carry
        self.directory = None
        self.cap = cap
        self.capped = False
        self.refused: Optional[str] = None  # why the driver refused a segment (no more growth)
        self.tight: Optional[str] = None    # why the cgroup left no room for one
        self.warn_fallbacks = False  # install(): warn once of the first fallback (tell_fallbacks)
        self.warned = False
        self.lock = threading.Lock()
        if arena is None and capacity is not None:
            arena = make(capacity)
        if arena is not None:
            self.fixed = True
            self._add(arena)
            return
        self.fixed = False
        self.creator = os.getpid()
        dir_fd = os.memfd_create("fastpin-pool")
        os.ftruncate(dir_fd, _DIR_BYTES)
        self.view = mmap.mmap(dir_fd, _DIR_BYTES)
        self.wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.directory = (struct.unpack("<Q", os.urandom(8))[0], dir_fd, self.wake, self.creator)
        self.local: Optional[_Directory] = None  # collating here (num_workers=0)
        _pools[self.directory[0]] = self
        self._finalizer = weakref.finalize(self, _close_directory, self.creator, self.view,
                                           (dir_fd,), self.wake)
        self.thread = threading.Thread(target=_grower, name="fastpin-pool",
                                       args=(weakref.ref(self), self.view, dir_fd, self.wake),
                                       daemon=True)
        self.thread.start()

    def _add(self, arena: _C.Arena) -> None:
        register(arena)
        self.segments.insert(0, arena)
        self.carried.insert(0, (arena.fd, arena.token))

    def newest(self) -> Optional[_C.Arena]:
        return self.segments[0] if self.segments else None

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.segments)

    def grow(self) -> None:
        """Serve the workers' requests (the grower thread): add segments so the
        pool holds what capacity_for says for the largest block asked for (an
        empty pool: a first stage, then the rest)."""
        with self.lock:
            try:
                while self._grow_once():
                    pass
            finally:
                _set_word(self.view, _DIR_STAGE, 0)  # the rest is listed, or will not be

    def _grow_once(self) -> bool:
        """One segment towards what the workers asked for; True when it was a
        first stage (listed for the workers to use), the rest still to add."""
        view = self.view
        wanted, served = _word(view, _DIR_WANTED), _word(view, _DIR_SERVED)
        if wanted <= served or self.capped:
            return False
        have = self.capacity
        target = min(capacity_for(self.loader, wanted, self.depth), self.cap)
        add = target - have
        if add < wanted:   # no room for even one more such block under the cap
            add = wanted if have + wanted <= self.cap else 0
        add = min(_whole_2mib(add), self.cap - have) if add else 0
        add, last = stage_of(add, have, wanted, len(self.segments))
        # Within what the cgroup's limit leaves: registered, a segment is
        # resident at once, and past the limit the kernel kills a process
        # without a word. The next request looks again.
        room = memory_room()
        if room is not None and add > room:
            add = room // (2 * _MiB) * 2 * _MiB
            last = True  # no more now: served, and the next larger batch looks again
            if add < wanted:
                self.tight = (f"its cgroup's memory limit of {cgroup_memory_limit()} bytes "
                              f"leaves {room} bytes (after an eighth kept free)")
                _set_word(view, _DIR_LIMIT, _LIMIT_TIGHT)
                _set_word(view, _DIR_SERVED, wanted)  # no room now: workers fall back
                log.debug("fastpin: shared arena not grown for blocks of %d bytes: its "
                          "cgroup's memory limit leaves %d bytes", wanted, room)
                return False
        if add < wanted or len(self.segments) >= _MAX_SEGMENTS:
            self._cap_reached()
            return False
        try:
            arena = self.make(add)
        except (_C.FastpinError, OSError) as e:
            self.refused = str(e)
            _set_word(view, _DIR_LIMIT, _LIMIT_REFUSED)
            log.warning("fastpin zero-copy: could not add %d bytes to the shared "
                        "arena (%s); it stays at %d bytes, and batches that do not fit are "
                        "pinned by copy. %s", add, self.refused, have, REFUSED_ADVICE)
            self._cap_reached()
            return False
        self._add(arena)
        _set_word(view, _DIR_LIMIT, _LIMIT_NONE)
        # The entry, then the count, then served, in this order: a worker
        # reads served before the list, so a pool it finds served for its
        # batch lists the segment that was made for it.
        at = _DIR_ENTRIES + 24 * (len(self.segments) - 1)
        _set_word(view, at, arena.fd)
        _set_word(view, at + 8, arena.token)
        _set_word(view, at + 16, arena.capacity)
        if not last:
            _set_word(view, _DIR_STAGE, wanted)
        _set_word(view, _DIR_COUNT, len(self.segments))
        if last:
            _set_word(view, _DIR_SERVED, wanted)
        log.debug("fastpin: shared arena grown by %d bytes to %d for blocks of %d bytes%s",
                  add, have + add, wanted, "" if last else " (a first stage)")
        return not last

    def tell_fallbacks(self) -> None:
        """Once per pool that asks for it (install()'s: a Loader's warns on its
        own, Adopt.warn_full): the first batch a worker could not place, with
        the pool's size, what holds it and what to change."""
        if not self.warn_fallbacks or self.warned:
            return
        s = self.stats()
        if not s or not s["fallbacks"]:
            return
        self.warned = True
        if self.refused or self.tight:
            fix = advice_for(self)
        elif self.capped or self.capacity >= self.cap:
            fix = (f"it grows no further than its cap of {self.cap} bytes: raise it with "
                   "FASTPIN_ZERO_COPY_MAX_BYTES, or keep fewer batches alive")
        else:
            fix = ("it is sized for the batches in flight: keep fewer batches alive (each "
                   "one held keeps its block), or raise FASTPIN_ZERO_COPY_MAX_BYTES so that "
                   "it may grow past them")
        log.warning(
            "fastpin.install(): a DataLoader worker found the shared pool full (%d bytes in "
            "%d segments, %d held by batches alive or in flight: the workers' "
            "num_workers x prefetch_factor, the pin thread's and those the loop keeps) and "
            "collated a batch the ordinary way (through /dev/shm, pinned by copy; counted in "
            "fastpin.stats()['fallbacks']); %s", self.capacity, len(self.segments),
            s.get("bytes_in_use", 0), fix)

    def _cap_reached(self) -> None:
        self.capped = True
        _set_word(self.view, _DIR_SERVED, _CAPPED)

    def collect(self) -> None:
        for arena in self.segments:
            arena.collect()

    def reclaim(self) -> None:
        for arena in self.segments:
            arena.reclaim()

    def stats(self) -> Optional[dict]:
        """The segments' stats summed (capacity, high_water, fallbacks), or None
        before the first segment is made."""
        if not self.segments:
            if self.fixed or self.directory is None:
                return None
            return {"capacity": 0, "high_water": 0, "numa_node": -1,
                    "fallbacks": _word(self.view, _DIR_FALLBACKS)}
        per = [a.stats() for a in self.segments]
        out = dict(per[0])
        for key in ("capacity", "high_water", "fallbacks", "bytes_in_use"):
            out[key] = sum(p.get(key, 0) for p in per)
        if self.directory is not None:
            out["fallbacks"] += _word(self.view, _DIR_FALLBACKS)
        return out


# What helps when the driver refuses to page-lock more memory: a larger cap
# would not. Its usual cause is the locked-memory limit; else the machine's memory.
REFUSED_ADVICE = ("Raise the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK; a container's "
                  "--ulimit memlock=-1), or free memory on the machine")
TIGHT_ADVICE = ("Give the job more memory, or hold fewer batches at once (the DataLoader's "
                "num_workers x prefetch_factor, the Loader's depth, the batches the loop keeps)")


def advice_for(pool) -> str:
    """Why a pool that cannot grow cannot, and what would help (for warnings
    about its fallbacks), or "" where it simply reached its cap."""
    if pool.refused:
        return f"the driver refused to page-lock more ({pool.refused}). {REFUSED_ADVICE}"
    if pool.tight:
        return f"{pool.tight}. {TIGHT_ADVICE}"
    return ""


def fallbacks() -> int:
    """The batches workers could not place in the self-sizing pools this
    process made and still holds (install()'s and the Loaders'), for
    fastpin.stats(); a forked child's copies of its parent's are not its own."""
    pid = os.getpid()
    total = 0
    for pool in list(_pools.values()):
        if pool.creator == pid:
            s = pool.stats()
            total += s["fallbacks"] if s else 0
    return total


def _grower(pool_ref, view, dir_fd: int, wake: int) -> None:
    """The thread that adds segments when workers ask; it holds the pool only
    while it grows it, and closes the directory once the pool's finalizer has
    marked it closed. Only then: the pool's weak reference dies before its
    finalizer runs, and a thread that closed the view and descriptors on
    finding the pool gone would leave the finalizer writing to a closed view
    and to descriptor numbers another file may have taken by then."""
    _numa.name_this_thread("fastpin-pool")
    try:
        while True:
            select.select([wake], [], [], 1.0)
            try:
                asked = bool(os.eventfd_read(wake))
            except BlockingIOError:
                asked = False
            if _word(view, _DIR_CLOSED):
                return
            pool = pool_ref()
            if pool is None:
                continue  # its finalizer is about to mark the directory closed
            try:
                pool.collect()  # the fences workers may be waiting on (wait_for_frees)
                if asked:  # a stage only when a worker asks: as many as they need
                    pool.grow()
                pool.tell_fallbacks()
            except Exception:  # noqa: BLE001 - never crash; workers time out and fall back
                log.exception("fastpin: growing the shared arena failed")
            finally:
                _set_word(view, _DIR_COLLECTED, _word(view, _DIR_COLLECTED) + 1)
            del pool
    finally:
        view.close()
        os.close(dir_fd)
        os.close(wake)


