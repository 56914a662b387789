# Type stubs of fastpin._C, the C extension (csrc/module.c, arena_type.c,
# block_type.c, batch.c). Keep in step with the bindings: tests/test_ecosystem.py
# checks that every public name of the built module is declared here, and
# type-checks a usage snippet with mypy.
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, final

import numpy as np
from numpy.typing import DTypeLike
from _typeshed import FileDescriptorLike
from typing_extensions import Self

GRANULE: int
MAX_CAPACITY: int  # the largest arena, bytes (2**43)

class FastpinError(RuntimeError):
    """A failure inside fastpin's core."""

class CudaError(FastpinError):
    """A CUDA driver call failed; the message is the driver's."""

class ArenaFullError(FastpinError, MemoryError):
    """The arena has no room for a request, or the request exceeds its cap."""

class _ArenaStats(TypedDict):
    capacity: int
    bytes_in_use: int
    bytes_requested: int
    high_water: int
    bytes_pending: int
    allocs: int
    failed: int
    waits: int
    blocks_in_use: int
    blocks_pending: int
    max_blocks: int
    fallbacks: int          # batches workers could not place (count_fallback)
    lock_recoveries: int
    reclaimed: int          # blocks freed by reclaim()
    blocks_foreign: int     # blocks held by other processes
    registered: bool
    shared: bool
    numa_node: int          # node the pages prefer (mbind took), or -1
    class_blocks: dict[int, int]

class _CudaStatus(TypedDict):
    state: Literal["ready", "no_device", "no_driver"]
    reason: str
    driver_version: int
    device_count: int
    fence: Literal["event", "sync"] | None  # how frees wait for every stream; None without CUDA

@final
class Block:
    """One block of an Arena. Freed (after the GPU is done with it) when the
    Block and every tensor or array made from it are gone. Made by Arena only."""

    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def index(self) -> int:
        """The block's number in its arena (what a worker ships to the main process)."""
    consumer_stream: int | str | None  # 'any', a stream handle, or None
    def dlpack(
        self,
        offset: int,
        shape: Sequence[int],
        strides: Sequence[int],
        code: int,
        bits: int,
        lanes: int = 1,
        version: int = -1,
        readonly: bool = False,
    ) -> Any:
        """A DLPack capsule over part of the block (strides in elements)."""
    def numpy(
        self, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: DTypeLike, /
    ) -> np.ndarray[Any, np.dtype[Any]]:
        """An ndarray over part of the block (strides in bytes)."""
    def unpack(
        self,
        record: bytes,
        objects: tuple[Any, ...],
        ordinary: Callable[[Any], Any] | None = None,
        leaf: Callable[[Any], Any] | None = None,
        /,
    ) -> Any:
        """A zero-copy batch from its layout record (fastpin/_record.py), in one
        call: its structure, each leaf a view of this block (leaf(view) where
        given), the leaves not in it ordinary(x) (as they are without it).
        ValueError for a record cut short, changed, or not of this block."""
    def detach(self) -> None:
        """Give the block up for another process to adopt: dropping this Block
        no longer frees it."""
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

@final
class Arena:
    """One region of host memory, page-locked with CUDA once when a GPU is present."""

    def __new__(
        cls,
        capacity: int,
        *,
        shared: bool = False,
        device: int = 0,
        cuda: bool = True,
        max_blocks: int = 0,
        numa_node: int = -1,
    ) -> Self: ...
    @classmethod
    def attach(cls, fd: FileDescriptorLike, /) -> Self:
        """Map the shared arena behind memfd `fd`, made in another process; never
        registered with CUDA. The Arena keeps its own copy of the fd."""
    @property
    def capacity(self) -> int: ...
    @property
    def registered(self) -> bool: ...
    @property
    def base(self) -> int: ...
    @property
    def fd(self) -> int: ...
    @property
    def token(self) -> int:
        """Identifies the arena across processes."""
    @property
    def attached(self) -> bool:
        """Made by Arena.attach (not the creator)."""
    @property
    def device(self) -> int:
        """The CUDA ordinal whose primary context holds the registration, -1 if none."""
    def alloc(self, nbytes: int, /) -> Block: ...
    def pin(
        self, sources: Sequence[tuple[int, int]], align: int = ..., /
    ) -> tuple[Block, tuple[int, ...]]:
        """Copy every (address, nbytes) source into one new block at align-aligned
        offsets (address 0 only reserves room); returns the block and the offsets."""
    def pin_batch(self, leaves: list[Any], check_pinned: bool, lo: int = ..., hi: int = ...,
                  /) -> list[Any] | None:
        """pin_memory's fast path: plain torch tensors (once use_torch ran) and NumPy
        arrays that one memcpy each copies, into one block at GRANULE-aligned
        offsets; their views in order, or None (nothing allocated) when a leaf
        needs the Python pipeline. check_pinned: pinned tensors come back as is.
        A batch of lo to hi bytes is copied by torch's intra-op threads instead
        of the copy pool: its OpenMP team (use_torch's team, team_grain not 0),
        else its copy_ into the views, for a batch of torch tensors alone."""
    def pin_tree(self, data: Any, check_pinned: bool, lo: int = ..., hi: int = ...,
                 /) -> Any:
        """pin_batch for a whole batch: a leaf, or exact lists, tuples and dicts of
        leaves and of None, bool, int, float, str and bytes (up to 32 deep), rebuilt
        around the pinned views; NotImplemented (nothing allocated) when something
        in it needs the Python pipeline."""
    def adopt(self, index: int, nbytes: int, /) -> Block:
        """In the creator: take over a block that a worker filled and detached."""
    def reclaim(self) -> int:
        """Free the blocks held by processes that no longer exist; returns how many."""
    def owner(self, index: int, /) -> int:
        """The pid that allocated an allocated block, 0 once adopted."""
    def count_fallback(self) -> None:
        """Count a batch that went the ordinary way because the arena was full."""
    def prefault(self) -> bool:
        """Attached: map every page of a registered arena now (nothing is allocated)."""
    def stats(self) -> _ArenaStats: ...
    def collect(self) -> None: ...
    def is_valid(self) -> bool: ...

def block_size(nbytes: int, /) -> int:
    """The bytes of arena one request of `nbytes` takes (its size class)."""
def h2d(
    arena: Arena,
    stream: int,
    items: Sequence[tuple[int, int, int, bool]],
    chunk: int = ...,
    /,
) -> None:
    """Queue host-to-device copies (dst, src, nbytes, src is pinned) on a CUDA
    stream (a raw handle), staging pageable sources through the arena."""

def use_torch(tensor_type: type, api: Any, team: str | None = ..., /) -> bool:
    """Let Arena.pin_batch take torch tensors through torch's DLPack C exchange
    API (Tensor.__dlpack_c_exchange_api__); False where that API is unusable.
    team: the file name prefix of the loaded library whose OpenMP runtime
    torch's parallel copies use; its team then copies the torch span."""
def set_pin_default(arenas: dict[int, Any] | None, settings: Any = ..., check_pinned: bool = ...,
                    lo: int = ..., hi: int = ..., threads: Callable[[], int] = ..., /) -> None:
    """What pin_default reads: the default arenas by device, declining while
    settings.device is set; pins as pin_tree(data, check_pinned, lo, hi) where
    threads() > 1, else without the span. None: nothing."""
def pin_default(data: Any, /) -> Any:
    """pin_tree into the current device's default arena; NotImplemented where the
    batch needs the Python walk; None where it cannot (nothing set, a device
    configured, no arena for the current one, a forked child, the arena full)."""
def pin_counts() -> tuple[int, int, int, int, int]:
    """(batches, leaves, bytes, by_torch, by_team) that Arena.pin_tree and
    pin_batch placed in this process; by_torch: the batches torch's threads
    filled (its copy_, or its OpenMP team); by_team: those the team filled."""
def cuda_status() -> _CudaStatus: ...
def capture_begin() -> None:
    """A CUDA graph capture begins in this process: free fences wait until it ends."""
def capture_end() -> None: ...
def captures() -> int: ...
def set_threads(n: int, /) -> None: ...
def get_threads() -> int: ...
def set_streaming(on: bool, /) -> None: ...
def streaming() -> bool: ...
def set_spin(ns: int, /) -> None:
    """Nanoseconds the copy pool's threads stay ready after a chunk (0: sleep at once)."""
def get_spin() -> int: ...
def set_copy_tuning(*, inline_max: int = ..., inline_spin: int = ..., stream_min: int = ...,
                    chunk_min: int = ..., chunk_max: int = ..., chunk_min_spin: int = ...) -> None:
    """The copy pool's cut-overs in bytes of a run; those not given keep their value."""
def set_team_grain(nbytes: int, /) -> None:
    """The least bytes each thread of torch's OpenMP team copies of a batch in
    the torch span; 0: torch's copy_ fills the span instead."""
def copy_tuning() -> dict[str, int | bool]:
    """The pool's cut-overs, spin_ns, streaming, threads and spinners, team_grain,
    and team (whether torch's OpenMP team was found)."""
def current_device() -> int:
    """The device whose context is current in the calling thread; -1 where none is."""
def set_affinity(cpus: Sequence[int] | None, /) -> None:
    """Pin the copy pool's threads to these CPUs (None: undo), now and for later pools."""
def pci_bus_id(device: int, /) -> str:
    """The PCI address of a CUDA device, from the driver."""
def cpu_count() -> int: ...
def copy(dst: int, src: int, nbytes: int, /) -> None: ...
