"""fastpin.install(): DataLoader(pin_memory=True) pins through fastpin."""
from __future__ import annotations

import threading

from . import _torch
from ._pin import pin_memory
from ._runtime import replaced

_lock = threading.Lock()


def _target():
    _torch.require("fastpin.install")
    from torch.utils.data._utils import pin_memory as module
    return module


def install() -> None:
    """Make every DataLoader with pin_memory=True pin through fastpin.pin_memory.

    DataLoader's pin thread (and its single-process path) look up
    torch.utils.data._utils.pin_memory.pin_memory at each batch, so loaders
    already made switch over too. Idempotent; undone by uninstall()."""
    module = _target()
    with _lock:
        if "pin_memory" not in replaced:
            replaced["pin_memory"] = module.pin_memory
            module.pin_memory = pin_memory


def uninstall() -> None:
    """Restore PyTorch's own pinning function."""
    with _lock:
        if "pin_memory" in replaced:
            _target().pin_memory = replaced.pop("pin_memory")


def installed() -> bool:
    return "pin_memory" in replaced
