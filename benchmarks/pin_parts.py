"""What one small pin_memory call costs, piece by piece, on this machine: the
pieces fastpin.pin_memory runs for a batch of one tensor (or a dict of 8),
beside torch's own calls. Medians of --calls calls, microseconds.

    python benchmarks/pin_parts.py [--calls 5000] [--sizes 65536 1048576] [--busy-thread]

--busy-thread times every part beside a thread that runs pure Python all the
while (a training loop beside DataLoader's pin thread), and gives the mean
beside the median: a call that lets the GIL go waits, now and then, for the
other thread's turn to end, which the median does not show.

Where the small-batch overhead of benchmarks/pin_small.py goes: read this
next to it on a GPU machine, where a CUDA context is up.
"""
from __future__ import annotations

import argparse
import statistics
import threading

import torch

import fastpin
from fastpin import _C, _arena, _pin, _walk
from pin_small import call_times_ns, median_us  # beside this file: python puts its folder first on sys.path


def parts(x, arena, cuda: bool) -> dict:
    leaves = [x]
    span = _pin._torch_copy or ()  # what pin_memory passes where torch has several threads
    # x (uint8) copied by torch into memory held throughout: the copy alone,
    # against torch's pin (allocation and copy) and fastpin's (the same plus
    # its block and its tensor).
    block = torch.from_dlpack(arena.alloc(x.nbytes))[:x.nbytes]
    pinned = torch.empty_like(x, pin_memory=True) if cuda else None
    return {
        "torch.empty_like(x).copy_(x)": lambda: torch.empty_like(x).copy_(x),
        "held pinned tensor.copy_(x)": (lambda: pinned.copy_(x)) if cuda else None,
        "held fastpin block.copy_(x)": lambda: block.copy_(x),
        # A destination made anew each call, as pin_memory's is: the view alone,
        # then the view and copy_ into it.
        "block[:n] (a new view)": lambda: block[:x.nbytes],
        "block[:n].copy_(x)": lambda: block[:x.nbytes].copy_(x),
        "x.pin_memory()": (lambda: x.pin_memory()) if cuda else None,
        "x.is_pinned()": lambda: x.is_pinned(),
        "x.requires_grad, x.is_neg()": lambda: (x.requires_grad, x.is_neg()),
        "fastpin.pin_memory(x)": lambda: fastpin.pin_memory(x),
        "arena.pin_tree(x, check_pinned)": lambda: arena.pin_tree(x, cuda),
        "arena.pin_tree(x, check_pinned, *torch span)": lambda: arena.pin_tree(x, cuda, *span),
        "arena.pin_tree(x, False, *torch span)": lambda: arena.pin_tree(x, False, *span),
        "arena.pin_batch([x], check_pinned)": lambda: arena.pin_batch(leaves, cuda),
        "arena.pin_batch([x], False)": lambda: arena.pin_batch(leaves, False),
        "arena.alloc(n) and its free": lambda: arena.alloc(x.nbytes),
        "arena.alloc(n), freed with no fence": lambda: unfenced(arena, x.nbytes),
        "torch.empty(n, pin_memory=True) and its free":
            (lambda: torch.empty(x.nbytes, dtype=torch.uint8, pin_memory=True)) if cuda else None,
        "_C.pin_default(x)": lambda: _C.pin_default(x),
        "flatten(x)": lambda: _walk.flatten(x, _pin.is_leaf),
        "cuda_available()": _arena.cuda_available,
        "made_default_arena(None)": lambda: _arena.made_default_arena(None),
    }


def median_mean_us(fn, calls: int) -> tuple:
    """Median and mean us of fn() over `calls` calls, after a warm-up."""
    times = call_times_ns(fn, calls)
    return statistics.median(times) / 1e3, statistics.fmean(times) / 1e3


def busy() -> None:
    """Pure Python for ever: it holds the GIL whenever another thread lets it go."""
    n = 0
    while True:
        n += 1


def unfenced(arena, nbytes: int) -> None:
    """A block taken and freed with no fence recorded: what the fence and its
    query add to "arena.alloc(n) and its free"."""
    block = arena.alloc(nbytes)
    block.consumer_stream = None


def blocks_cycled(x, calls: int) -> int:
    """Distinct addresses fastpin.pin_memory(x) returns over `calls` calls, each
    result dropped before the next: 1 when the freed block is reused at once."""
    return len({fastpin.pin_memory(x).data_ptr() for _ in range(calls)})


def copy_into_block(x, arena, calls: int) -> float:
    """The memcpy alone, into one arena block held throughout (the copy pool's
    path for one entry), in us."""
    block = arena.alloc(x.nbytes)
    return median_us(lambda: _C.copy(block.ptr, x.data_ptr(), x.nbytes), calls)


def pool_against_caller(arena, sizes: list, calls: int) -> None:
    """The memcpy into one held block with the copy pool and with the caller
    alone (a pool of one thread), beside torch's one-thread pin: where the
    pool starts to pay for its wakeups."""
    threads = _C.get_threads()
    print(f"\n_C.copy into one held block, us: pool of {threads} against the caller alone")
    for size in sizes:
        x = torch.arange(size, dtype=torch.uint8)
        block = arena.alloc(size)  # held until the del below
        ptr = block.ptr
        copy = lambda: _C.copy(ptr, x.data_ptr(), size)  # noqa: E731
        pooled = median_us(copy, calls)
        _C.set_threads(1)
        alone = median_us(copy, calls)
        _C.set_threads(threads)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        pin = median_us(lambda: x.pin_memory(), calls) if fastpin.cuda_available() else float("nan")
        torch.set_num_threads(saved)
        print(f"  {size:9d} bytes: pool {pooled:8.2f}  alone {alone:8.2f}  torch pin, 1 thread {pin:8.2f}")
        del copy, block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 1 << 20])
    p.add_argument("--pool-sizes", type=int, nargs="*", default=[],
                   help="also time the copy pool against the caller alone at these sizes")
    p.add_argument("--busy-thread", action="store_true",
                   help="time every part beside a thread that runs pure Python")
    args = p.parse_args()
    if args.busy_thread:
        threading.Thread(target=busy, daemon=True, name="busy").start()
    cuda = fastpin.cuda_available()
    print(f"torch {torch.__version__}, fastpin from {fastpin.__file__}, CUDA up: {cuda}, "
          f"copy threads {_C.get_threads()}, streaming stores {_C.streaming()}"
          + (", beside a busy Python thread" if args.busy_thread else ""))
    fastpin.pin_memory(torch.zeros(8))  # makes the default arena
    arena = _arena.default_arena()
    for size in args.sizes:
        x = torch.arange(size, dtype=torch.uint8)
        print(f"\n{size} bytes, median us of {args.calls} calls")
        for name, fn in parts(x, arena, cuda).items():
            if fn is not None and args.busy_thread:
                median, mean = median_mean_us(fn, args.calls)
                print(f"  {name:46s} {median:8.2f}  mean {mean:9.2f}")
            elif fn is not None:
                print(f"  {name:46s} {median_us(fn, args.calls):8.2f}")
        print(f"  {'_C.copy into one held block':46s} {copy_into_block(x, arena, args.calls):8.2f}")
        print(f"  distinct blocks over 1000 pin_memory calls: {blocks_cycled(x, 1000)}")
        if cuda:
            torch_blocks = len({x.pin_memory().data_ptr() for _ in range(1000)})
            print(f"  distinct blocks over 1000 x.pin_memory() calls: {torch_blocks}")
    if args.pool_sizes:
        pool_against_caller(arena, args.pool_sizes, min(args.calls, 2000))


if __name__ == "__main__":
    main()
