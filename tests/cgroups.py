"""Memory cgroups for tests: make one (as root, where the machine lets us)
below this process's own, and run a command inside it. Where cgroups cannot
be made (not root, a read-only or absent hierarchy, no memory controller),
`memory_cgroup` skips the test and says why."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import uuid

import pytest

from fastpin import _runtime


def _memory_hierarchy() -> tuple:
    """(fs type, the directory of this process's memory cgroup), or the reason
    none can be used. v1's memory controller first (its limits apply to
    children wherever they are); else a cgroup2 mount whose root delegates
    memory to its children."""
    def read(path):
        with open(path) as f:
            return f.read()

    try:
        own = _runtime._own_cgroups(read("/proc/self/cgroup"))
        mounts = _runtime._memory_mounts(read("/proc/self/mountinfo"))
    except OSError as e:
        return None, f"cannot read /proc/self: {e}"
    for fstype in ("cgroup", "cgroup2"):
        for kind, mounted, point in mounts:
            if kind != fstype or fstype not in own or mounted != "/":
                continue
            if fstype == "cgroup2":
                try:
                    if "memory" not in read(os.path.join(point, "cgroup.subtree_control")).split():
                        continue
                except OSError:
                    continue
                # A child of the mount's root: v2 keeps processes out of inner
                # cgroups that delegate controllers, and the root always may.
                return (fstype, point), None
            return (fstype, os.path.join(point, own[fstype].lstrip("/"))), None
    return None, "no memory cgroup hierarchy mounted here that this process can nest in"


class MemoryCgroup:
    """A memory cgroup made below `parent` (removed by close())."""

    def __init__(self, fstype: str, parent: str):
        self.fstype = fstype
        self.path = os.path.join(parent, f"fastpin-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        self.children: list = []

    def limit(self, nbytes: int) -> None:
        name = "memory.max" if self.fstype == "cgroup2" else "memory.limit_in_bytes"
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(nbytes))
        if self.fstype == "cgroup":
            # v1: no swap to spill into either, as under a container's limit.
            try:
                with open(os.path.join(self.path, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(nbytes))
            except OSError:
                pass

    def child(self) -> "MemoryCgroup":
        if self.fstype == "cgroup2":
            with open(os.path.join(self.path, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        child = MemoryCgroup(self.fstype, self.path)
        self.children.append(child)
        return child

    def run(self, args: list, **kwargs) -> subprocess.CompletedProcess:
        """Run `args` in this cgroup: a shell moves itself in, then execs them."""
        procs = os.path.join(self.path, "cgroup.procs")
        script = f"echo $$ > {shlex.quote(procs)} && exec {shlex.join(args)}"
        return subprocess.run(["/bin/sh", "-c", script], **kwargs)

    def oom_kills(self) -> int:
        """How many processes the kernel killed here for want of memory."""
        name = "memory.events" if self.fstype == "cgroup2" else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def close(self) -> None:
        for child in self.children:
            child.close()
        # Killed workers may take a moment to be reaped; a cgroup with a
        # process in it cannot go.
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def memory_cgroup() -> MemoryCgroup:
    """A new memory cgroup below this process's own; skips the test where none
    can be made."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    found, why = _memory_hierarchy()
    if found is None:
        pytest.skip(why)
    fstype, parent = found
    try:
        return MemoryCgroup(fstype, parent)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup under {parent}: {e}")


PYTHON = sys.executable
