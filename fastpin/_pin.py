"""fastpin.pin_memory: a batch's tensor and array leaves into one arena block
(planned, packed and given back by the leaf pipeline, _leaves)."""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Optional

from . import _C, _graphs
from ._arena import ON_FULL, cuda_available, default_arena, made_default_arena
from ._grow import GrowingArena
from ._runtime import count, counts, first, settings
from ._leaves import Plan, is_leaf
from ._walk import flatten, unflatten

log = logging.getLogger("fastpin")

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


def _use_torch() -> None:
    """Let Arena.pin_tree read and make torch tensors (through torch's DLPack C
    exchange API, where this torch has it), once torch is imported."""
    global _torch_seen
    torch = sys.modules["torch"]
    api = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if api is not None and not _C.use_torch(torch.Tensor, api):
        log.debug("fastpin: torch's DLPack exchange API is of another version; "
                  "pinning torch tensors through the Python pipeline")
    _torch_seen = True


def pin_memory(data: Any, device: Optional[str] = None, *,
               arena: Optional[_C.Arena] = None, stream: Any = None,
               on_full: Optional[str] = None) -> Any:
    """Return `data` with every tensor and NumPy array leaf copied into page-locked
    memory, in one block of fastpin's arena, by its copy threads with the GIL
    released. The structure comes back as it went in (see _walk.map_leaves); torch
    tensors stay torch tensors and arrays stay arrays, subclasses and autograd as
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
        try:
            # One C call for the common batch (lists, tuples and dicts of plain
            # tensors and arrays, each one memcpy).
            out = fast_arena.pin_tree(data, cuda)
            if out is not NotImplemented:
                return out
            # Other containers (namedtuples, Mappings, dataclasses) are walked
            # here, and their leaves still placed in one C call; None: a leaf
            # needs the Python pipeline below.
            spec, leaves = flatten(data, is_leaf)  # one walk: the rebuild uses it
            outs = fast_arena.pin_batch(leaves, cuda)
            if outs is not None:
                return unflatten(spec, outs)
        except _C.ArenaFullError:
            pass  # the full-arena policy below decides
    if spec is None:
        spec, leaves = flatten(data, is_leaf)
    return _pin_planned(spec, leaves, device, arena, on_full)


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
