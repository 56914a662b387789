"""fastpin.install(): DataLoader(pin_memory=True) pins through fastpin."""
from __future__ import annotations

import threading

from . import _torch
from ._pin import pin_memory

_lock = threading.Lock()
_original = None


def _target():
    _torch.require("fastpin.install")
    from torch.utils.data._utils import pin_memory as module
    return module


def install() -> None:
    """Make every DataLoader with pin_memory=True pin through fastpin.pin_memory.

    DataLoader's pin thread (and its single-process path) look up
    torch.utils.data._utils.pin_memory.pin_memory at each batch, so loaders
    already made switch over too. Idempotent; undone by uninstall()."""
    global _original
    module = _target()
    with _lock:
        if _original is None:
            _original = module.pin_memory
            module.pin_memory = pin_memory


def uninstall() -> None:
    """Restore PyTorch's own pinning function."""
    global _original
    with _lock:
        if _original is not None:
            _target().pin_memory = _original
            _original = None


def installed() -> bool:
    return _original is not None
