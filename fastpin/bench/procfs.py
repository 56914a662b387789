"""This process's threads and child processes as /proc sees them. The
benchmarks' CPU figures count every thread of the process, by name (fastpin
names its threads where the kernel sees them), and the DataLoader's workers
apart."""
from __future__ import annotations

import collections
import os
import threading
from typing import NamedTuple, Optional

_TICK = os.sysconf("SC_CLK_TCK")


class Thread(NamedTuple):
    name: str     # the kernel's name of the thread (comm)
    run_ns: int   # time on a CPU, nanoseconds (schedstat)
    cpu_s: float  # utime + stime, seconds at clock-tick resolution
    minflt: int   # minor page faults
    slices: int   # times scheduled


def threads() -> dict:
    """{tid: Thread} for every thread of this process now; a thread that ends
    while it is read is left out. A Python thread the kernel knows only by the
    process's name (Python sets no thread names) is named as threading names
    it: MainThread, QueueFeederThread (a multiprocessing queue's), Thread-3..."""
    try:
        with open("/proc/self/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = None
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                stat = f.read()
            with open(f"{base}/schedstat") as f:
                run = f.read().split()
            # fields[0] is stat's field 3 (state): minflt is field 10, utime 14, stime 15.
            fields = stat[stat.rindex(")") + 2:].split()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name == comm:
                name = python.get(int(tid), name)
            out[int(tid)] = Thread(name, int(run[0]),
                                   (int(fields[11]) + int(fields[12])) / _TICK, int(fields[7]),
                                   int(run[2]))
        except (OSError, ValueError, IndexError):
            continue  # ended while read: its files empty or gone
    return out


def cpu_ns_by_name(before: dict, after: dict) -> dict:
    """{name: CPU nanoseconds} of this process's threads between two threads()
    reads (a thread that started in between counted from zero; one that ended
    is not counted)."""
    out: collections.Counter = collections.Counter()
    for tid, t in after.items():
        out[t.name] += t.run_ns - (before[tid].run_ns if tid in before else 0)
    return dict(out)


def children_cpu(since: Optional[dict] = None):
    """CPU seconds of this process's live child processes (DataLoader workers):
    with `since` (an earlier call's result), the seconds they used after it, a
    child that started later counted from zero; without, {pid: seconds} now.
    Read from /proc; children that ended in between are not counted (their
    epoch outlives the timed window, so none of the workers' do)."""
    now: dict = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0 if since is not None else now
    pids: set = set()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            continue
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        now[pid] = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    if since is None:
        return now
    return sum(seconds - since.get(pid, 0.0) for pid, seconds in now.items())
