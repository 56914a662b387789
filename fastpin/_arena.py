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
_arena: Optional[_C.Arena] = None
_arena_pid = 0
_C.set_threads(_env_int("FASTPIN_THREADS", 0))


def configure(*, capacity: Optional[int] = None, threads: Optional[int] = None,
              device: Optional[int] = None) -> None:
    """Set the default arena's cap in bytes (default 1 GiB, or FASTPIN_ARENA_BYTES),
    the copy pool's size (default: the CPUs this process may use, at most 16, or
    FASTPIN_THREADS) and the GPU whose stream orders frees (default: the current
    one). A new cap or device takes effect with a new arena; blocks of the old one
    stay valid until their tensors die."""
    global _capacity, _device, _arena
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


def _current_device() -> int:
    if _device is not None:
        return _device
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def default_arena() -> _C.Arena:
    """The arena fastpin.pin_memory uses, made (and page-locked) on first use.
    A forked child gets a fresh one: the parent's registration does not cross fork."""
    global _arena, _arena_pid
    arena = _arena
    if arena is not None and _arena_pid == os.getpid():
        return arena
    with _lock:
        if _arena is None or _arena_pid != os.getpid():
            _arena = _C.Arena(_capacity, device=_current_device())
            _arena_pid = os.getpid()
            torch = sys.modules.get("torch")
            if _arena.registered and torch is not None:
                # torch answers is_pinned() False until its own CUDA state is
                # initialised; the primary context exists already, so this is cheap.
                torch.cuda.init()
            log.debug("fastpin: arena of %d bytes, %s", _capacity,
                      "page-locked" if _arena.registered else "not page-locked (no GPU)")
        return _arena
