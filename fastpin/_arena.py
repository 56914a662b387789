"""The process's default arena and fastpin's configuration."""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NamedTuple, Optional

from . import _C

log = logging.getLogger("fastpin")

_GiB = 1 << 30


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of bytes/threads, not {value!r}") from None


class CudaStatus(NamedTuple):
    """What fastpin found of CUDA: state is 'ready', 'no_device' or 'no_driver'."""

    state: str
    reason: str
    driver_version: int
    device_count: int


def cuda_status() -> CudaStatus:
    """The CUDA driver's state, with the reason when it is not usable."""
    s = _C.cuda_status()
    return CudaStatus(s["state"], s["reason"], s["driver_version"], s["device_count"])


def cuda_available() -> bool:
    """True when the driver is loaded and a device is visible: memory is then page-locked."""
    return _C.cuda_status()["state"] == "ready"


_lock = threading.Lock()
_capacity = _env_int("FASTPIN_ARENA_BYTES", _GiB)
_device: Optional[int] = None
ON_FULL = ("fallback", "wait", "raise")
_policy = {"on_full": os.environ.get("FASTPIN_ON_FULL", "fallback"), "wait_timeout": 10.0,
           "allow_unpinned": os.environ.get("FASTPIN_ALLOW_UNPINNED", "0") not in ("", "0")}
if _policy["on_full"] not in ON_FULL:
    raise ValueError(f"FASTPIN_ON_FULL must be one of {ON_FULL}, not {_policy['on_full']!r}")
_arena: Optional[_C.Arena] = None
_arena_pid = 0
_C.set_threads(_env_int("FASTPIN_THREADS", 0))


def configure(*, capacity: Optional[int] = None, threads: Optional[int] = None,
              device: Optional[int] = None, on_full: Optional[str] = None,
              wait_timeout: Optional[float] = None,
              allow_unpinned: Optional[bool] = None) -> None:
    """Set the default arena's cap in bytes (default 1 GiB, or FASTPIN_ARENA_BYTES),
    the copy pool's size (default: the CPUs this process may use, at most 16, or
    FASTPIN_THREADS) and the GPU whose stream orders frees (default: the current
    one). A new cap or device takes effect with a new arena; blocks of the old one
    stay valid until their tensors die.

    on_full (default "fallback", or FASTPIN_ON_FULL): what a batch does when the
    arena has no room for it, or is bigger than the cap: "fallback" pins it the
    ordinary way (PyTorch's pinning) and counts it in stats()["fallbacks"]; "wait"
    waits up to wait_timeout seconds (default 10) for room, then raises
    ArenaFullError (a batch bigger than the cap raises at once); "raise" raises
    ArenaFullError at once. allow_unpinned (default False, or
    FASTPIN_ALLOW_UNPINNED=1): when the driver refuses to page-lock the arena,
    warn and go on with ordinary memory instead of raising."""
    global _capacity, _device, _arena
    if on_full is not None:
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, not {on_full!r}")
        _policy["on_full"] = on_full
    if wait_timeout is not None:
        if wait_timeout < 0:
            raise ValueError(f"wait_timeout must be >= 0, not {wait_timeout}")
        _policy["wait_timeout"] = float(wait_timeout)
    if allow_unpinned is not None:
        _policy["allow_unpinned"] = bool(allow_unpinned)
    with _lock:
        if capacity is not None:
            if capacity <= 0:
                raise ValueError(f"capacity must be positive, not {capacity}")
            if capacity != _capacity:
                _capacity, _arena = capacity, None
        if device is not None and device != _device:
            _device, _arena = device, None
    if threads is not None:
        _C.set_threads(threads)


def get_capacity() -> int:
    """The configured cap of a new arena, bytes."""
    return _capacity


def _current_device() -> int:
    if _device is not None:
        return _device
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def policy() -> dict:
    """The full-arena policy: on_full, wait_timeout, allow_unpinned."""
    return dict(_policy)


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
    try:
        return _C.Arena(capacity, **kwargs)
    except _C.CudaError as e:
        message = (
            f"{e}. fastpin could not page-lock an arena of {capacity} bytes "
            f"(RLIMIT_MEMLOCK: {_memlock_limit()}). Lower the cap with "
            "fastpin.configure(capacity=...) or FASTPIN_ARENA_BYTES, raise the locked-memory "
            "limit (ulimit -l, or memlock in the container's limits), or allow unpinned "
            "memory with fastpin.configure(allow_unpinned=True) / FASTPIN_ALLOW_UNPINNED=1")
        if not _policy["allow_unpinned"]:
            raise _C.CudaError(message) from None
        import warnings

        warnings.warn(message + "; going on with ordinary (pageable) memory",
                      RuntimeWarning, stacklevel=3)
        return _C.Arena(capacity, **kwargs, cuda=False)


def default_arena() -> _C.Arena:
    """The arena fastpin.pin_memory uses, made (and page-locked) on first use.
    A forked child gets a fresh one: the parent's registration does not cross fork."""
    global _arena, _arena_pid
    arena = _arena
    if arena is not None and _arena_pid == os.getpid():
        return arena
    with _lock:
        if _arena is None or _arena_pid != os.getpid():
            _arena = make_arena(_capacity, device=_current_device())
            _arena_pid = os.getpid()
            torch = sys.modules.get("torch")
            if _arena.registered and torch is not None:
                # torch answers is_pinned() False until its own CUDA state is
                # initialised; the primary context exists already, so this is cheap.
                torch.cuda.init()
            log.debug("fastpin: arena of %d bytes, %s", _capacity,
                      "page-locked" if _arena.registered else "not page-locked (no GPU)")
        return _arena
