"""Where a py-spy profile's samples go: `py-spy record -f raw` output (one line
a distinct stack: frames joined by ';', then its count), summed by thread
(with --threads, each stack starts with its thread), by function including
what it calls, and by function alone.

    python scripts/spy_top.py PROFILE.txt [--within TEXT] [--top 40]

--within keeps only the stacks with a frame containing TEXT (the timed loop's
function, say), so that start-up and imports do not count."""
from __future__ import annotations

import argparse
import collections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("--within", help="only stacks with a frame containing this")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    inclusive: collections.Counter = collections.Counter()
    alone: collections.Counter = collections.Counter()
    by_thread: collections.Counter = collections.Counter()
    total = 0
    with open(args.profile) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            if args.within and args.within not in stack:
                continue
            frames = stack.split(";")
            n = int(count)
            total += n
            if frames[0].startswith("thread ") or frames[0].startswith("process "):
                by_thread[frames[0]] += n
            for frame in set(frames):
                inclusive[frame] += n
            alone[frames[-1]] += n
    print(f"{total} samples" + (f" in stacks with {args.within!r}" if args.within else ""))
    for title, counter, top in (("by thread", by_thread, 20), ("with what it calls", inclusive, args.top),
                                ("alone", alone, 25)):
        if counter:
            print(f"-- {title}")
            for frame, n in counter.most_common(top):
                print(f"{n:7d} {n / max(total, 1):6.1%}  {frame[:160]}")


if __name__ == "__main__":
    main()
