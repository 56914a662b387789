"""fastpin's process-wide state, in one place.

    settings    the configuration: fastpin.configure() over the FASTPIN_*
                environment (capacity, threads, device, on_full, wait_timeout,
                allow_unpinned, numa, streaming, zero_copy, install_device)
    process     what belongs to this process alone: its default arenas, the
                shared arenas it made or attached, where it pinned the copy
                threads, its running Loader threads, whether CUDA is usable
    counts      fastpin.stats()'s counters of pin_memory and collate; the
                warnings given once; what fastpin.install() replaced

Importing fastpin checks every FASTPIN_* variable it reads (a bad value fails
the import, with the variable's name and what it may be), registers a fork
hook (here) and an exit hook (_loader), and does nothing else: the settings
are read from the environment again, and applied (the copy pool sized), when
the configuration is first used (the first pin, arena or configure() call).
A forked child starts with `process` empty (os.register_at_fork): the
parent's arenas are registered in the parent's CUDA context, its threads do
not exist in the child. Its settings, counts and warnings are the parent's,
as the rest of its memory is.

Other modules name the registries they use (`_arenas = process.arenas`): the
registries are cleared in place, never replaced; locks are read from
`process` at each use, as a child gets new ones.
"""
from __future__ import annotations

import math
import numbers
import operator
import os
import threading
import weakref
from typing import Any, Optional

from . import _C

# The largest arena the core can carve (FP_MAX_CAPACITY in csrc/fastpin.h).
MAX_CAPACITY = _C.MAX_CAPACITY
MAX_THREADS = 1024  # fp_set_threads' bound
ON_FULL = ("fallback", "wait", "raise")
CAPACITY_ALLOWED = f"a number of bytes from 1 to {MAX_CAPACITY} (2**43)"


# ---- checks of a setting, where it is given ---------------------------------------

def check_int(name: str, value: Any, lo: int, hi: Optional[int], allowed: str) -> int:
    """`value` as an int in [lo, hi] (hi None: no bound); the error names the
    setting and what it may be. bool is refused (True is not a size)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {allowed}, not {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, {allowed}, not {type(value).__name__} "
                        f"{value!r}") from None
    if number < lo or (hi is not None and number > hi):
        raise ValueError(f"{name} must be {allowed}, not {number}")
    return number


def check_capacity(value: Any, name: str = "capacity") -> int:
    """An arena cap in bytes: an int from 1 to MAX_CAPACITY (2**43)."""
    return check_int(name, value, 1, MAX_CAPACITY, CAPACITY_ALLOWED)


def check_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, not {value!r}")


def check_seconds(name: str, value: Any) -> float:
    """A finite number of seconds >= 0 (nan and inf refused: a wait must end)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds (finite, >= 0), not {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    return seconds


# ---- the environment -----------------------------------------------------------------

def env_int(name: str, default: Optional[int], lo: int, hi: Optional[int],
            allowed: str) -> Optional[int]:
    """An integer environment variable, checked like the setting it names (hi
    None: no bound)."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r}: must be {allowed}") from None
    if number < lo or (hi is not None and number > hi):
        raise ValueError(f"{name}={value!r}: must be {allowed}")
    return number


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: must be 1 or 0 (or true/false, yes/no, on/off)")


def env_choice(name: str, default: str, choices: tuple) -> str:
    value = os.environ.get(name, default).strip() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(choices)}")
    return value


def env_exact(name: str, words: tuple, allowed: str) -> None:
    """A variable the C core reads as written (no spaces, no other words): one of `words`."""
    value = os.environ.get(name, "")
    if value not in words:
        raise ValueError(f"{name}={value!r}: must be {allowed}")


def env_cuda_device(name: str) -> Optional[str]:
    """A CUDA device named in the environment: "cuda" or "cuda:N" (unset or
    empty: None)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    kind, colon, index = value.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"{name}={value!r}: must be cuda (the current GPU) or cuda:N")
    return value


SYSFS_ROOT_ENV = "FASTPIN_SYSFS_ROOT"  # where _numa reads the topology (tests give a fake tree)


def zero_copy_max_bytes() -> Optional[int]:
    """FASTPIN_ZERO_COPY_MAX_BYTES: the cap of a self-sizing shared arena, or None."""
    return env_int("FASTPIN_ZERO_COPY_MAX_BYTES", None, 1, None,
                   "a number of bytes >= 1 (the most a self-sizing shared arena grows to)")


def read_environment() -> dict:
    """The settings the FASTPIN_* environment gives (defaults where unset), checked."""
    return {
        # None: the default arenas size themselves (fastpin._grow).
        "capacity": env_int("FASTPIN_ARENA_BYTES", None, 1, MAX_CAPACITY, CAPACITY_ALLOWED),
        "threads": env_int("FASTPIN_THREADS", None, 1, MAX_THREADS,
                           f"a number of copy threads from 1 to {MAX_THREADS} (unset: "
                           "the CPUs this process may use, at most 16)"),
        "device": None,  # None: the current GPU (see _arena.device_index)
        "on_full": env_choice("FASTPIN_ON_FULL", "fallback", ON_FULL),
        "wait_timeout": 10.0,
        "allow_unpinned": env_flag("FASTPIN_ALLOW_UNPINNED", False),
        "numa": env_flag("FASTPIN_NUMA", True),
        "streaming": env_flag("FASTPIN_STREAMING", True),
        # install() and Loader(dl) collate in the workers (zero-copy) by default.
        "zero_copy": env_flag("FASTPIN_ZERO_COPY", True),
        # install() without a device: None (batches pinned on the host), or
        # "cuda" / "cuda:N" (batches delivered there).
        "install_device": env_cuda_device("FASTPIN_INSTALL_DEVICE"),
    }


def check_environment() -> None:
    """At import: every FASTPIN_* variable fastpin reads, the settings' and
    those read where they are used (here, in _segments, _numa and the C core's
    cuda.c), checked; the first bad one raises ValueError."""
    read_environment()
    zero_copy_max_bytes()
    env_exact("FASTPIN_DISABLE_CUDA", ("", "0", "1"), "1 (never load the CUDA driver) or 0")
    env_exact("FASTPIN_FENCE", ("", "event", "sync"), "one of event, sync (unset: event "
              "where the driver has cuCtxRecordEvent)")
    root = os.environ.get(SYSFS_ROOT_ENV)
    if root and not os.path.isdir(root):
        raise ValueError(f"{SYSFS_ROOT_ENV}={root!r}: must be a directory holding a sysfs tree "
                         "(unset: /sys)")


class Settings:
    """fastpin's configuration. Its fields are read from the environment on
    the first read of any (load): until then the object holds none, and
    __getattr__ loads them; from then on they are plain attributes."""

    FIELDS = ("capacity", "threads", "device", "on_full", "wait_timeout", "allow_unpinned",
              "numa", "streaming", "zero_copy", "install_device")

    def __getattr__(self, name: str):
        if name not in Settings.FIELDS:
            raise AttributeError(name)
        self.load()
        return self.__dict__[name]

    def __setattr__(self, name: str, value: Any) -> None:
        # configure(): what it sets overrides the environment, read first.
        if name not in Settings.FIELDS:
            raise AttributeError(f"no setting {name!r}")
        self.load()
        self.__dict__[name] = value

    def load(self) -> None:
        """Read the FASTPIN_* environment (once; a bad value raises, and is read
        again at the next use). FASTPIN_THREADS sizes the copy pool here, before
        fastpin starts it, and FASTPIN_STREAMING=0 turns its streaming stores off."""
        with _settings_lock:
            if "_loaded" in self.__dict__:
                return
            fields = read_environment()
            if fields["threads"] is not None:
                _C.set_threads(fields["threads"])
            _C.set_streaming(fields["streaming"])
            self.__dict__.update(fields, _loaded=True)

    def policy(self) -> dict:
        """The full-arena policy: on_full, wait_timeout, allow_unpinned."""
        return {"on_full": self.on_full, "wait_timeout": self.wait_timeout,
                "allow_unpinned": self.allow_unpinned}


_settings_lock = threading.Lock()
settings = Settings()
check_environment()


# ---- this process ----------------------------------------------------------------------

class Process:
    """What belongs to this process alone; a forked child empties it (reset)."""

    def __init__(self):
        self.arenas: dict = {}  # CUDA ordinal -> default arena made here (-1: no usable GPU)
        # Shared arenas this process made, whose blocks workers may ship here, by token.
        self.shared: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self.attached: dict = {}     # token -> shared arena attached here (zero-copy workers)
        self.directories: dict = {}  # pool id -> a worker's view of a pool's directory
        self.pools: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self.pinned: dict = {}       # NUMA node -> the CPUs the copy pool is pinned to for it
        self.producers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # Loader threads running
        # install(): DataLoader -> (CUDA ordinal, the zero-copy Pool of its
        # iterators, their delivery Stats).
        self.installed_pools: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()
        self.reset()

    def reset(self) -> None:
        for registry in (self.arenas, self.shared, self.attached, self.directories, self.pools,
                         self.pinned, self.producers, self.installed_pools):
            registry.clear()
        self.cuda_ready: Optional[bool] = None  # _C.cuda_status() says "ready"; asked once
        self.exiting = False  # the interpreter is exiting: Loader threads stop, none joined
        # Guards the registries and the settings that empty them; a child gets a
        # new one (another thread may have held the parent's at fork).
        self.lock = threading.RLock()


process = Process()


def _after_fork_in_child() -> None:
    global _settings_lock, _counts_lock
    process.reset()
    _settings_lock = threading.Lock()
    _counts_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def cuda_available() -> bool:
    """True when the driver is loaded and a device is visible: memory is then
    page-locked. Asked once in each process (the driver's state does not change)."""
    ready = process.cuda_ready
    if ready is None:
        ready = process.cuda_ready = _C.cuda_status()["state"] == "ready"
    return ready


# ---- counters and warnings -----------------------------------------------------------

counts = {"batches": 0, "leaves": 0, "bytes": 0, "fallbacks": 0}
_counts_lock = threading.Lock()
warned: set = set()  # what fastpin has said once (each warning is worth one line)
replaced: dict = {}  # torch's functions that fastpin.install() replaced, by name


def count(batches: int = 0, leaves: int = 0, nbytes: int = 0, fallbacks: int = 0) -> None:
    with _counts_lock:
        counts["batches"] += batches
        counts["leaves"] += leaves
        counts["bytes"] += nbytes
        counts["fallbacks"] += fallbacks


def counters() -> dict:
    """What pin_memory and collate did in this process: the Python pipeline's
    counts plus those of pin_memory's C fast path (Arena.pin_batch)."""
    with _counts_lock:
        out = dict(counts)
    batches, leaves, nbytes = _C.pin_counts()
    out["batches"] += batches
    out["leaves"] += leaves
    out["bytes"] += nbytes
    return out


def first(what: str) -> bool:
    """True the first time `what` is asked for: a warning given once."""
    if what in warned:
        return False
    warned.add(what)
    return True
