"""Seconds to make a page-locked arena of N GiB (its pages populated and
registered with CUDA) and to drop it, in this process. Run it in a fresh
process per figure: a second arena in the same process finds the pages the
first one freed.

    python benchmarks/register_time.py [--gib 8] [--private] [--tree DIR]

--shared (the default) is zero-copy's kind of arena (a memfd the workers map);
--private is pin_memory's default arena. --tree puts another checkout, built in
place, first on sys.path, to time its code on the same machine.
"""
from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0, help="the arena's size (default 8)")
    parser.add_argument("--private", action="store_true",
                        help="a private arena (pin_memory's kind) rather than a shared one")
    parser.add_argument("--tree", help="a checkout built in place whose fastpin to time")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    from fastpin import _C

    status = _C.cuda_status()
    if status["state"] != "ready":
        sys.exit(f"needs a GPU: {status['reason']}")
    nbytes = int(args.gib * (1 << 30))
    t0 = time.perf_counter()
    arena = _C.Arena(nbytes, shared=not args.private, device=0)
    t1 = time.perf_counter()
    del arena
    t2 = time.perf_counter()
    kind = "private" if args.private else "shared"
    print(f"{args.tree or '.'}: {args.gib:g} GiB {kind}: made {t1 - t0:.3f} s "
          f"({nbytes / 1e9 / (t1 - t0):.1f} GB/s), dropped {t2 - t1:.3f} s")


if __name__ == "__main__":
    main()
