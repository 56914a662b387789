"""fastpin: pinned-memory batches for PyTorch at the speed of the bus.

    import fastpin
    fastpin.install()                     # DataLoader(pin_memory=True): workers collate
                                          # into fastpin's shared pinned arena
    batch = fastpin.pin_memory(batch)     # same structure, leaves page-locked
"""
from __future__ import annotations

from . import _torch
from ._C import ArenaFullError, CudaError, FastpinError
from ._arena import (CudaStatus, configure, cuda_available, cuda_status, default_arena,
                     made_default_arena)
from ._install import install, installed, uninstall
from ._loader import Loader
from ._pin import pin_memory
from ._runtime import counters
from ._segments import fallbacks

__version__ = "0.1.0"

__all__ = [
    "ArenaFullError", "CudaError", "CudaStatus", "FastpinError", "Loader", "__version__", "collate",
    "configure", "cuda_available", "cuda_status", "default_arena", "install", "installed",
    "pin_memory", "stats", "uninstall",
]


def stats() -> dict:
    """Counters of fastpin.pin_memory / collate (batches, leaves, bytes, fallbacks)
    and of the current GPU's default arena (bytes in use, high-water, blocks per
    class, ...), or "arena": None before anything made it: reading stats
    page-locks nothing. fallbacks: every batch that went the ordinary way, also
    those DataLoader workers could not place in a zero-copy pool (install()'s and
    the Loaders' self-sizing pools still alive; worker_fallbacks: those alone)."""
    arena = made_default_arena()
    out = counters()
    out["worker_fallbacks"] = fallbacks()
    out["fallbacks"] += out["worker_fallbacks"]
    return {**out, "arena": None if arena is None else arena.stats()}


def __getattr__(name):
    # collate needs torch; import it only when asked for.
    if name == "collate":
        _torch.require("fastpin.collate")
        from ._collate import collate
        return collate
    raise AttributeError(f"module 'fastpin' has no attribute {name!r}")
