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
holds them) lives as long as the Loader does, and the arena they write into at
least as long: it is kept with the DataLoader, for the next Loader over it
(_loader._shared_pool), as install() keeps one per DataLoader.

fastpin.install() gives DataLoader iterators the same collate_fn (_install):
what their workers ship is adopted as it is unpickled, and handed on as the
pin thread's PinnedInWorkers, or as its views where no pin thread runs.

The arena sizes itself unless the user gives its capacity (_segments.Pool:
it starts empty and adds segments, shared arenas registered once, as the
workers ask for room through a small shared directory).

A worker that finds the arena full falls back to the ordinary collate path
(the main process then pins by copy) and counts it; blocks of a worker that
died before its batch arrived are reclaimed at the end of the epoch.
"""
from __future__ import annotations

import os
import time
from multiprocessing import reduction
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

from . import _C
from . import _leaves
from . import _pin
from . import _record
from ._adoption import (  # noqa: F401 - the main process's side, here by name for tests and tools
    DELIVER,
    PIN_THREAD,
    VIEWS,
    Adopted,
    PinnedInWorkers,
    _adopt,
    _adopt_installed,
    _Shipped,
    adopted,
    device_views,
    receive,
)
from ._segments import (  # noqa: F401 - the names the Loader, the bench and tests use here
    Pool,
    _arenas,
    _pools,
    _registry,
    advice_for,
    batches_ahead,
    capacity_for,
    default_cap,
    directory_for,
    FREE_WAIT_S,
    REFUSED_ADVICE,
    TIGHT_ADVICE,
    _DIR_LIMIT,
    _LIMIT_NONE,
    _LIMIT_REFUSED,
    _LIMIT_TIGHT,
    _Directory,
    _word,
    register,
)
from . import _arena
from ._leaves import Plan, Stack, stackable
from ._runtime import process
from ._walk import flatten, map_leaves

_MB = 1e6

# Worker processes: the arenas attached there, by token (_runtime empties it at fork).
_attached = process.attached

# Workers map the whole registered arena when they attach, rather than fault
# on each page of each block they first write (benchmarks/profile_zero_copy.py
# measures both).
PREFAULT = True


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


def _shareable(x) -> bool:
    return (type(x) is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided
            and not (x.is_nested or x.is_quantized or x.is_shared())
            and not (x.requires_grad and x.grad_fn is not None)
            and x.untyped_storage().nbytes() > 0)


def _to_shared(tree):
    """A worker's fallback batch, its tensors moved into shared memory (/dev/shm)
    here, as pickling them onto the result queue would: there, on the queue's
    own thread, a failure (a full /dev/shm) is only printed and the batch lost,
    and the main process waits for it until its timeout, or forever. Those
    default_collate stacked are there already; the user's collate_fn may give
    others. Tensors torch would refuse to send are left for it to refuse."""
    if get_worker_info() is None:
        return tree  # collated where it is used: nothing crosses a queue
    from torch.multiprocessing import get_sharing_strategy

    by_name = get_sharing_strategy() == "file_system"
    for leaf in flatten(tree, _shareable)[1]:
        if _shareable(leaf):  # two leaves may share a storage
            storage = leaf.untyped_storage()
            if by_name:
                storage._share_filename_cpu_()
            else:
                storage._share_fd_cpu_()
    return tree


# torch's words when it cannot make or fill a file in /dev/shm (MapAllocator).
_SHM_ERRORS = ("shared memory", "</torch_", "unable to write to file <", "unable to mmap")


def _shm_room() -> tuple:
    """(size, free bytes) of /dev/shm, or (None, None) where it cannot be read."""
    try:
        s = os.statvfs("/dev/shm")
    except OSError:
        return None, None
    return s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize


def _docker_size(nbytes: int) -> str:
    mib = -(-nbytes // (1 << 20))
    return f"{-(-mib // 1024)}g" if mib > 1024 else f"{mib}m"


def _no_shm_room(exc: RuntimeError, nbytes: int, pool: tuple) -> Optional[str]:
    """The message for a fallback batch of `nbytes` that torch could not place in
    /dev/shm (exc), naming both limits and their fixes; None where exc is
    another error. pool: the full pool's (facts, fixes, batches alive), from
    why_full."""
    text = str(exc)
    size, free = _shm_room()
    if not any(words in text for words in _SHM_ERRORS) or not (
            "No space left on device" in text or (free is not None and free < nbytes)):
        return None
    facts, fixes, alive = pool
    shm = ("its size could not be read" if size is None else
           f"/dev/shm is {size} bytes ({size / _MB:.1f} MB), {free} bytes free")
    return (
        f"fastpin: a DataLoader worker found fastpin's shared pool full and collated a batch "
        f"of {nbytes} bytes ({nbytes / _MB:.1f} MB) the ordinary way, through /dev/shm, "
        f"which had no room for it: {shm}. The shared pool: {facts}. Either limit is the "
        f"fix: give /dev/shm room for {alive} such batches (docker run "
        f"--shm-size={_docker_size(alive * nbytes)} or more; under Kubernetes, a "
        f"memory-backed emptyDir mounted on /dev/shm), or let the pool hold them: "
        f"{'; or '.join(fixes)}.")


def _placeable(x) -> bool:
    """Whether a worker's leaf can travel in the block; the rest is pickled the
    ordinary way, unchanged: subclasses (masked arrays, memmaps, tensor
    subclasses), nested, sparse and quantized tensors, object arrays, and
    non-leaf tensors that require grad (which torch refuses to send)."""
    if type(x) is torch.Tensor:
        return not (x.requires_grad and x.grad_fn is not None)
    return type(x) is np.ndarray or type(x) is Stack


def _pins_itself(x) -> bool:
    """install(): an object with its own pin_memory() (no tensor or array) is not
    walked into; it travels as it is, and the pin thread asks it to pin itself,
    as torch's does."""
    return not isinstance(x, (torch.Tensor, np.ndarray)) and _leaves.is_leaf(x)


def _placeable_or_self_pinning(x) -> bool:
    return _placeable(x) or _pins_itself(x)


def _plan(tree, is_leaf=_placeable):
    """One walk of `tree` (placeholders stacked in place) and where its leaves
    go in one block: (spec, leaves, plan). Workers never touch CUDA."""
    spec, leaves = flatten(tree, is_leaf)
    return spec, leaves, Plan(leaves, keep_pinned=False)


def _pack(tree, arena: _C.Arena, is_leaf=_placeable):
    """Copy every tensor/array leaf of `tree` (placeholders stacked in place) into
    one new block; returns (block, its layout record, the record's objects, the
    Slot tree or None, the batch's bytes: see _record.encode). Raises
    ArenaFullError."""
    spec, leaves, plan = _plan(tree, is_leaf)
    block, _ = arena.pin(plan.sources, 1)
    plan.fill(block)
    return (block, *_record.encode(spec, leaves, plan))


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
            # A worker copies on its own thread (the DataLoader runs many),
            # streaming from 4 MiB (_pin.WORKER_STREAM_MIN).
            _pin.worker_copies()
            _attached[token] = arena
        return arena


class _WorkerCollate:
    """The collate_fn DataLoader workers run in zero-copy mode. It carries the
    identity of the arenas it writes into (file descriptor and token: `segments`,
    newest first, the pool's own list, so workers started later carry the
    segments added since) and, for a self-sizing pool, of its directory, through
    which a worker asks for room and finds the segments added while it runs."""

    def __init__(self, collate_fn: Optional[Callable], segments, directory=None, ship=None,
                 limits=(0, 0)):
        self.collate_fn = collate_fn  # None: default_collate
        self.segments = segments      # [(fd, token)], newest first
        self.directory = directory    # None, or (pool id, dir fd, wake fd, creator pid)
        self.ship = ship              # None: for a Loader; install(): (pool id, handover)
        self.limits = limits          # (batches in flight and handed over, the pool's cap)
        self.is_leaf = _placeable if ship is None else _placeable_or_self_pinning
        self.placed = 0               # batches this worker placed in the pool

    def __reduce__(self):
        # spawn / forkserver: each memfd travels as a file descriptor.
        directory = None
        if self.directory is not None:
            pool, dir_fd, wake, creator = self.directory
            directory = (pool, reduction.DupFd(dir_fd), reduction.DupFd(wake), creator)
        return (_WorkerCollate._rebuild,
                (self.collate_fn, [(reduction.DupFd(fd), token) for fd, token in self.segments],
                 directory, self.ship, self.limits))

    @staticmethod
    def _rebuild(collate_fn, segments, directory, ship, limits):
        if directory is not None:
            pool, dir_fd, wake, creator = directory
            directory = (pool, dir_fd.detach(), wake.detach(), creator)
        return _WorkerCollate(collate_fn, [(dup.detach(), token) for dup, token in segments],
                              directory, ship, limits)

    def _arenas(self) -> tuple:
        """(the arenas to try, newest first; this pool's directory or None)."""
        if self.directory is None:
            return [_attach(fd, token) for fd, token in self.segments], None
        directory = directory_for(self.directory, self.segments, _attach)
        if directory is None:
            return [], None
        return directory.arenas, directory

    def __call__(self, samples):
        if self.collate_fn is None:
            tree = collate(samples, collate_fn_map=_placeholder_map)
        else:
            tree = self.collate_fn(samples)
        arenas, directory = self._arenas()
        asked, deadline, waits = False, None, 0
        while True:
            for arena in arenas if directory is None or self._in_turn(directory) else ():
                try:
                    block, *layout = _pack(tree, arena, self.is_leaf)
                except _C.ArenaFullError:
                    continue
                self.placed += 1
                return _Shipped(arena.token, block.index, block.nbytes, layout, block, self.ship)
            if directory is None:
                break
            need = _C.block_size(max(_plan(tree, self.is_leaf)[2].nbytes, 1))
            # Whether the pool is sized for `need` is read before the segment
            # list is read again (the main process lists a segment before it
            # marks the pool served): a pool another worker had grown since this
            # one last looked shows its new segments, which are tried first.
            grow = not asked and directory.may_grow(need)
            arenas = directory.refresh()
            if arenas:
                asked = False  # new room (a stage): should others take it, ask again
                continue
            if not grow or not directory.ask(need):
                # Sized for it and full: of blocks the GPU may still be reading
                # (wait for it, as the consumer would), else of batches in flight.
                if deadline is None:
                    deadline = time.monotonic() + FREE_WAIT_S
                if not directory.wait_for_frees(deadline, waits):
                    break
                waits += 1
                arenas = directory.arenas
                continue
            asked = True
        if directory is not None:
            directory.count_fallback()
            arenas = directory.arenas
        elif arenas:
            arenas[0].count_fallback()
        try:
            return _to_shared(_stack_now(tree) if self.collate_fn is None else tree)
        except RuntimeError as exc:
            message = self._no_shm_room(exc, tree, arenas, directory)
            if message is None:
                raise
            raise RuntimeError(message) from exc

    def _in_turn(self, directory) -> bool:
        """Whether this batch may take room now. While a first stage is the
        pool's only segment, it holds the loop's first batches in order: the
        DataLoader hands its workers their batches round robin, so this
        worker's k-th batch is the loop's (k x workers + id)-th, and one past
        the stage's blocks waits for the rest, which is being made (on the H100
        machine the video case's batch 1 came 4.6 s after batch 0: the stage's
        second block had gone to batch 5's worker)."""
        blocks = directory.stage_blocks()
        if blocks is None:
            return True
        info = get_worker_info()
        return info is None or self.placed * info.num_workers + info.id < blocks

    def _no_shm_room(self, exc: RuntimeError, tree, arenas: list, directory) -> Optional[str]:
        """The message for a fallback batch that found no room in /dev/shm
        either, or None (exc is about something else)."""
        plan = _plan(tree, self.is_leaf)[2]
        pool = why_full(arenas, directory, self.limits, _C.block_size(max(plan.nbytes, 1)),
                        loader=self.ship is None)
        return _no_shm_room(exc, plan.data_bytes, pool)


def shared_maker(index: int, node: Optional[int]) -> Callable[[int], _C.Arena]:
    """What a Pool makes its segments with: shared arenas registered with CUDA
    device `index` here (-1: no GPU, nothing registered), their pages on NUMA
    node `node` (None: where the kernel puts them)."""
    def make(nbytes: int) -> _C.Arena:
        return _arena.make_arena(nbytes, shared=True, device=max(index, 0), cuda=index >= 0,
                                 numa_node=node)

    return make


def wrap_collate(collate_fn: Optional[Callable], pool: "Pool",
                 ship: Optional[tuple] = None) -> _WorkerCollate:
    """The collate_fn for workers that write into `pool`'s segments. ship: None
    for a Loader (it adopts what arrives); for install(), (pool id, how the
    main process hands the batch on: VIEWS, PIN_THREAD, DELIVER): see
    _adopt_installed."""
    if collate_fn is default_collate:
        collate_fn = None
    # What a fallback's error says of the pool (why_full); a Pool
    # may be made without its DataLoader's shape (loader=None).
    ahead = pool.depth + (batches_ahead(pool.loader) if pool.loader is not None else 0)
    limits = (ahead, pool.capacity if pool.fixed else pool.cap)
    return _WorkerCollate(collate_fn, pool.carried, pool.directory, ship, limits)


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


def _held(arenas: list) -> tuple:
    """(capacity, blocks in use, their bytes, blocks freed but still read by the
    GPU) of a pool's segments, from their shared stats: every process's blocks."""
    stats = [a.stats() for a in arenas]
    return tuple(sum(s[key] for s in stats)
                 for key in ("capacity", "blocks_in_use", "bytes_in_use", "blocks_pending"))


def why_full(arenas: list, directory: "Optional[_Directory]", limits: tuple, block: int,
             loader: bool) -> tuple:
    """For a worker whose block of `block` bytes found no room in the pool of
    `arenas` (and `directory`, None for a fixed pool): (what holds the pool and
    what limits it, a sentence; what would let it hold the batch, a list of
    fixes; the batches alive at once, this one counted). limits: (the batches
    the DataLoader holds in flight and hands over, the pool's cap); loader: a
    fastpin.Loader's pool, else install()'s."""
    ahead, cap = limits
    capacity, blocks, held, pending = _held(arenas)
    kept = blocks - ahead
    facts = (f"{capacity} bytes in {len(arenas)} segment{'' if len(arenas) == 1 else 's'}, "
             f"{blocks} batches in it ({held} bytes)")
    if pending:
        facts += f", {pending} of them freed but still read by the GPU"
    facts += (f"; the DataLoader's batches in flight and the next ones handed over "
              f"account for up to {ahead}")
    fixes = []
    if kept > 0:
        facts += f", so the loop keeps about {kept} alive"
        fixes.append("keep fewer batches alive (each one held keeps its block)")
    alive = max(blocks, ahead) + 1
    room = block * alive
    limit = _LIMIT_NONE if directory is None else _word(directory.map, _DIR_LIMIT)
    if limit == _LIMIT_REFUSED:
        facts += "; it could not grow: the driver refused to page-lock more"
        fixes.append(REFUSED_ADVICE[0].lower() + REFUSED_ADVICE[1:])
    elif limit == _LIMIT_TIGHT:
        facts += "; it could not grow: its cgroup's memory limit leaves no room"
        fixes.append(TIGHT_ADVICE[0].lower() + TIGHT_ADVICE[1:])
    elif directory is None:
        facts += "; its capacity is fixed"
        fixes.append(f"give fastpin.Loader capacity={room} or more")
    elif capacity + block > cap:
        facts += f"; it is at its cap of {cap} bytes"
        knob = ("fastpin.Loader(max_capacity=...) (or FASTPIN_ZERO_COPY_MAX_BYTES where "
                "max_capacity is not given)" if loader else "FASTPIN_ZERO_COPY_MAX_BYTES")
        fixes.append(f"raise {knob} to {room} bytes or more")
    elif not fixes:
        facts += "; it is sized for the batches in flight"
        fixes.append("keep fewer batches alive (each one held keeps its block)")
    return facts, fixes, alive
