"""The memory limit fastpin sizes its caps from is the process's own: the
tightest limit of its cgroup and of every cgroup above it (Slurm's job and
step cgroups, a systemd scope, a container's), in either cgroup version. It
was read at the root of the cgroup mount alone, so a job nested below it got
caps sized from the machine, and registration would make them resident past
the job's limit.
"""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

import fastpin
from fastpin import _runtime, _segments

from cgroups import PYTHON, memory_cgroup

FASTPIN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(fastpin.__file__)))
GiB = 1 << 30
MACHINE = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- a fake tree: every layout, anywhere ------------------------------------------

V2_MOUNTINFO = "41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"
V1_MOUNTINFO = textwrap.dedent("""\
    31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
    32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
    35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
    """)


def fake(tmp_path, cgroup: str, mountinfo: str, files: dict) -> str:
    """A root holding proc/self/{cgroup,mountinfo} and the limit files named
    (path below the root -> content); returns the root."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for path, content in files.items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content + "\n")
    return str(tmp_path)


def test_v2_the_tightest_limit_above_the_process_wins(tmp_path):
    root = fake(tmp_path, "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n",
                V2_MOUNTINFO, {
                    "sys/fs/cgroup/memory.max": "max",  # the mount's root: nothing set
                    "sys/fs/cgroup/system.slice/memory.max": "max",
                    "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/memory.max": str(3 * GiB),
                    "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/memory.max": "max",
                    "sys/fs/cgroup/system.slice/slurmstepd.scope/job_7/step_0/user/task_0/"
                    "memory.max": "max",
                })
    assert _runtime.cgroup_memory_limit(root) == 3 * GiB
    assert _runtime.memory_bytes(root) == min(MACHINE, 3 * GiB)


def test_v2_memory_high_counts_where_it_is_tighter(tmp_path):
    root = fake(tmp_path, "0::/user.slice/run.scope\n", V2_MOUNTINFO, {
        "sys/fs/cgroup/user.slice/memory.max": str(8 * GiB),
        "sys/fs/cgroup/user.slice/run.scope/memory.max": "max",
        "sys/fs/cgroup/user.slice/run.scope/memory.high": str(5 * GiB),
    })
    assert _runtime.cgroup_memory_limit(root) == 5 * GiB


def test_v1_nested_job_limit(tmp_path):
    unlimited = "9223372036854771712"
    root = fake(tmp_path, "5:cpu,cpuacct:/slurm/uid_0/job_7\n"
                          "4:memory:/slurm/uid_0/job_7/step_batch\n0::/\n", V1_MOUNTINFO, {
                              "sys/fs/cgroup/memory/memory.limit_in_bytes": unlimited,
                              "sys/fs/cgroup/memory/slurm/memory.limit_in_bytes": unlimited,
                              "sys/fs/cgroup/memory/slurm/uid_0/job_7/memory.limit_in_bytes":
                                  str(2 * GiB),
                              "sys/fs/cgroup/memory/slurm/uid_0/job_7/step_batch/"
                              "memory.limit_in_bytes": unlimited,
                          })
    assert _runtime.cgroup_memory_limit(root) == 2 * GiB


def test_a_container_sees_its_own_cgroup_at_the_mount(tmp_path):
    """Docker without a cgroup namespace: the mount shows the container's own
    cgroup (mountinfo's root field), /proc/self/cgroup the full path."""
    mountinfo = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    root = fake(tmp_path, "4:memory:/docker/abc\n", mountinfo, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(GiB),
    })
    assert _runtime.cgroup_memory_limit(root) == GiB


def test_both_hierarchies_the_tighter_one(tmp_path):
    mountinfo = V1_MOUNTINFO + "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    root = fake(tmp_path, "4:memory:/a\n0::/b\n", mountinfo, {
        "sys/fs/cgroup/memory/a/memory.limit_in_bytes": str(6 * GiB),
        "sys/fs/cgroup/unified/b/memory.max": str(4 * GiB),
    })
    assert _runtime.cgroup_memory_limit(root) == 4 * GiB


def test_a_mount_point_with_a_space(tmp_path):
    mountinfo = "41 31 0:38 / /cg\\040root rw - cgroup2 cgroup2 rw\n"
    root = fake(tmp_path, "0::/job\n", mountinfo, {"cg root/job/memory.max": str(GiB)})
    assert _runtime.cgroup_memory_limit(root) == GiB


def test_no_limit_anywhere_is_the_machine(tmp_path):
    root = fake(tmp_path, "0::/user.slice\n", V2_MOUNTINFO, {
        "sys/fs/cgroup/user.slice/memory.max": "max",
    })
    assert _runtime.cgroup_memory_limit(root) is None
    assert _runtime.memory_bytes(root) == MACHINE


def test_nothing_readable_is_the_machine(tmp_path):
    assert _runtime.cgroup_memory_limit(str(tmp_path)) is None
    assert _runtime.memory_bytes(str(tmp_path)) == MACHINE


# ---- a real nested cgroup (as root, where cgroups can be made) ---------------------

PROBE = ("import fastpin._runtime as r, fastpin._zerocopy as z; "
         "print(r.memory_bytes(), r.machine_cap(False), z.default_cap(False))")


@pytest.mark.timeout(120)
def test_a_process_in_a_nested_cgroup_sizes_its_caps_from_the_jobs_limit():
    """A job cgroup with a limit, a step cgroup below it without one, the
    process in the step: its caps are a quarter of the job's limit."""
    job = memory_cgroup()
    try:
        limit = 1000 << 20
        job.limit(limit)
        step = job.child()
        env = dict(os.environ, PYTHONPATH=FASTPIN_HOME)
        env.pop("FASTPIN_ZERO_COPY_MAX_BYTES", None)
        out = step.run([PYTHON, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=100)
        assert out.returncode == 0, out.stderr
        memory, cap, zero_copy_cap = map(int, out.stdout.split())
        assert memory == limit
        assert cap == zero_copy_cap == limit // 4
    finally:
        job.close()
