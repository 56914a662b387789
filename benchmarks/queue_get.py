"""What the main process pays to take one message off a DataLoader iterator's
result queue, as torch asks for it (`get(timeout=...)`): multiprocessing's
Queue against fastpin's ResultQueue (a poll object made once). Best of
--rounds, microseconds a get, the message's unpickling included.

    python benchmarks/queue_get.py [--gets 20000] [--rounds 7] [--bytes 200]
"""
from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.reduction import ForkingPickler

from fastpin import _queues


def us_per_get(q, data: bytes, gets: int, rounds: int) -> float:
    """Messages written 100 at a time as a worker writes them, then taken."""
    best = float("inf")
    for _ in range(rounds):
        spent = 0.0
        for _ in range(gets // 100):
            for _ in range(100):
                q._sem.acquire()
                with q._wlock:
                    q._writer.send_bytes(data)
            t0 = time.perf_counter()
            for _ in range(100):
                q.get(timeout=5.0)
            spent += time.perf_counter() - t0
        best = min(best, spent / (gets // 100 * 100) * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bytes", type=int, default=200, help="payload of each message")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("fork")
    stock, ours = ctx.Queue(), ctx.Queue()
    ours.__class__ = _queues.ResultQueue
    data = bytes(ForkingPickler.dumps((3, b"x" * args.bytes)))
    print(f"{'queue':<34} us a get")
    for name, q in (("multiprocessing.Queue", stock), ("fastpin ResultQueue", ours)):
        print(f"{name:<34} {us_per_get(q, data, args.gets, args.rounds):.2f}")
    for q in (stock, ours):
        q.close()


if __name__ == "__main__":
    main()
