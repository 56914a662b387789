"""The paths a batch can take from a loader to its consumer, in one registry.

PATHS maps each path's name to its PathInfo: the label and description that
--list, --path and the tables show, what it needs (a GPU, a GPU to deliver to),
and its factory, which stands under its description. The report's summary
shows every path that delivers to the GPU (cuda_target=True) and those marked
headline=True, beside the stock path. The factory gets a
PathRun (the loader factory, where batches go, the arena to use) and returns
the iterator of delivered batches, noting on the PathRun the arena and the
fastpin.Loader it made. compare() and the training case both run paths
through this registry, and nothing else names them."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import fastpin
from fastpin import _C
from fastpin._walk import map_leaves

from ._optional import torch
from .host import MB


def gpu_usable() -> tuple:
    """(a CUDA GPU is usable by fastpin and torch, why not)."""
    status = fastpin.cuda_status()
    if status.state != "ready":
        return False, status.reason
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no GPU (a CPU build?)"
    return True, ""


def target_of(device: Any) -> tuple:
    """Where batches are delivered: a CUDA device, or None for the host; and,
    for the host, why (no GPU, or asked for)."""
    gpu, why = gpu_usable()
    if isinstance(device, str) and device in ("auto",):
        return (torch.device("cuda", torch.cuda.current_device()), "") if gpu else (None, why)
    if device is None or (isinstance(device, str) and device in ("host", "cpu")):
        return None, "the target is the host (device=None)"
    dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if dev.type != "cuda":
        raise ValueError(f"device must be 'auto', None/'host' or a CUDA device, not {device!r}")
    if not gpu:
        return None, why
    return (dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device()),
            "")


def why_not(path: str, target: Optional[torch.device], host_reason: str) -> Optional[str]:
    """Why `path` cannot run here, or None."""
    info = PATHS[path]
    gpu, why = gpu_usable()
    if info.needs_gpu and not gpu:
        return f"needs a GPU ({why})"
    if info.needs_cuda_target and target is None:
        return f"delivers to a GPU, and {host_reason}"
    return None


# ---- delivering batches ------------------------------------------------------------

def to_device(batch: Any, device: torch.device) -> Any:
    return map_leaves(batch, lambda x: isinstance(x, torch.Tensor),
                      lambda x: x.to(device, non_blocking=True))


def shutdown(it: Any) -> None:
    """End an iterator now: generators and fastpin epochs close, a DataLoader's
    worker processes stop (instead of whenever the garbage collector gets to it)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
    stop = getattr(it, "_shutdown_workers", None)
    if stop is not None:
        stop()


def record_stream(batch: Any, stream: Any) -> None:
    map_leaves(batch, lambda x: isinstance(x, torch.Tensor) and x.is_cuda,
               lambda x: x.record_stream(stream))


class SideStreamPrefetcher:
    """timm's PrefetchLoader / Apex's data_prefetcher for nested batches: copy batch
    N+1 on a side stream while batch N computes; the compute stream waits on the
    side stream before it takes the batch."""

    def __init__(self, loader: Iterable, device: torch.device):
        self.loader, self.device = loader, device

    def __iter__(self):
        stream = torch.cuda.Stream(self.device)
        it = iter(self.loader)
        try:
            first, current = True, None
            for batch in it:
                with torch.cuda.stream(stream):
                    nxt = to_device(batch, self.device)
                if not first:
                    yield current
                else:
                    first = False
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_stream(stream)
                record_stream(nxt, consumer)
                current = nxt
            if not first:
                yield current
        finally:
            shutdown(it)


def plain(loader: Iterable, target: Optional[torch.device],
          pin: Optional[Callable[[Any], Any]] = None) -> Iterator:
    """The loader's batches, pinned by `pin` if given, then copied to `target`."""
    it = iter(loader)
    try:
        for batch in it:
            if pin is not None:
                batch = pin(batch)
            yield batch if target is None else to_device(batch, target)
    finally:
        shutdown(it)


def no_pin(loader: Any) -> Any:
    if isinstance(loader, torch.utils.data.DataLoader) and loader.pin_memory:
        loader.pin_memory = False  # the factory ignored pin_memory=False
    return loader


# ---- the registry -------------------------------------------------------------------

class PathSkipped(Exception):
    """A path cannot run over what the loader factory made; the message says why."""


@dataclasses.dataclass
class PathRun:
    """What a path's factory is given, and what it leaves for the runner to read."""

    factory: Callable[[bool], Iterable]  # loader_factory(pin_memory) -> a fresh loader
    target: Any                          # the CUDA device batches go to; None: the host
    depth: int = 2                       # fastpin.Loader's batches prepared ahead
    capacity: Optional[int] = None       # bytes of the path's own arena; None: one that
                                         # sizes itself (zero-copy's too)
    batch_bytes: int = 0                 # the largest batch seen (zero-copy's room)
    arena: Any = None                    # set by the factory: the arena it pins in, if its own
    loader: Any = None                   # set by the factory: its fastpin.Loader, if any
    pool: Any = None                     # set by install's: the shared pool of its workers
    consumer: Any = dataclasses.field(init=False, default=None)  # the target's current stream
    made: list = dataclasses.field(init=False, default_factory=list)  # what factory made

    def __post_init__(self):
        if self.target is not None:
            self.consumer = torch.cuda.current_stream(self.target)
        # Every loader a path's factory makes is noted, whatever the path, so the
        # runner knows how many batches its workers make ahead (prefetched()).
        make, made = self.factory, self.made

        def noted(pin_memory: bool) -> Iterable:
            loader = make(pin_memory)
            made.append(loader)
            return loader

        self.factory = noted

    def prefetched(self) -> int:
        """Batches the path's source can hold ready before the loop asks for them:
        each loader's workers x prefetch_factor (a DataLoader's, or any source's
        that has them), and `depth` for what a fastpin.Loader or prefetcher holds."""
        ahead = 0
        for loader in self.made:
            workers = getattr(loader, "num_workers", 0) or 0
            if isinstance(workers, int) and workers > 0:
                ahead += workers * (getattr(loader, "prefetch_factor", None) or 2)
        return ahead + self.depth

    def own_arena(self) -> Any:
        """An arena for this path alone: of `capacity` bytes, or (None) one that sizes
        itself as fastpin's default arena does."""
        cuda = fastpin.cuda_available()
        index = self.target.index if self.target is not None else 0
        if self.capacity is not None:
            self.arena = _C.Arena(self.capacity, device=index, cuda=cuda)
        else:
            from fastpin._arena import growing_arena

            self.arena = growing_arena(index if cuda else -1)
        return self.arena


@dataclasses.dataclass(frozen=True)
class PathInfo:
    name: str
    label: str
    what: str
    needs_cuda_target: bool   # delivers to the GPU only (the summary shows every such path)
    needs_gpu: bool           # needs a GPU even to deliver host batches
    fastpin: bool
    make: Callable[[PathRun], Iterator] = dataclasses.field(repr=False, compare=False)
    torch_pinning: bool = False  # measures torch's own pinning (fastpin.install() lifted)
    headline: bool = False    # in the summary though it does not deliver to the GPU alone
    short: str = ""           # the summary's column heading (default: label)
    in_default: bool = True   # run unless --path names the paths (to a GPU: the summary's)

    @property
    def in_summary(self) -> bool:
        """The report's summary table shows this path: every path that delivers to
        the GPU, and those marked headline."""
        return self.headline or self.needs_cuda_target

    @property
    def heading(self) -> str:
        return self.short or self.label


PATHS: dict = {}


def _path(name: str, label: str, what: str, *, cuda_target: bool = False, gpu: bool = False,
          uses_fastpin: bool = False, torch_pinning: bool = False, headline: bool = False,
          short: str = "", in_default: bool = True):
    """Registers the factory under it as path `name` (PATHS keeps this file's order)."""
    def register(make: Callable[[PathRun], Iterator]) -> Callable[[PathRun], Iterator]:
        PATHS[name] = PathInfo(name, label, what, cuda_target, gpu, uses_fastpin, make,
                               torch_pinning, headline, short, in_default)
        return make
    return register


@_path("pageable", "pageable .to()",
       "DataLoader(pin_memory=False); batch.to(device, non_blocking=True)")
def _pageable(run: PathRun) -> Iterator:
    return plain(no_pin(run.factory(False)), run.target)


@_path("pin_memory", "pin_memory=True",
       "DataLoader(pin_memory=True), torch's pin thread; batch.to(device, non_blocking=True)",
       gpu=True, torch_pinning=True, short="stock")
def _pin_memory(run: PathRun) -> Iterator:
    return plain(run.factory(True), run.target)


@_path("prefetcher", "timm/Apex prefetcher",
       "DataLoader(pin_memory=True) under a side-stream prefetcher (timm PrefetchLoader, "
       "Apex data_prefetcher)", cuda_target=True, gpu=True, torch_pinning=True,
       short="prefetcher")
def _prefetcher(run: PathRun) -> Iterator:
    return plain(SideStreamPrefetcher(run.factory(True), run.target), None)


@_path("fastpin_pin", "fastpin.pin_memory",
       "DataLoader(pin_memory=False); fastpin.pin_memory(batch) in the loop; then .to()",
       uses_fastpin=True)
def _fastpin_pin(run: PathRun) -> Iterator:
    arena, consumer = run.own_arena(), run.consumer
    return plain(no_pin(run.factory(False)), run.target,
                 lambda b: fastpin.pin_memory(b, arena=arena, stream=consumer))


@_path("loader_host", "Loader(device=None)",
       "fastpin.Loader(loader, device=None): pinned host batches; then .to()", uses_fastpin=True)
def _loader_host(run: PathRun) -> Iterator:
    run.loader = fastpin.Loader(no_pin(run.factory(False)), device=None, depth=run.depth,
                                arena=run.own_arena(), zero_copy=False)
    return plain(run.loader, run.target)


@_path("loader_cuda", "Loader(device=cuda)",
       "fastpin.Loader(loader, device='cuda'): copied on a side stream (run when named: "
       "zero-copy is the Loader's default)", cuda_target=True, gpu=True, uses_fastpin=True,
       short="Loader copy", in_default=False)
def _loader_cuda(run: PathRun) -> Iterator:
    run.loader = fastpin.Loader(no_pin(run.factory(False)), device=run.target, depth=run.depth,
                                arena=run.own_arena(), zero_copy=False)
    return plain(run.loader, None)


@_path("zero_copy", "Loader(zero_copy)",
       "fastpin.Loader(loader, zero_copy=True): workers collate into the shared pinned "
       "arena", uses_fastpin=True, headline=True, short="Loader")
def _zero_copy(run: PathRun) -> Iterator:
    loader = no_pin(run.factory(False))
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise PathSkipped(f"needs a torch DataLoader (the factory made a {type(loader).__name__})")
    sizing: dict = {}
    if run.capacity is not None:
        from fastpin._zerocopy import capacity_for

        # Room for every batch the workers have in flight, or they fall back.
        need = -(-capacity_for(loader, run.batch_bytes, run.depth) // MB) * MB
        sizing["capacity"] = max(run.capacity, need)
    run.loader = fastpin.Loader(loader, device=run.target, depth=run.depth,
                                zero_copy=True, **sizing)
    if not run.loader.zero_copy:
        raise PathSkipped("the DataLoader's workers already run")
    run.arena = run.loader.arena
    return plain(run.loader, None)


@_path("install", "install()",
       "DataLoader(pin_memory=True) after fastpin.install(): workers collate into the shared "
       "pinned arena, the pin thread hands the batch over; then .to()", uses_fastpin=True,
       headline=True)
def _install(run: PathRun) -> Iterator:
    loader = run.factory(True)
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise PathSkipped(f"needs a torch DataLoader (the factory made a {type(loader).__name__})")
    return installed(loader, run)


@_path("install_device", "install(device)",
       "DataLoader(pin_memory=True) after fastpin.install(device='cuda'): workers collate into "
       "the shared pinned arena, each batch copied on a side stream ahead of the loop; its "
       ".to() a no-op", cuda_target=True, gpu=True, uses_fastpin=True)
def _install_device(run: PathRun) -> Iterator:
    loader = run.factory(True)
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise PathSkipped(f"needs a torch DataLoader (the factory made a {type(loader).__name__})")
    return installed(loader, run, device=run.target)


def installed(loader: Any, run: PathRun, device: Any = None) -> Iterator:
    """`loader`'s batches under fastpin.install() (zero-copy; delivered to
    `device` if given), copied to the target; fastpin's install state is put
    back as it was when it ends, so other paths are unaffected."""
    from fastpin._install import _mode
    from fastpin._runtime import process, replaced

    before, mode = dict(replaced), dict(_mode)
    fastpin.install(zero_copy=True, device=device)
    try:
        with warnings.catch_warnings():
            # No GPU: torch turns pin_memory off, and says so; install() still
            # collates in the workers (see the README's Use).
            warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no "
                                    "accelerator", UserWarning)
            it = iter(loader)
        try:
            for batch in it:
                if run.pool is None and loader in process.installed_pools:
                    run.pool = process.installed_pools[loader][1]
                yield batch if run.target is None else to_device(batch, run.target)
        finally:
            shutdown(it)
    finally:
        fastpin.uninstall()
        if "pin_memory" in before:
            fastpin.install(zero_copy=mode["zero_copy"], device=mode["device"])
