"""Zero-copy collation: DataLoader workers write batches straight into a shared,
page-locked arena, and the main process takes the blocks over without copying.

The main process creates the arena (a memfd) and registers it with CUDA once,
before any worker starts. The workers run a _WorkerCollate (the DataLoader's
collate_fn wrapped) that carries the arena's identity (its token and file
descriptor: inherited under fork, passed as a descriptor under spawn and
forkserver), attaches the arena there (workers never touch CUDA), stacks the
samples directly into one block per batch, and returns a small _Shipped
descriptor. Unpickling it in the main process adopts the block: from then on
the main process owns it, and it is freed, after the GPU is done with it, when
the batch's tensors die.

The user's DataLoader is never changed. The Loader iterates a view of it
(dataloader_view: a shallow copy that shares its dataset, sampler and
generator, with the wrapped collate_fn and iterators of its own), so a plain
`for b in dl`, a second Loader, or a new Loader every epoch each see the
DataLoader as it was. The collate_fn a worker runs is fixed when the worker
starts: persistent workers keep theirs for their lifetime, so the view (which
holds them) and the arena they write into live as long as the Loader does.

The arena sizes itself unless the user gives its capacity (Pool): it starts
empty, and a worker whose batch finds no room the pool was not yet sized for
asks the main process for more, through a small shared directory; a thread
there adds a segment (another shared arena, registered once) so that the pool
holds capacity_for() that batch, never more than its cap, and the workers open
it. Workers started before the segment existed open it through the creator's
/proc/<pid>/fd; where that is refused, they fall back until the next epoch's
workers, which carry every segment.

A worker that finds the arena full falls back to the ordinary collate path
(the main process then pins by copy) and counts it; blocks of a worker that
died before its batch arrived are reclaimed at the end of the epoch.
"""
from __future__ import annotations

import logging
import mmap
import os
import select
import struct
import threading
import time
import weakref
from multiprocessing import reduction
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

from . import _C
from . import _leaves
from ._leaves import Plan, Stack, stackable
from ._runtime import process
from ._walk import flatten, map_leaves, unflatten

log = logging.getLogger("fastpin")

# This process's registries, held by _runtime (a forked child's are empty):
# the arenas it made whose blocks may arrive here, by token; in worker
# processes, the arenas attached there, by token.
_arenas = process.shared
_attached = process.attached

# Workers map the whole registered arena when they attach, rather than fault
# on each page of each block they first write (benchmarks/profile_zero_copy.py
# measures both).
PREFAULT = True


def _registry() -> "weakref.WeakValueDictionary[int, _C.Arena]":
    """The arenas this process registered (none of a parent's, after fork)."""
    return _arenas


def register(arena: _C.Arena) -> None:
    """Let blocks of `arena` shipped by workers be adopted in this process."""
    _registry()[arena.token] = arena


# ---- the worker side ---------------------------------------------------------

# Placeholder for a stacked tensor: the samples, stacked later into the block.
_Stack = Stack


def _stack_later(batch, *, collate_fn_map=None):
    if not stackable(batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return _Stack(batch)


_placeholder_map = {**default_collate_fn_map, torch.Tensor: _stack_later}


def _stack_now(tree):
    """The ordinary path for a tree of placeholders (the arena was full)."""
    return map_leaves(tree, lambda x: isinstance(x, _Stack),
                      lambda s: collate_tensor_fn(s.samples))


class _Ref:
    """Where a leaf lies in the block: its offset, its Layout (shape, strides,
    dtype: a torch dtype, or a NumPy dtype object, so structured dtypes keep
    their fields) and whether the tensor requires grad."""

    __slots__ = ("offset", "layout", "requires_grad")

    def __init__(self, offset, layout, requires_grad=False):
        self.offset, self.layout, self.requires_grad = offset, layout, requires_grad

    def __reduce__(self):
        return (_Ref, (self.offset, self.layout, self.requires_grad))


def _placeable(x) -> bool:
    """Whether a worker's leaf can travel in the block; the rest is pickled the
    ordinary way, unchanged: subclasses (masked arrays, memmaps, tensor
    subclasses), nested, sparse and quantized tensors, object arrays, and
    non-leaf tensors that require grad (which torch refuses to send)."""
    if type(x) is torch.Tensor:
        return not (x.requires_grad and x.grad_fn is not None)
    return type(x) is np.ndarray or type(x) is Stack


def _plan(tree):
    """One walk of `tree` (placeholders stacked in place) and where its leaves
    go in one block: (spec, leaves, plan). Workers never touch CUDA."""
    spec, leaves = flatten(tree, _placeable)
    return spec, leaves, Plan(leaves, keep_pinned=False)


def _pack(tree, arena: _C.Arena):
    """Copy every tensor/array leaf of `tree` (placeholders stacked in place) into
    one new block; returns (block, tree of _Ref). Raises ArenaFullError."""
    spec, leaves, plan = _plan(tree)
    block, _ = arena.pin(plan.sources, 1)
    plan.fill(block)
    refs = [x if layout is None else _Ref(offset, layout, getattr(x, "requires_grad", False))
            for x, layout, offset in zip(leaves, plan.layouts, plan.offsets)]
    return block, unflatten(spec, refs)


class _Shipped:
    """What crosses the result queue: the block and where each leaf lies in it."""

    __slots__ = ("token", "index", "nbytes", "tree", "block")

    def __init__(self, token, index, nbytes, tree, block=None):
        self.token, self.index, self.nbytes, self.tree = token, index, nbytes, tree
        self.block = block  # the worker's hold, given up once pickled

    def __reduce__(self):
        if self.block is not None:
            # From here the main process owns the block: the worker must not
            # free it when its Block object dies.
            self.block.detach()
            self.block = None
        return (_adopt, (self.token, self.index, self.nbytes, self.tree))

    def pin_memory(self):
        return self  # DataLoader's pin thread: already pinned


class Adopted:
    """A shipped batch in the main process, its block adopted."""

    __slots__ = ("block", "tree")

    def __init__(self, block, tree):
        self.block, self.tree = block, tree

    def pin_memory(self):
        return self


def _adopt(token, index, nbytes, tree):
    arena = _registry().get(token)
    if arena is None:
        raise RuntimeError(
            "fastpin: a batch arrived from a zero-copy worker, but its arena is not known in "
            "this process (unpickled outside the Loader that made it?)")
    return Adopted(arena.adopt(index, nbytes), tree)


def _attach(fd: int, token: int) -> _C.Arena:
    """The arena with this token in this process: its own, or attached by fd."""
    own = _registry().get(token)
    if own is not None:
        return own  # collating in the main process (num_workers=0)
    with process.lock:
        arena = _attached.get(token)
        if arena is None:
            arena = _C.Arena.attach(fd)
            if arena.token != token:
                raise RuntimeError("fastpin: the file descriptor does not hold the expected arena")
            if PREFAULT:
                arena.prefault()
            # A worker copies on its own thread: the DataLoader runs many.
            _C.set_threads(1)
            _attached[token] = arena
        return arena


# ---- the directory of a self-sizing pool ----------------------------------------
#
# A small shared memfd through which workers ask the main process for room and
# learn of the segments (shared arenas) it adds. Fields are 8-byte words; the
# main process writes a segment's entry before it raises `count`.
_DIR_COUNT, _DIR_SERVED, _DIR_WANTED, _DIR_CLOSED, _DIR_FALLBACKS = 0, 8, 16, 24, 32
_DIR_ENTRIES = 64           # then (fd in the creator, token, capacity) per segment
_MAX_SEGMENTS = 64
_DIR_BYTES = _DIR_ENTRIES + 24 * _MAX_SEGMENTS
_CAPPED = 1 << 62           # _DIR_SERVED once the pool can grow no more
# How long a worker waits for the main process to add a segment before it
# falls back: registering a few GB takes a second or two.
GROW_WAIT_S = 30.0


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

    def __init__(self, fd: int, wake: int, creator: int, carried: dict):
        self.map = mmap.mmap(fd, _DIR_BYTES)
        self.wake, self.creator, self.carried = wake, creator, carried
        self.seen = 0
        self.arenas: list = []   # newest first

    def refresh(self) -> None:
        count = min(_word(self.map, _DIR_COUNT), _MAX_SEGMENTS)
        while self.seen < count:
            at = _DIR_ENTRIES + 24 * self.seen
            fd, token = _word(self.map, at), _word(self.map, at + 8)
            own = _registry().get(token)
            if own is None and token in self.carried:
                own = _attach(self.carried[token], token)
            if own is None:
                try:
                    local = _open_segment(self.creator, fd)
                except OSError:
                    return  # not reachable from here: batches that need it fall back
                try:
                    own = _attach(local, token)
                finally:
                    os.close(local)
            self.arenas.insert(0, own)
            self.seen += 1

    def may_grow(self, need: int) -> bool:
        """Whether the main process has yet to size the pool for blocks of `need`."""
        return not _word(self.map, _DIR_CLOSED) and _word(self.map, _DIR_SERVED) < need

    def ask(self, need: int) -> bool:
        """Ask for room for blocks of `need` bytes; wait (bounded) for the answer.
        True when the pool grew (or was sized for `need`), so packing may succeed."""
        # Racy between workers (a plain read then write): a lost request is
        # made again by the next batch that finds no room.
        if _word(self.map, _DIR_WANTED) < need:
            _set_word(self.map, _DIR_WANTED, need)
        try:
            os.eventfd_write(self.wake, 1)
        except OSError:
            return False
        deadline = time.monotonic() + GROW_WAIT_S
        delay = 0.0005
        while time.monotonic() < deadline and not _word(self.map, _DIR_CLOSED):
            if _word(self.map, _DIR_SERVED) >= need:   # grown for it, or at the cap
                self.refresh()
                return True
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        return False

    def count_fallback(self) -> None:
        # Before the pool has a segment to count in; racy, so a lower bound.
        _set_word(self.map, _DIR_FALLBACKS, _word(self.map, _DIR_FALLBACKS) + 1)


_directories = process.directories   # pool id -> _Directory, in workers
_pools = process.pools               # pool id -> Pool, in the process that made it


class _WorkerCollate:
    """The collate_fn DataLoader workers run in zero-copy mode. It carries the
    identity of the arenas it writes into (file descriptor and token: `segments`,
    newest first, the pool's own list, so workers started later carry the
    segments added since) and, for a self-sizing pool, of its directory, through
    which a worker asks for room and finds the segments added while it runs."""

    def __init__(self, collate_fn: Optional[Callable], segments, directory=None):
        self.collate_fn = collate_fn  # None: default_collate
        self.segments = segments      # [(fd, token)], newest first
        self.directory = directory    # None, or (pool id, dir fd, wake fd, creator pid)

    def __reduce__(self):
        # spawn / forkserver: each memfd travels as a file descriptor.
        directory = None
        if self.directory is not None:
            pool, dir_fd, wake, creator = self.directory
            directory = (pool, reduction.DupFd(dir_fd), reduction.DupFd(wake), creator)
        return (_WorkerCollate._rebuild,
                (self.collate_fn, [(reduction.DupFd(fd), token) for fd, token in self.segments],
                 directory))

    @staticmethod
    def _rebuild(collate_fn, segments, directory):
        if directory is not None:
            pool, dir_fd, wake, creator = directory
            directory = (pool, dir_fd.detach(), wake.detach(), creator)
        return _WorkerCollate(collate_fn, [(dup.detach(), token) for dup, token in segments],
                              directory)

    def _arenas(self) -> tuple:
        """(the arenas to try, newest first; this pool's directory or None)."""
        if self.directory is None:
            return [_attach(fd, token) for fd, token in self.segments], None
        pool, dir_fd, wake, creator = self.directory
        if creator == os.getpid():
            # Collating in the main process (num_workers=0): the pool's own
            # view, which goes with the pool.
            own = _pools.get(pool)
            if own is None:
                return [], None
            if own.local is None:
                own.local = _Directory(dir_fd, wake, creator, {})
            directory = own.local
        else:
            directory = _directories.get(pool)
            if directory is None:
                carried = dict((token, fd) for fd, token in self.segments)
                directory = _directories[pool] = _Directory(dir_fd, wake, creator, carried)
        directory.refresh()
        return directory.arenas, directory

    def __call__(self, samples):
        if self.collate_fn is None:
            tree = collate(samples, collate_fn_map=_placeholder_map)
        else:
            tree = self.collate_fn(samples)
        arenas, directory = self._arenas()
        asked = False
        while True:
            for arena in arenas:
                try:
                    block, shipped = _pack(tree, arena)
                except _C.ArenaFullError:
                    continue
                return _Shipped(arena.token, block.index, block.nbytes, shipped, block)
            if directory is None or asked:
                break
            need = _C.block_size(max(_plan(tree)[2].nbytes, 1))
            if not directory.may_grow(need):
                break
            asked = True
            if not directory.ask(need):
                break
            arenas = directory.arenas
        if arenas:
            arenas[0].count_fallback()
        elif directory is not None:
            directory.count_fallback()
        return _stack_now(tree) if self.collate_fn is None else tree


def batches_ahead(loader) -> int:
    """Batches a DataLoader's workers hold at once (num_workers x prefetch_factor;
    one when it collates in this process)."""
    return (loader.prefetch_factor or 2) * loader.num_workers if loader.num_workers else 1


def capacity_for(loader, batch_bytes: int, depth: int) -> int:
    """Bytes of shared arena that zero-copy over `loader` needs for batches of
    `batch_bytes`: the workers' batches in flight, the Loader's depth, and 6 more
    (one being copied, copies queued on the bus, slack), each block its size class."""
    return _C.block_size(max(batch_bytes, 1)) * (batches_ahead(loader) + depth + 6)


def wrap_collate(collate_fn: Optional[Callable], pool: "Pool") -> _WorkerCollate:
    """The collate_fn for workers that write into `pool`'s segments."""
    if collate_fn is default_collate:
        collate_fn = None
    return _WorkerCollate(collate_fn, pool.carried, pool.directory)


_MiB = 1 << 20
_GiB = 1 << 30


def _memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def default_cap(registered: bool) -> int:
    """The most a self-sizing shared arena grows to, bytes: FASTPIN_ZERO_COPY_MAX_BYTES,
    else a quarter of the memory this process may use and, when the arena is
    page-locked, half of RLIMIT_MEMLOCK where that limit was set for it: finite
    and at least 2 GiB. The small defaults (64 KiB, 8 MiB) are ignored: the CUDA
    driver pins registered memory itself and does not charge it there (fastpin's
    1 GiB default arena is page-locked under them); should a registration be
    refused all the same, the arena stops growing and batches fall back."""
    value = os.environ.get("FASTPIN_ZERO_COPY_MAX_BYTES", "")
    if value:
        try:
            return max(int(value), 1)
        except ValueError:
            raise ValueError("FASTPIN_ZERO_COPY_MAX_BYTES must be an integer number of bytes, "
                             f"not {value!r}") from None
    cap = _memory_bytes() // 4
    if registered:
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            if soft != resource.RLIM_INFINITY and soft // 2 >= _GiB:
                cap = min(cap, soft // 2)
        except (ImportError, OSError, ValueError):
            pass
    return cap


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
    directory and waits (at most GROW_WAIT_S); a thread here adds a segment so
    that the pool holds capacity_for(loader, that batch, depth) in all, never
    more than `cap`, and workers open it (spawned before it existed: through
    /proc/<this pid>/fd). A pool sized for the batch that is simply full of
    batches in flight falls back at once, as a fixed one does: never a deadlock.
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
        """Serve the workers' requests (the grower thread): add a segment so the
        pool holds what capacity_for says for the largest block asked for."""
        view = self.view
        with self.lock:
            wanted, served = _word(view, _DIR_WANTED), _word(view, _DIR_SERVED)
            if wanted <= served or self.capped:
                return
            have = self.capacity
            target = min(wanted * (batches_ahead(self.loader) + self.depth + 6), self.cap)
            add = target - have
            if add < wanted:   # no room for even one more such block under the cap
                add = wanted if have + wanted <= self.cap else 0
            add = min(-(-add // (2 * _MiB)) * 2 * _MiB, self.cap - have) if add else 0
            if add < wanted or len(self.segments) >= _MAX_SEGMENTS:
                self._cap_reached()
                return
            try:
                arena = self.make(add)
            except (_C.FastpinError, OSError) as e:
                log.warning("fastpin.Loader(zero_copy=True): could not add %d bytes to the shared "
                            "arena (%s); it stays at %d bytes, and batches that do not fit are "
                            "pinned by copy", add, str(e), have)
                self._cap_reached()
                return
            self._add(arena)
            at = _DIR_ENTRIES + 24 * (len(self.segments) - 1)
            _set_word(view, at, arena.fd)
            _set_word(view, at + 8, arena.token)
            _set_word(view, at + 16, arena.capacity)
            _set_word(view, _DIR_COUNT, len(self.segments))
            _set_word(view, _DIR_SERVED, wanted)
            log.debug("fastpin: shared arena grown by %d bytes to %d for blocks of %d bytes",
                      add, have + add, wanted)

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


def _grower(pool_ref, view, dir_fd: int, wake: int) -> None:
    """The thread that adds segments when workers ask; it holds the pool only
    while it grows it, and closes the directory when the pool is gone."""
    try:
        while True:
            select.select([wake], [], [], 1.0)
            try:
                os.eventfd_read(wake)
            except BlockingIOError:
                pass
            if _word(view, _DIR_CLOSED):
                return
            pool = pool_ref()
            if pool is None:
                return
            try:
                pool.grow()
            except Exception:  # noqa: BLE001 - never crash; workers time out and fall back
                log.exception("fastpin: growing the shared arena failed")
            del pool
    finally:
        view.close()
        os.close(dir_fd)
        os.close(wake)


def dataloader_view(loader, collate_fn: Callable):
    """A shallow copy of DataLoader `loader` whose workers run `collate_fn`: it
    shares the dataset, sampler, generator and every other setting, and has
    iterators (and persistent workers) of its own. `loader` is not touched,
    so plain iteration of it, and other Loaders over it, see it as it was."""
    view = object.__new__(type(loader))
    # Straight into __dict__: DataLoader.__setattr__ refuses some attributes
    # once initialised, and a subclass may guard more.
    view.__dict__.update(vars(loader))
    view.__dict__["collate_fn"] = collate_fn
    view.__dict__["_iterator"] = None  # persistent workers: never the loader's own
    return view


# ---- the main process side ----------------------------------------------------

def _leaf_out(block, ref: _Ref):
    out = ref.layout.host(block, ref.offset)
    return out.requires_grad_() if ref.requires_grad else out


def adopted(batch: Any) -> Any:
    """The batch as the main process holds it: an Adopted for a batch a worker
    placed in the arena (also one collated here, num_workers=0), else as it came."""
    if isinstance(batch, _Shipped):  # collated in this process (num_workers=0)
        if batch.block is not None:
            batch.block.detach()  # handed over to the adopting Block below
        batch = _adopt(batch.token, batch.index, batch.nbytes, batch.tree)
    return batch


def receive(batch: Any, consumer_stream: Any = None) -> tuple:
    """For a batch as adopted() gives it: (batch with tensors over the adopted
    block, True), or (batch, False) for a batch that came the ordinary way (a
    worker fell back)."""
    if not isinstance(batch, Adopted):
        return batch, False
    block = batch.block
    if consumer_stream is not None:
        block.consumer_stream = consumer_stream
    return map_leaves(batch.tree, lambda x: isinstance(x, _Ref), lambda r: _leaf_out(block, r)), True


def device_views(batch: "Adopted", buffer: torch.Tensor) -> Optional[Any]:
    """The batch's tree with each leaf a view of `buffer`, a device tensor of the
    block's bytes that one copy fills; None when a leaf has a NumPy dtype torch
    does not know (the caller then takes the ordinary path, which says so)."""
    spec, refs = flatten(batch.tree, lambda x: isinstance(x, _Ref))
    views = _leaves.device_views([(r.offset, r.layout) for r in refs], buffer)
    if views is None:
        return None
    return unflatten(spec, [v.requires_grad_() if r.requires_grad else v
                            for v, r in zip(views, refs)])
