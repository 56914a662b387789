"""fastpin.pin_memory: a batch's tensor and array leaves into one arena block
(planned, packed and given back by the leaf pipeline, _leaves)."""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Optional

from . import _C, _graphs
from ._arena import ON_FULL, cuda_available, default_arena, made_default_arena
from ._grow import GrowingArena
from ._runtime import count, counts, first, process, settings
from ._leaves import Plan, is_leaf
from ._numa import parse_cpulist
from ._walk import flatten, unflatten

log = logging.getLogger("fastpin")

# ---- how the bytes are copied (not yet user settings: measurements pick them) ----

# A batch of tensors and arrays (the C path's: Arena.pin_tree, pin_batch)
# whose bytes in all lie in [lo, hi] is copied by torch's own intra-op threads,
# which stay hot between calls, with the GIL released; only where the calling
# thread has more than one of them (the DataLoader's pin thread has one, and
# there the pool is faster at every size), and never in a process forked from
# the one that loaded fastpin (OpenMP's threads do not survive fork). Where
# torch's parallel backend is OpenMP (its pip wheels for Linux: GNU libgomp),
# its team copies the batch's bytes in slices, called from C (team.c: one
# thread per team_grain bytes, torch's own grain for bytes); elsewhere, or with
# team_grain 0, torch's Tensor.copy_ fills views of the block, for a batch of
# torch tensors alone (the pool copies one with arrays). None: never (the copy
# pool copies every batch). Both happen in the same C call that reserves
# the block (batch.c); through copy_ the range cost what the pool's path does
# around the copy: about 1.8 us a call on the H100 machine, where torch's own
# pin spends about 1.7 on its allocator.
# 256 KiB-16 MiB, from benchmarks/pin_cutover.py (2026-12-06). On the H100
# machine (16 CPUs, --recommend) torch's copy_ took 1.4-6.9x the pool's GB/s at
# 1, 2, 4, 8 and 16 MiB, cache-hot and cold, and from 64 MiB less (0.37-0.70x,
# but for 1.04x at 64 MiB cold); once the copy moved into the C call, at 256 KiB
# as much as the pool hot (27.8 against 27.9 GB/s) and 1.8x cold (21.9 against
# 12.0), and at 64 KiB half (7.2 against 14.0 hot). On the 2-core CPU machine
# (2 torch threads) the same: 1.0x hot and 1.25x cold at 256 KiB, 1.24x and
# 1.46x at 512 KiB, 0.63-0.79x at 64 KiB, at up to twice the pool's CPU per GB
# (torch's threads wait for the next call spinning). On the H100 machine
# (2026-12-07) the pool's threads spinning 100 us and sharing every batch did
# not change that: 0.3-0.5x of torch's copy_ from 1 to 8 MiB hot, 0.4-0.9x
# cold; so the pool's spin stays 0 (benchmarks/RESULTS.md). A team of spinning
# threads, each copying the same slice every call, did beat torch's pin there
# (1.03-1.53x from 256 KiB to 8 MiB, 2026-12-07, benchmarks/copier_team.patch),
# but with num_workers=0 it took install()'s loop to 0.34-0.53x of stock: its
# threads spun beside torch's own, which make and collate the batch in the same
# process. The spin stays 0 for that, and torch's copy_ keeps the span.
_torch_copy: Optional[tuple] = (256 << 10, 16 << 20)

# The copy pool's knobs (_C.set_copy_tuning's keywords, and spin and streaming).
_POOL_SIZES = ("inline_max", "inline_spin", "stream_min", "chunk_min", "chunk_max",
               "chunk_min_spin")
COPY_KEYS = ("spin_ns", "streaming", *_POOL_SIZES, "torch_copy", "team_grain")
COPY_ENV = "FASTPIN_COPY"


def tune_copy(**knobs) -> dict:
    """Set how fastpin.pin_memory copies, now and for every copy pool made later
    in this process; returns copy_tuning(). Knobs (bytes of a whole batch):
    spin_ns (how long the pool's threads poll for the next batch after a chunk,
    0 to 10 ms; they take cores from torch's own threads meanwhile, which made
    a loop with num_workers=0 slower), streaming (stores that bypass the cache,
    from stream_min), inline_max (up to this the calling thread copies alone,
    shared only with spinning threads above inline_spin), chunk_min /
    chunk_max / chunk_min_spin (the pieces the pool's threads take), torch_copy
    ((lo, hi): batches of lo to hi bytes are copied by torch's threads where
    the calling thread has more than one torch thread; None: none are),
    team_grain (those batches are copied by torch's OpenMP team directly, a
    thread per team_grain bytes, where torch's parallel backend is OpenMP; 0:
    through torch's copy_, which takes batches of plain torch tensors alone)."""
    global _torch_copy
    unknown = set(knobs) - set(COPY_KEYS)
    if unknown:
        raise TypeError(f"tune_copy: no knob {sorted(unknown)[0]!r} (knobs: {', '.join(COPY_KEYS)})")
    if "torch_copy" in knobs:
        span = knobs["torch_copy"]
        if span is not None:
            lo, hi = (int(v) for v in span)
            if not 0 <= lo <= hi:
                raise ValueError(f"tune_copy: torch_copy must be (lo, hi) with 0 <= lo <= hi, "
                                 f"not {span!r}")
            span = (lo, hi)
    settings.load()  # it sets streaming from the environment once: before us, not after
    sizes = {k: knobs[k] for k in _POOL_SIZES if k in knobs}
    if sizes:
        _C.set_copy_tuning(**sizes)
    if "spin_ns" in knobs:
        _C.set_spin(knobs["spin_ns"])
    if "streaming" in knobs:
        _C.set_streaming(bool(knobs["streaming"]))
    if "team_grain" in knobs:
        _C.set_team_grain(knobs["team_grain"])
    if "torch_copy" in knobs:
        _torch_copy = span
        forget_default()
    return copy_tuning()


def copy_tuning() -> dict:
    """How pin_memory copies now: the pool's knobs (see tune_copy), its threads,
    spinners (the most of them that may spin at once: the CPUs it may use,
    less one for the caller), and team (whether torch's OpenMP team was found,
    which copies the torch_copy span where team_grain is not 0)."""
    out: dict = dict(_C.copy_tuning())
    out["torch_copy"] = _torch_copy
    return out


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _env_bytes(word: str) -> int:
    word = word.strip().upper()
    scale = _UNITS.get(word[-1:], 1)
    number = word[:-1] if word[-1:] in _UNITS else word
    return int(float(number) * scale)


def parse_copy_knobs(text: str) -> dict:
    """FASTPIN_COPY's form, "knob=value,...": sizes in bytes with an optional
    K, M or G (binary), streaming 0 or 1, torch_copy LO-HI or off. For example
    "spin_ns=50000,inline_max=256K,torch_copy=1M-8M"."""
    knobs: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        try:
            if not sep or key not in COPY_KEYS:
                raise ValueError(f"no knob {key!r}")
            if key == "torch_copy" and value.lower() == "off":
                knobs[key] = None
            elif key == "torch_copy":
                lo, dash, hi = value.partition("-")
                if not dash:
                    raise ValueError("must be LO-HI or off")
                knobs[key] = (_env_bytes(lo), _env_bytes(hi))
            elif key == "streaming":
                if value not in ("0", "1"):
                    raise ValueError("must be 0 or 1")
                knobs[key] = value == "1"
            else:
                knobs[key] = _env_bytes(value)
        except ValueError as e:
            raise ValueError(f"{COPY_ENV}: {item!r}: {e} (knobs: {', '.join(COPY_KEYS)})") from None
    return knobs


# Where the copy pool's streaming stores (which bypass the cache) start. In
# the main process, once a copy's source and destination together pass the
# last-level cache (half of it each): on the H100 and H200 machines (300 MiB
# of it; benchmarks/pin_cutover.py, 2026-12-06 16:24-20:26 UTC) they slowed
# cache-cold copies of 32-128 MiB to 0.66-0.84x of ordinary stores (H200: 53,
# 57, 61 against 81, 79, 73 GB/s at 32, 64, 128 MiB) and paid from 256 MiB
# (H200: 1.10x cold, 1.18x hot; 1.2x at 1 GiB). In a zero-copy worker, from
# 4 MiB: 15 of them packing at once are bound by the memory's bandwidth, and
# ordinary stores read every line they write (52 GB/s against 40 delivered,
# 2026-12-01).
WORKER_STREAM_MIN = 4 << 20


def _top_cache(root: str, cpu: int) -> Optional[tuple]:
    """(bytes, the CPUs sharing it) of `cpu`'s highest-level data or unified
    cache, from sysfs; None where it cannot be read."""
    base = os.path.join(root, f"sys/devices/system/cpu/cpu{cpu}/cache")
    best = None
    try:
        indexes = [e for e in os.listdir(base) if e.startswith("index")]
    except OSError:
        return None
    for index in indexes:
        def field(name: str) -> str:
            with open(os.path.join(base, index, name)) as f:
                return f.read().strip()
        try:
            if field("type") == "Instruction":
                continue
            level = int(field("level"))
            if best is None or level > best[0]:
                best = (level, _env_bytes(field("size")), set(parse_cpulist(field("shared_cpu_list"))))
        except (OSError, ValueError):
            continue
    return best[1:] if best else None


def llc_bytes(root: str = "/") -> Optional[int]:
    """The last-level caches this process's CPUs share, summed over the
    distinct ones (a socket or a core complex each), from sysfs; None where
    it cannot be read. Each cache is read once, from its first CPU."""
    covered: set = set()
    total = 0
    for cpu in sorted(os.sched_getaffinity(0)):
        if cpu in covered:
            continue
        top = _top_cache(root, cpu)
        if top is not None:
            total += top[0]
            covered |= top[1] | {cpu}
    return total or None


def main_stream_min() -> int:
    """stream_min for the main process: half its last-level cache, at least
    WORKER_STREAM_MIN."""
    return max(WORKER_STREAM_MIN, (llc_bytes() or 0) // 2)


_stream_min_given: Optional[int] = None  # FASTPIN_COPY's stream_min: workers keep it too


def worker_copies() -> None:
    """In a zero-copy worker, before it packs its first batch: it copies on its
    own thread, streaming from WORKER_STREAM_MIN (or what FASTPIN_COPY says)."""
    _C.set_threads(1)
    given = _stream_min_given
    _C.set_copy_tuning(stream_min=WORKER_STREAM_MIN if given is None else given)


def _tune_from_environment() -> None:
    global _stream_min_given
    _C.set_copy_tuning(stream_min=main_stream_min())
    text = os.environ.get(COPY_ENV, "").strip()
    if text:
        knobs = parse_copy_knobs(text)
        _stream_min_given = knobs.get("stream_min")
        tune_copy(**knobs)

class Fallback(Exception):
    """The policy says: pin this batch the ordinary way."""


def pin_with_policy(arena, plan, on_full: str):
    """The block of arena.pin(plan.sources, 1) (padding included), or what the
    full-arena policy says instead (raises Fallback when that is the ordinary
    path). A GrowingArena grows in its pin() first: the policy applies past its cap."""
    sources, total = plan.sources, plan.nbytes
    growing = isinstance(arena, GrowingArena)
    if total > (arena.cap if growing else arena.capacity):
        if growing:
            message = (f"a batch of {total} bytes is larger than the default arena's cap of "
                       f"{arena.cap} bytes (a quarter of this machine's or cgroup's memory, and "
                       "half of RLIMIT_MEMLOCK where set): pin it in a fixed arena of more with "
                       "fastpin.configure(capacity=...) or FASTPIN_ARENA_BYTES")
        else:
            message = (f"a batch of {total} bytes cannot be pinned in an arena of "
                       f"{arena.capacity} bytes: raise the cap with "
                       "fastpin.configure(capacity=...) or FASTPIN_ARENA_BYTES")
        if on_full != "fallback":
            raise _C.ArenaFullError(message)
        if first("batch over the cap"):
            log.warning("fastpin: %s; such batches are pinned the ordinary way", message)
        raise Fallback
    deadline = None
    delay = 0.0005
    while True:
        try:
            return arena.pin(sources, 1)[0]
        except _C.ArenaFullError as e:
            if on_full == "fallback":  # the first one slows the user down: say so, once
                log.log(logging.DEBUG if counts["fallbacks"] else logging.WARNING,
                        "fastpin: %s; pinning this batch the ordinary way (slower; later ones "
                        "are logged at DEBUG)", str(e))  # not e: its traceback holds the batch
                raise Fallback from None
            if on_full == "raise":
                raise
            # "wait": until the consumer frees batches, within the timeout.
            now = time.monotonic()
            if deadline is None:
                deadline = now + settings.wait_timeout
            if now >= deadline:
                raise _C.ArenaFullError(
                    f"{e}; waited {settings.wait_timeout:g} s for room "
                    "(fastpin.configure(on_full=..., wait_timeout=...))") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            arena.collect()


_torch_seen = False


def _no_torch_threads() -> int:
    return 0


_torch_threads = _no_torch_threads  # torch.get_num_threads once torch is seen


def _team_owner(torch: Any) -> Optional[str]:
    """The library whose OpenMP runtime torch's parallel copies use, where
    its parallel backend is OpenMP (pip's Linux wheels: libtorch_cpu, linking
    GNU libgomp); None for any other backend."""
    try:
        info = torch.__config__.parallel_info()
    except Exception:  # an unusual build: torch's copy_ then fills the span
        return None
    return "libtorch_cpu." if "parallel backend: OpenMP" in info else None


def _use_torch() -> None:
    """Let Arena.pin_tree read and make torch tensors (through torch's DLPack C
    exchange API, where this torch has it), once torch is imported."""
    global _torch_seen, _torch_threads
    torch = sys.modules["torch"]
    _torch_threads = torch.get_num_threads
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if api is not None and not _C.use_torch(torch.Tensor, api, _team_owner(torch)):
        log.debug("fastpin: torch's DLPack exchange API is of another version; "
                  "pinning torch tensors through the Python pipeline")
    _torch_seen = True


def pin_memory(data: Any, device: Optional[str] = None, *,
               arena: Optional[_C.Arena] = None, stream: Any = None,
               on_full: Optional[str] = None) -> Any:
    """Return `data` with every tensor and NumPy array leaf copied into page-locked
    memory, in one block of fastpin's arena, by its copy threads with the GIL
    released (a batch of 256 KiB-16 MiB, where the calling thread has more than
    one torch thread, by those threads of torch's: faster there). The structure
    comes back as it went in (see _walk.map_leaves); torch tensors stay torch
    tensors and arrays stay arrays, subclasses and autograd as
    torch.Tensor.pin_memory() gives them back (what fastpin cannot place in a block,
    such as masked arrays, memmaps, sparse, nested and quantized tensors, goes the
    ordinary way); tensors already pinned come back unchanged; objects with a
    pin_memory() method are asked to pin themselves. `device` ("cuda", "cuda:N",
    an int; DataLoader's pin thread passes "cuda" with its device current) picks
    the GPU's default arena, whose frees wait for that GPU's copies; None: the
    current GPU. The memory is pinned for every GPU either way. Non-contiguous
    inputs come back contiguous (dense permuted layouts such as channels_last
    keep their strides).

    The block is reused only after its tensors are gone and every GPU copy
    queued before that, on any stream of the device, has finished (a fence over
    the device's whole context), so a non_blocking copy from it is safe on
    whatever stream it is issued: the default one, a prefetcher's side stream,
    an ExternalStream. `stream` is accepted and no longer needed (earlier
    versions waited for the default stream and the one named only).

    on_full overrides fastpin.configure(on_full=...) for this call: "fallback",
    "wait" or "raise" (see configure)."""
    walked = False
    # The current GPU's default arena ("cuda": what DataLoader passes).
    common = (device is None or device == "cuda") and arena is None
    if common and on_full is None:
        # The common call, once a call has found the default arena made: one
        # C call (see _remember).
        out = _C.pin_default(data)
        if out is not None and out is not NotImplemented:
            return out
        walked = out is NotImplemented and _torch_seen
    cuda = cuda_available()
    if cuda and not _graphs.watching:
        _graphs.watch()
    if on_full is not None and on_full not in ON_FULL:
        raise ValueError(f"on_full must be 'fallback', 'wait' or 'raise', not {on_full!r}")
    if not _torch_seen and sys.modules.get("torch") is not None:
        _use_torch()
    # The default arena is made by the first batch that places a leaf (below).
    fast_arena = arena if arena is not None else made_default_arena(device)
    spec = None
    if fast_arena is not None:
        # A batch of _torch_copy's size is filled by torch's threads, where
        # this thread has several of them.
        span = _torch_copy if _torch_copy is not None and _torch_threads() > 1 else ()
        try:
            # One C call for the common batch (lists, tuples and dicts of plain
            # tensors and arrays, each one memcpy).
            out = NotImplemented if walked else fast_arena.pin_tree(data, cuda, *span)
            if out is not NotImplemented:
                if common:
                    _remember(cuda)
                return out
            # Other containers (namedtuples, Mappings, dataclasses) are walked
            # here, and their leaves still placed in one C call; None: a leaf
            # needs the Python pipeline below.
            spec, leaves = flatten(data, is_leaf)  # one walk: the rebuild uses it
            outs = fast_arena.pin_batch(leaves, cuda, *span)
            if outs is not None:
                return unflatten(spec, outs)
        except _C.ArenaFullError:
            pass  # the full-arena policy below decides
    if spec is None:
        spec, leaves = flatten(data, is_leaf)
    return _pin_planned(spec, leaves, device, arena, on_full)


def _remember(cuda: bool) -> None:
    """Let _C.pin_default do pin_memory's common call from now on: no device or
    arena named, into the current device's default arena, read from the same
    registry at each call (so it declines where none is made, or while
    configure() names a device). Forgotten (forget_default) where what it
    holds changes: configure(), tune_copy()."""
    if not cuda or _graphs.watching:
        lo, hi = _torch_copy if _torch_copy is not None else (1, 0)
        _C.set_pin_default(process.arenas, settings, cuda, lo, hi, _torch_threads)


def forget_default() -> None:
    """pin_memory's next call takes the Python path (and remembers again)."""
    _C.set_pin_default(None)


def _pin_planned(spec, leaves: list, device: Any, arena: Optional[_C.Arena],
                 on_full: Optional[str]) -> Any:
    """pin_memory through the Python pipeline (_leaves.Plan): every leaf type,
    gathers, autograd, and the full-arena policy."""
    plan = Plan(leaves)
    block = None
    if plan.placed:
        arena = arena if arena is not None else default_arena(device)
        try:
            block = pin_with_policy(arena, plan, on_full or settings.on_full)
        except Fallback:
            count(batches=1, fallbacks=1)
            return unflatten(spec, plan.ordinary())
    out = unflatten(spec, plan.host(block))
    count(batches=1, leaves=plan.placed, nbytes=plan.data_bytes)
    return out


_tune_from_environment()
