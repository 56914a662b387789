"""This machine: what a run reports about it (machine()) and the memory a case
may still take (available_memory, shm_free)."""
from __future__ import annotations

import importlib
import os
import platform
import time

import fastpin
from fastpin import _C, _runtime

from ._optional import torch

MB = 1 << 20  # sizes are MiB (and labelled so); rates are GB/s of 1e9 bytes


def meminfo_available(root: str = "/") -> int:
    """Bytes this process may still allocate: MemAvailable, capped by the room its
    own cgroup and every one above it leave (fastpin._runtime.memory_room, as
    fastpin sizes its own memory: a limit binds wherever it is set, not only at
    the cgroup mount's root). `root`: where /proc and the cgroup mounts are
    found (a fake tree, in tests)."""
    avail = None
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    room = _runtime.memory_room(root)
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail if avail is not None else 1 << 62


def available_memory() -> int:
    """meminfo_available() as the package names it, fastpin.bench._available_memory:
    tests replace that name to play a machine with little memory, so every
    memory check asks through it."""
    return importlib.import_module(__package__)._available_memory()


def shm_free() -> int:
    try:
        s = os.statvfs("/dev/shm")
        return s.f_bavail * s.f_frsize
    except OSError:
        return 1 << 62


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fastpin": fastpin.__version__,
        "cpus": _C.cpu_count(),
        "memory_available_gb": round(available_memory() / 1e9, 1),
        "cuda": fastpin.cuda_status()._asdict(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
