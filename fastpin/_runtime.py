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

import dataclasses
import math
import numbers
import operator
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional

from . import _C

# The largest arena the core can carve (FP_MAX_CAPACITY in csrc/fastpin.h).
MAX_CAPACITY = _C.MAX_CAPACITY
MAX_THREADS = 1024  # fp_set_threads' bound
ON_FULL = ("fallback", "wait", "raise")
CAPACITY_ALLOWED = f"a number of bytes from 1 to {MAX_CAPACITY} (2**43)"


# ---- the settings: one check each, for configure() and the environment alike ----------
#
# Each setting has one check, which takes the value as configure() is given it
# and returns the setting (or raises TypeError/ValueError naming the setting and
# what it may be). The environment's text goes through the setting's from_text
# (an integer literal to an int, a flag's word to a bool) and then that same
# check, so both take the same values.

THREADS_ALLOWED = (f"a number of copy threads from 0 (the default: the CPUs this process may "
                   f"use, at most 16) to {MAX_THREADS}")
FLAG_ALLOWED = "1 or 0 (or true/false, yes/no, on/off)"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


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


def check_arena_bytes(value: Any) -> Optional[int]:
    """configure(capacity=...) / FASTPIN_ARENA_BYTES: a cap in bytes, or "auto"
    (None: the default arenas size themselves)."""
    if isinstance(value, str) and value == "auto":
        return None
    return check_capacity(value)


def check_threads(value: Any) -> int:
    """configure(threads=...) / FASTPIN_THREADS: the copy pool's size, 0 its default."""
    return check_int("threads", value, 0, MAX_THREADS, THREADS_ALLOWED)


def check_on_full(value: Any) -> str:
    if not isinstance(value, str) or value not in ON_FULL:
        raise ValueError(f"on_full must be one of {', '.join(map(repr, ON_FULL))}, "
                         f"not {value!r}")
    return value


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


def int_text(text: str) -> Any:
    """The environment's integer: an int where the text is one, else the text
    (which the setting's check then refuses)."""
    word = text.strip()
    try:
        return int(word)
    except ValueError:
        return word


def flag_text(text: str) -> Any:
    """A flag's word, any case: True for 1/true/yes/on, False for 0/false/no/off,
    else the text (which check_bool refuses)."""
    word = text.strip().lower()
    return True if word in _TRUE else False if word in _FALSE else text


@dataclasses.dataclass(frozen=True)
class Setting:
    """A setting read from the environment: its variable, its check, and how its
    text becomes what the check takes."""

    name: str                                    # the field of Settings (configure()'s argument)
    env: str                                     # its FASTPIN_* variable
    check: Callable[[Any], Any]                  # configure()'s check of a value
    from_text: Callable[[str], Any]              # the variable's text -> what check takes
    allowed: str                                 # what the variable may be, for its error
    default: Any = None                          # unset (or empty)

    def read(self) -> Any:
        """The setting the environment gives, checked; the error names the variable."""
        text = os.environ.get(self.env)
        if text is None or text.strip() == "":
            return self.default
        try:
            return self.check(self.from_text(text))
        except (TypeError, ValueError):
            raise ValueError(f"{self.env}={text!r}: must be {self.allowed}") from None


def _flag(name: str, env: str, default: bool) -> Setting:
    return Setting(name, env, lambda value: check_bool(name, value), flag_text, FLAG_ALLOWED,
                   default)


ENVIRONMENT = (
    # None: the default arenas size themselves (fastpin._grow).
    Setting("capacity", "FASTPIN_ARENA_BYTES", check_arena_bytes, int_text,
            CAPACITY_ALLOWED + ", or auto (the arenas size themselves)"),
    Setting("threads", "FASTPIN_THREADS", check_threads, int_text, THREADS_ALLOWED),
    Setting("on_full", "FASTPIN_ON_FULL", check_on_full, str.strip,
            "one of " + ", ".join(ON_FULL), "fallback"),
    _flag("allow_unpinned", "FASTPIN_ALLOW_UNPINNED", False),
    _flag("numa", "FASTPIN_NUMA", True),
    _flag("streaming", "FASTPIN_STREAMING", True),
    # install() and Loader(dl) collate in the workers (zero-copy) by default.
    _flag("zero_copy", "FASTPIN_ZERO_COPY", True),
    # install() without a device: None (batches pinned on the host), or
    # "cuda" / "cuda:N" (batches delivered there).
    Setting("install_device", "FASTPIN_INSTALL_DEVICE", lambda value: check_cuda_device(value),
            str.strip, "cuda (the current GPU) or cuda:N (unset: batches stay on the host)"),
)
# Read where they are used: the C core's cuda.c reads FASTPIN_DISABLE_CUDA's
# words as flag_text does; _segments the zero-copy cap.
DISABLE_CUDA = _flag("disable_cuda", "FASTPIN_DISABLE_CUDA", False)
ZERO_COPY_MAX_BYTES = Setting(
    "zero_copy_max_bytes", "FASTPIN_ZERO_COPY_MAX_BYTES",
    lambda value: check_int("zero_copy_max_bytes", value, 1, None, "a number of bytes >= 1"),
    int_text, "a number of bytes >= 1 (the most a self-sizing shared arena grows to)")


# ---- the environment -----------------------------------------------------------------

def env_exact(name: str, words: tuple, allowed: str) -> None:
    """A variable the C core reads as written (no spaces, no other words): one of `words`."""
    value = os.environ.get(name, "")
    if value not in words:
        raise ValueError(f"{name}={value!r}: must be {allowed}")


def check_cuda_device(value: Any) -> str:
    """A CUDA device named as text: "cuda" (the current GPU) or "cuda:N"."""
    if not isinstance(value, str):
        raise TypeError(f"must be cuda or cuda:N, not {value!r}")
    kind, colon, index = value.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"must be cuda (the current GPU) or cuda:N, not {value!r}")
    return value


SYSFS_ROOT_ENV = "FASTPIN_SYSFS_ROOT"  # where _numa reads the topology (tests give a fake tree)


def env_flag(name: str, default: bool) -> bool:
    """A flag variable, read as every FASTPIN_* flag is."""
    return _flag(name.lower(), name, default).read()


def zero_copy_max_bytes() -> Optional[int]:
    """FASTPIN_ZERO_COPY_MAX_BYTES: the cap of a self-sizing shared arena, or None."""
    return ZERO_COPY_MAX_BYTES.read()


def read_environment() -> dict:
    """The settings the FASTPIN_* environment gives (defaults where unset), checked."""
    fields = {s.name: s.read() for s in ENVIRONMENT}
    fields.update(device=None,  # None: the current GPU (see _arena.device_index)
                  wait_timeout=10.0)
    return fields


def check_environment() -> None:
    """At import: every FASTPIN_* variable fastpin reads, the settings' and
    those read where they are used (here, in _segments, _numa and the C core's
    cuda.c), checked; the first bad one raises ValueError."""
    read_environment()
    zero_copy_max_bytes()
    DISABLE_CUDA.read()
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
        # Loader(zero_copy): DataLoader -> {its pools' settings: (the Pool, the
        # Loaders that took it)} (_loader._shared_pool).
        self.loader_pools: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        self.reset()

    def reset(self) -> None:
        for registry in (self.arenas, self.shared, self.attached, self.directories, self.pools,
                         self.pinned, self.producers, self.installed_pools, self.loader_pools):
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


# ---- the memory this process may use --------------------------------------------------
#
# A job's limit is rarely at the root of the cgroup mount: Slurm, systemd and
# container runtimes put each job in a cgroup nested below it, and the limit
# on any cgroup above the process's own bounds it too. So the limit is read at
# the process's own cgroup (/proc/self/cgroup, located under its mount by
# /proc/self/mountinfo) and at every cgroup above it, and the tightest wins.

# Per cgroup version: the files that bound the memory of the cgroup's
# processes. memory.high is a throttle rather than a kill, but a process kept
# above it is reclaimed from nonstop, and page-locked memory cannot be.
_LIMIT_FILES = {"cgroup2": ("memory.max", "memory.high"), "cgroup": ("memory.limit_in_bytes",)}


def _unescape(field: str) -> str:
    """A path as mountinfo writes it: space, tab, newline and backslash octal-escaped."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace(
        "\\012", "\n").replace("\\134", "\\")


def _memory_mounts(mountinfo: str) -> list:
    """(fs type, the cgroup path mounted, mount point) of every cgroup2 mount
    and every cgroup v1 mount of the memory controller in `mountinfo`."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        fstype, options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in options.split(",")):
            mounts.append((fstype, _unescape(fields[3]), _unescape(fields[4])))
    return mounts


def _own_cgroups(cgroup: str) -> dict:
    """The process's cgroup path in each hierarchy that can hold a memory limit
    ("cgroup2": the unified one, "cgroup": v1's memory controller), from
    /proc/self/cgroup's lines (hierarchy id:controllers:path)."""
    own = {}
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            own["cgroup2"] = path
        elif "memory" in controllers.split(","):
            own["cgroup"] = path
    return own


def _read_limit(path: str) -> Optional[int]:
    """A limit file's bytes; None where it is missing, unreadable or says "max"."""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return None
    return int(value) if value.isdigit() else None


def _limited_up(mount_point: str, relative: str, files: tuple) -> list:
    """(directory, limit) for each limit set in `files` of cgroup `relative` (a
    path below the mount) and of every cgroup above it, up to the mount's root."""
    parts = [p for p in relative.split("/") if p and p != "."]
    if ".." in parts:
        parts = []  # outside the mounted part of the tree: only its root is known
    limits = []
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(mount_point, *parts[:depth])
        for name in files:
            value = _read_limit(os.path.join(directory, name))
            if value is not None:
                limits.append((directory, value))
    return limits


def _cgroup_limits(root: str) -> list:
    """(fs type, directory, limit) of every memory limit set on this process's
    own cgroup and those above it, in either hierarchy. `root`: where /proc
    and the cgroup mounts are found (a fake tree, in tests)."""
    def read(path: str) -> str:
        try:
            with open(os.path.join(root, path.lstrip("/"))) as f:
                return f.read()
        except OSError:
            return ""

    own = _own_cgroups(read("/proc/self/cgroup"))
    limits = []
    for fstype, mounted, point in _memory_mounts(read("/proc/self/mountinfo")):
        path = own.get(fstype)
        if path is None:
            continue
        # A mount shows the tree from `mounted` down (a container's own
        # cgroup, say); the process's path is relative to the tree's root.
        if mounted != "/" and (path == mounted or path.startswith(mounted.rstrip("/") + "/")):
            path = path[len(mounted.rstrip("/")):]
        elif mounted != "/":
            path = "/.."  # not below the mounted part: only the mount's root is known
        limits += [(fstype, directory, limit) for directory, limit in
                   _limited_up(os.path.join(root, point.lstrip("/")), path, _LIMIT_FILES[fstype])]
    return limits


def cgroup_memory_limit(root: str = "/") -> Optional[int]:
    """The tightest memory limit (bytes) on this process's own cgroup and every
    cgroup above it, in the unified hierarchy (memory.max, memory.high) and in
    v1's memory controller (memory.limit_in_bytes); None where none is set or
    none can be read. `root`: where /proc and the cgroup mounts are found (a
    fake tree, in tests)."""
    limits = [limit for _, _, limit in _cgroup_limits(root)]
    return min(limits) if limits else None


def memory_bytes(root: str = "/") -> int:
    """The memory this process may use: the machine's, or the tightest limit of
    its cgroups (cgroup_memory_limit) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(root)
    return total if limit is None else min(total, limit)


def _working_set(fstype: str, directory: str) -> Optional[int]:
    """The memory charged to a cgroup that the kernel cannot simply drop: its
    usage less the file pages it may reclaim first (as container runtimes
    count it)."""
    usage = _read_limit(os.path.join(directory, "memory.current" if fstype == "cgroup2"
                                     else "memory.usage_in_bytes"))
    if usage is None:
        return None
    key = "inactive_file" if fstype == "cgroup2" else "total_inactive_file"
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return max(usage - int(value), 0)
    except (OSError, ValueError):
        pass
    return usage


# The share of a cgroup's limit that fastpin leaves to others when it sizes
# memory of its own (an arena's new segment): the job's other processes, the
# DataLoader workers' batches still on their way, the kernel's own.
_RESERVE = 8


def _binding_limits(root: str) -> list:
    """_cgroup_limits(root) less those the machine's memory could not reach
    (v1 writes "no limit" as a huge number), remembered for a second in this
    process: asked for every batch, and a job's limits rarely change."""
    key = (root, os.getpid())
    now = time.monotonic()
    cached = _limits_cache.get(key)
    if cached is not None and now - cached[0] < 1.0:
        return cached[1]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [entry for entry in _cgroup_limits(root) if entry[2] < total]
    _limits_cache.clear()
    _limits_cache[key] = (now, limits)
    return limits


_limits_cache: dict = {}


def memory_room(root: str = "/") -> Optional[int]:
    """The bytes this process may still take without its cgroup (or one above
    it) coming within an eighth of its limit; None where no limit binds (the
    machine's memory is then the only bound, and caps already take a share of
    it). fastpin takes memory of its own (an arena's segment, a batch's copy)
    only within it: past a limit the kernel kills a process without a word."""
    room = None
    for fstype, directory, limit in _binding_limits(root):
        used = _working_set(fstype, directory)
        if used is None:
            continue
        left = max(limit - limit // _RESERVE - used, 0)
        room = left if room is None else min(room, left)
    return room


def machine_cap(registered: bool) -> int:
    """The most a self-sizing arena (zero-copy's shared one, the default one)
    grows to unless told: a quarter of the memory this process may use and,
    when the arena is page-locked, half of RLIMIT_MEMLOCK where that limit was
    set for it. The small defaults (64 KiB, 8 MiB) are ignored: the CUDA driver
    pins registered memory itself and does not charge it there; should a
    registration be refused all the same, the arena stops growing and batches
    fall back."""
    cap = memory_bytes() // 4
    if registered:
        try:
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            if soft != resource.RLIM_INFINITY and soft // 2 >= 1 << 30:
                cap = min(cap, soft // 2)
        except (ImportError, OSError, ValueError):
            pass
    return cap


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
    batches, leaves, nbytes = _C.pin_counts()[:3]
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
