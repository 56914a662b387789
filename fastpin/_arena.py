"""The process's default arenas (one per GPU), and fastpin.configure() (the
settings themselves are _runtime's)."""
from __future__ import annotations

import logging
import re
import sys
from typing import Any, NamedTuple, Optional, Union

from . import _C, _numa
from ._grow import GrowingArena
from ._runtime import (
    MAX_CAPACITY,  # noqa: F401 - fastpin._arena.MAX_CAPACITY, as before
    ON_FULL,  # noqa: F401 - _pin imports it from here
    check_arena_bytes,
    check_bool,
    check_int,
    check_on_full,
    check_seconds,
    check_threads,
    cuda_available,
    machine_cap,
    process,
    settings,
)

log = logging.getLogger("fastpin")

# The default arenas of this process, by CUDA ordinal (-1: no usable GPU): each
# is registered in its own device's primary context and records its events
# there, so a batch read by GPU N is reused only after GPU N is done with it.
# Held by _runtime (a forked child's is empty).
_arenas = process.arenas

# Where no capacity is set, a default arena starts with a segment of this many
# bytes and grows to growth_cap() (see fastpin._grow).
START_BYTES = 64 << 20


def growth_cap(registered: bool) -> int:
    """The most a self-sizing default arena grows to: a quarter of the memory this
    process may use and, page-locked, half of RLIMIT_MEMLOCK where set (_runtime)."""
    return machine_cap(registered)


class CudaStatus(NamedTuple):
    """What fastpin found of CUDA: state is 'ready', 'no_device' or 'no_driver'.
    fence: how a freed block waits for the copies on every stream of its
    device before it is reused: "event" (cuCtxRecordEvent, CUDA 12.5 and
    later drivers), "sync" (older drivers: a thread synchronises the context
    when blocks wait), None without CUDA."""

    state: str
    reason: str
    driver_version: int
    device_count: int
    fence: Optional[str] = None


def cuda_status() -> CudaStatus:
    """The CUDA driver's state, with the reason when it is not usable."""
    s = _C.cuda_status()
    return CudaStatus(s["state"], s["reason"], s["driver_version"], s["device_count"],
                      s["fence"])


def configure(*, capacity: Union[int, str, None] = None, threads: Optional[int] = None,
              device: Any = None, on_full: Optional[str] = None,
              wait_timeout: Optional[float] = None,
              allow_unpinned: Optional[bool] = None, numa: Optional[bool] = None) -> None:
    """Set the default arenas' capacity: a number of bytes (or FASTPIN_ARENA_BYTES)
    makes each a fixed arena of that size; unset, or "auto", each sizes itself:
    it starts at 64 MiB and grows by page-locked segments as the live batches need,
    up to a cap of a quarter of the memory this process may use (the machine's, or
    its cgroup's limit) and half of RLIMIT_MEMLOCK where that is set. Also the copy
    pool's size (default: the CPUs this process may use, at most 16, or
    FASTPIN_THREADS) and the GPU that fastpin.pin_memory pins for when no device is
    named (default: the current one), named as fastpin.Loader names one: "cuda" (the
    current one), "cuda:N", N or a torch.device of type cuda, a GPU this machine has.
    Each GPU gets its own default arena, made on
    first use. A new capacity takes effect with new arenas; blocks of the old ones
    stay valid until their tensors die.

    numa (default True, or FASTPIN_NUMA=0 for False): on a machine of several NUMA
    nodes, put each GPU's arena in the memory of the GPU's node and run the copy
    threads on that node's CPUs (see fastpin._numa). Off also gives the copy
    threads their affinity back; arenas made before keep their placement.

    on_full (default "fallback", or FASTPIN_ON_FULL): what a batch does when the
    arena has no room for it (a self-sizing one: at its cap, or once the driver
    refused to page-lock more), or is bigger than the cap: "fallback" pins it the
    ordinary way (PyTorch's pinning) and counts it in stats()["fallbacks"]; "wait"
    waits up to wait_timeout seconds (default 10) for room, then raises
    ArenaFullError (a batch bigger than the cap raises at once); "raise" raises
    ArenaFullError at once. allow_unpinned (default False, or
    FASTPIN_ALLOW_UNPINNED=1): when the driver refuses to page-lock the arena,
    warn and go on with ordinary memory instead of raising.

    An argument left out, or None, keeps its current setting (capacity="auto",
    threads=0 and device="cuda" put back the defaults). Each FASTPIN_* variable
    takes the same values as its argument (FASTPIN_ARENA_BYTES=auto,
    FASTPIN_THREADS=0; a flag 1/0, true/false, yes/no or on/off)."""
    # Every value is checked before any is applied: a bad call changes nothing
    # (the environment's first: it is what the others override). Each check is
    # the one the setting's FASTPIN_* variable goes through (_runtime).
    settings.load()
    if on_full is not None:
        on_full = check_on_full(on_full)
    if wait_timeout is not None:
        wait_timeout = check_seconds("wait_timeout", wait_timeout)
    if allow_unpinned is not None:
        allow_unpinned = check_bool("allow_unpinned", allow_unpinned)
    if numa is not None:
        numa = check_bool("numa", numa)
    auto = isinstance(capacity, str) and capacity == "auto"
    if capacity is not None:
        capacity = check_arena_bytes(capacity)
    if threads is not None:
        threads = check_threads(threads)
    index = _check_device(device) if device is not None else None
    if on_full is not None:
        settings.on_full = on_full
    if wait_timeout is not None:
        settings.wait_timeout = wait_timeout
    if allow_unpinned is not None:
        settings.allow_unpinned = allow_unpinned
    with process.lock:
        if (capacity is not None or auto) and capacity != settings.capacity:
            settings.capacity = capacity
            _arenas.clear()
        if device is not None:
            settings.device = index
        if numa is not None and numa != settings.numa:
            _arenas.clear()
        _C.set_pin_default(None)  # pin_memory's next call finds the arena again
    if numa is not None:
        _numa.set_enabled(numa)
    if threads is not None:
        settings.threads = threads
        _C.set_threads(threads)


DEVICE_ALLOWED = ("a CUDA device ('cuda', 'cuda:N', an ordinal N >= 0 or a torch.device of "
                  "type cuda)")


def _check_device(device: Any) -> Optional[int]:
    """configure(device=...): the CUDA ordinal `device` names, or None for "cuda"
    (the current device, as when none is configured); it must be a GPU this
    machine has. torch need not be imported (then no torch.device exists)."""
    torch = sys.modules.get("torch")
    if isinstance(device, str) or (torch is not None and isinstance(device, torch.device)):
        name = re.fullmatch(r"cuda(?::([0-9]+))?", str(device))
        if name is None:
            raise ValueError(f"device must be {DEVICE_ALLOWED}, not {device!r}")
        index = int(name[1]) if name[1] is not None else None
    else:
        index = check_int("device", device, 0, None, DEVICE_ALLOWED)
    if not cuda_available():
        raise ValueError(f"device must be a CUDA device this machine has, not {device!r}: "
                         f"no usable CUDA GPU here ({cuda_status().reason})")
    count = cuda_status().device_count
    if index is not None and index >= count:
        raise ValueError(f"device must be a CUDA device from 0 to {count - 1} "
                         f"(this machine has {count}), not {device!r}")
    return index


def get_capacity() -> Optional[int]:
    """The configured capacity of a new default arena, bytes; None: it sizes itself."""
    return settings.capacity


def _current_device() -> int:
    """The GPU meant when none is named: configure(device=...), else torch's
    current device once torch has initialised CUDA, else 0."""
    device = settings.device
    if device is not None:
        return device
    # The device whose context is current in this thread (-1: none is). That
    # is torch's current device (its set_device makes it current, and
    # DataLoader's pin thread calls it first): one driver call, where torch's
    # own current_device() costs microseconds.
    device = _C.current_device()
    if device >= 0:
        return device
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def device_index(device: Any = None) -> int:
    """The CUDA ordinal `device` names: an int, "cuda:N", torch.device("cuda", N);
    "cuda" without an index is torch's current device (in DataLoader's pin thread,
    the device of the process that made the loader). None, "cpu" and other device
    types: the default GPU (_current_device). -1 where no GPU is usable: nothing
    is registered then, and one arena serves every name."""
    if not cuda_available():
        return -1
    if device is None:
        return _current_device()
    if isinstance(device, int):
        index = device
    else:
        kind, _, ordinal = str(device).partition(":")
        if kind != "cuda":
            return _current_device()
        if ordinal:
            index = int(ordinal)
        else:
            index = _C.current_device()  # as in _current_device
            if index < 0:
                torch = sys.modules.get("torch")
                index = (torch.cuda.current_device() if torch is not None
                         and torch.cuda.is_available() else _current_device())
    if index < 0:
        raise ValueError(f"not a CUDA device: {device!r}")
    return index


def policy() -> dict:
    """The full-arena policy: on_full, wait_timeout, allow_unpinned."""
    return settings.policy()


def _memlock_limit() -> str:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    except (ImportError, OSError, AttributeError):
        return "unknown"


def make_arena(capacity: int, **kwargs) -> _C.Arena:
    """A new arena, page-locked when a GPU is present. Where the driver refuses
    to page-lock it, the error names the size, the locked-memory limit and the
    fixes; with allow_unpinned, a warning and an arena of ordinary memory."""
    from . import _graphs

    _graphs.watch()  # before any block of a registered arena can be freed
    try:
        return _C.Arena(capacity, **kwargs)
    except _C.CudaError as e:
        message = (
            f"{e}. fastpin could not page-lock an arena of {capacity} bytes "
            f"(RLIMIT_MEMLOCK: {_memlock_limit()}). Lower the cap with "
            "fastpin.configure(capacity=...) or FASTPIN_ARENA_BYTES, raise the locked-memory "
            "limit (ulimit -l, or memlock in the container's limits), or allow unpinned "
            "memory with fastpin.configure(allow_unpinned=True) / FASTPIN_ALLOW_UNPINNED=1")
        if not settings.allow_unpinned:
            raise _C.CudaError(message) from None
        import warnings

        warnings.warn(message + "; going on with ordinary (pageable) memory",
                      RuntimeWarning, stacklevel=3)
        return _C.Arena(capacity, **kwargs, cuda=False)


def make_placed_arena(capacity: int, index: int, **kwargs) -> _C.Arena:
    """make_arena for CUDA device `index` (-1: none): registered in that device's
    primary context only, its pages on the device's NUMA node and the copy threads
    on the node's CPUs (fastpin._numa; nothing on a machine of one node)."""
    where = _numa.for_device(index if index >= 0 else None)
    if index >= 0:
        kwargs["device"] = index
    arena = make_arena(capacity, numa_node=where.node, **kwargs)
    if where:
        bound = arena.stats()["numa_node"]
        if bound != where.node:
            log.warning("fastpin: the kernel refused to place the arena of CUDA device %d on "
                        "NUMA node %d (mbind failed: not permitted here?); its memory goes "
                        "where the kernel puts it", index, where.node)
        _numa.pin_threads(where)
    return arena


def made_default_arena(device: Any = None) -> Union[_C.Arena, GrowingArena, None]:
    """The default arena of `device` if this process has made it, else None:
    unlike default_arena(), it makes (and page-locks) nothing."""
    if device is None and settings.device is None:
        index = _C.current_device()  # pin_memory's common case: one driver call
        if index >= 0:
            return _arenas.get(index)
    return _arenas.get(device_index(device))


def default_arena(device: Any = None) -> Union[_C.Arena, GrowingArena]:
    """The arena fastpin.pin_memory uses for `device` (see device_index: None is
    the current GPU), made (and page-locked) on first use: with a capacity set, a
    fixed _C.Arena of that size; unset, a GrowingArena (fastpin._grow) of
    START_BYTES that grows to growth_cap(). Each GPU has its own, registered in
    that GPU's primary context and no other. A forked child gets fresh ones: the
    parent's registration does not cross fork."""
    index = device_index(device)
    arena = _arenas.get(index)
    if arena is not None:
        return arena
    with process.lock:
        arena = _arenas.get(index)
        if arena is None:
            capacity = settings.capacity
            if capacity is None:
                arena = growing_arena(index)
            else:
                arena = make_placed_arena(capacity, index)
            _arenas[index] = arena
            torch = sys.modules.get("torch")
            if arena.registered and torch is not None:
                # torch answers is_pinned() False until its own CUDA state is
                # initialised. This makes no context: the arena's device has its
                # primary context already, and torch's pointer queries use it.
                torch.cuda.init()
            log.debug("fastpin: arena of %d bytes (%s) for device %d, %s", arena.capacity,
                      "fixed" if capacity else f"growing to {arena.cap}", index,
                      "page-locked" if arena.registered else "not page-locked (no GPU)")
        return arena


def growing_arena(index: int) -> GrowingArena:
    """A self-sizing arena for CUDA device `index` (-1: none): START_BYTES, growing
    to growth_cap(); default_arena's, or one of its own (the benchmark's paths)."""
    return GrowingArena(lambda nbytes: make_placed_arena(nbytes, index), START_BYTES,
                        growth_cap(cuda_available()))


def as_core_arena(arena: Union[_C.Arena, GrowingArena]) -> _C.Arena:
    """The _C.Arena that C entry points taking one (h2d) get: a growing arena's newest
    segment (every segment is of the same device)."""
    return arena.newest if isinstance(arena, GrowingArena) else arena
