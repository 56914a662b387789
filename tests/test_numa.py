"""NUMA placement: the sysfs logic against fake trees (bus id -> node -> CPUs,
cpulist ranges, -1, missing files, one node), and the core's two actions on this
machine: an arena's pages preferring a node (mbind, seen in /proc/self/numa_maps)
and the copy threads' affinity (seen in /proc/self/task/*/status)."""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from types import SimpleNamespace

import numpy as np
import pytest

import fastpin
from fastpin import _C, _arena, _numa, _runtime
from conftest import patterned

MiB = 1 << 20


# ---- parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("text, cpus", [
    ("0-7,16-23", list(range(8)) + list(range(16, 24))),
    ("3", [3]),
    ("0-3,5\n", [0, 1, 2, 3, 5]),
    (" 8-9 , 2 ", [2, 8, 9]),
    ("", []),
    ("\n", []),
    ("0-15:2/4", [0, 1, 4, 5, 8, 9, 12, 13]),
    ("4-4", [4]),
    ("1,1,0-1", [0, 1]),
])
def test_parse_cpulist(text, cpus):
    assert _numa.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["3-1", "a", "1-", "-2", "0-3:0/4", "0-3:4/2", "1;2", "0-3:2"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError, match="cpulist"):
        _numa.parse_cpulist(text)


@pytest.mark.parametrize("bus_id, sysfs", [
    ("0000:3B:00.0", "0000:3b:00.0"),          # the driver's spelling
    ("00000000:3B:00.0", "0000:3b:00.0"),      # nvidia-smi's
    ("0000:86:1f.7\x00", "0000:86:1f.7"),
    ("10000:01:00.0", "10000:01:00.0"),        # VMD domains have five digits
    ("0:4:0.0", "0000:04:00.0"),
])
def test_normalize_bus_id(bus_id, sysfs):
    assert _numa.normalize_bus_id(bus_id) == sysfs


@pytest.mark.parametrize("bus_id", ["", "3b:00.0", "0000:zz:00.0", "a:b:c:d"])
def test_normalize_bus_id_rejects(bus_id):
    with pytest.raises(ValueError, match="PCI bus id"):
        _numa.normalize_bus_id(bus_id)


def test_bus_id_from_torch_properties():
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    assert _numa.bus_id_from_properties(props) == "0000:3b:00.0"


# ---- a fake sysfs ----------------------------------------------------------------------

GPU0, GPU1, NO_NODE, NO_FILE, BAD = ("0000:3b:00.0", "0000:86:00.0", "0000:01:00.0",
                                      "0000:02:00.0", "0000:03:00.0")


def fake_sysfs(root, nodes, devices, online=True):
    """nodes: {node: cpulist}; devices: {bus id: numa_node text, or None for no file}."""
    base = root / "devices" / "system" / "node"
    base.mkdir(parents=True)
    if online:
        (base / "online").write_text(",".join(str(n) for n in sorted(nodes)) + "\n")
    (base / "possible").write_text("0-7\n")
    for node, cpulist in nodes.items():
        (base / f"node{node}").mkdir()
        (base / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    for bus_id, node in devices.items():
        d = root / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True)
        if node is not None:
            (d / "numa_node").write_text(f"{node}\n")
    return str(root)


@pytest.fixture
def two_nodes(tmp_path):
    return fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"},
                      {GPU0: 0, GPU1: 1, NO_NODE: -1, NO_FILE: None, BAD: "x"})


ALL = range(16)


def test_placement_follows_the_device(two_nodes):
    assert _numa.placement(GPU0, two_nodes, ALL) == (0, (0, 1, 2, 3, 8, 9, 10, 11))
    assert _numa.placement(GPU1, two_nodes, ALL) == (1, (4, 5, 6, 7, 12, 13, 14, 15))
    # The driver's spelling finds the same directory.
    assert _numa.placement("00000000:86:00.0", two_nodes, ALL).node == 1
    assert _numa.device_node(GPU1, two_nodes) == 1


@pytest.mark.parametrize("bus_id", [NO_NODE, NO_FILE, BAD, "0000:99:00.0", None, ""])
def test_unknown_node_is_no_placement(two_nodes, bus_id):
    where = _numa.placement(bus_id, two_nodes, ALL)
    assert where == _numa.NONE and not where and where.node == -1 and where.cpus == ()


def test_only_allowed_cpus(two_nodes):
    assert _numa.placement(GPU0, two_nodes, {1, 2, 5, 9}) == (0, (1, 2, 9))
    # None of the node's CPUs is ours (a cpuset elsewhere): memory still goes to
    # the node, threads stay where they are.
    where = _numa.placement(GPU0, two_nodes, {4, 5})
    assert where == (0, ()) and where


def test_default_allowed_is_this_threads_affinity(two_nodes):
    mine = os.sched_getaffinity(0)
    where = _numa.placement(GPU0, two_nodes)
    assert set(where.cpus) == mine & {0, 1, 2, 3, 8, 9, 10, 11}


def test_one_node_is_a_no_op(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-15"}, {GPU0: 0})
    assert _numa.placement(GPU0, root, ALL) == _numa.NONE


def test_node_not_online_is_a_no_op(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {GPU0: 3})
    assert _numa.placement(GPU0, root, ALL) == _numa.NONE


def test_no_online_file_counts_node_directories(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1", 1: "2-3", 2: "4-5"}, {GPU0: 2}, online=False)
    assert _numa.online_nodes(root) == [0, 1, 2]
    assert _numa.placement(GPU0, root, ALL) == (2, (4, 5))


def test_missing_cpulist_places_memory_only(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {GPU0: 1})
    os.remove(os.path.join(root, "devices/system/node/node1/cpulist"))
    assert _numa.placement(GPU0, root, ALL) == (1, ())


def test_no_sysfs_is_a_no_op(tmp_path):
    missing = str(tmp_path / "nothing")
    assert _numa.online_nodes(missing) == []
    assert _numa.node_cpus(0, missing) == []
    assert _numa.device_node(GPU0, missing) == -1
    assert _numa.placement(GPU0, missing, ALL) == _numa.NONE


def test_sysfs_root_from_the_environment(two_nodes, monkeypatch):
    monkeypatch.setenv(_numa.SYSFS_ROOT_ENV, two_nodes)
    assert _numa.sysfs_root() == two_nodes
    assert _numa.placement(GPU1, allowed=ALL).node == 1
    monkeypatch.delenv(_numa.SYSFS_ROOT_ENV)
    assert _numa.sysfs_root() == "/sys"


def test_this_machine_real_sysfs():
    """Whatever this machine is, the answer is consistent with its sysfs."""
    devices = "/sys/bus/pci/devices"
    if not os.path.isdir(devices):
        pytest.skip("no PCI devices in sysfs")
    nodes = _numa.online_nodes()
    for bus_id in sorted(os.listdir(devices))[:20]:
        where = _numa.placement(bus_id)
        if len(nodes) <= 1:
            assert where == _numa.NONE
        elif where:
            assert where.node in nodes
            assert set(where.cpus) <= os.sched_getaffinity(0)


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("false", False),
                                       ("1", True), ("", True), ("yes", True)])
def test_fastpin_numa_environment(monkeypatch, value, on):
    monkeypatch.setenv("FASTPIN_NUMA", value)
    assert _runtime.env_flag("FASTPIN_NUMA", True) is on


# ---- the arena's memory: mbind ---------------------------------------------------------

def vma_policy(address: int) -> str:
    """The policy and page counts /proc/self/numa_maps shows for the mapping that
    holds `address`."""
    start = None
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                start = lo
                break
    assert start is not None, "address not mapped"
    with open("/proc/self/numa_maps") as f:
        for line in f:
            if int(line.split()[0], 16) == start:
                return line
    raise AssertionError("mapping not in numa_maps")


def mbind_works_here() -> bool:
    """Asks the kernel directly (no fastpin): may this process set a memory policy?"""
    numbers = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
    nr = numbers.get(platform.machine())
    if nr is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    size = 1 << 16
    buf = ctypes.create_string_buffer(size + 4096)
    start = (ctypes.addressof(buf) + 4095) & ~4095
    mask = ctypes.c_ulong(1)
    # MPOL_PREFERRED (1) on a page of our own, node 0.
    rc = libc.syscall(nr, ctypes.c_void_p(start), ctypes.c_ulong(4096), 1, ctypes.byref(mask),
                      ctypes.c_ulong(65), 0)
    if rc != 0:
        return False
    libc.syscall(nr, ctypes.c_void_p(start), ctypes.c_ulong(4096), 0, None, ctypes.c_ulong(0), 0)
    return True


needs_numa_maps = pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"),
                                     reason="no /proc/self/numa_maps (kernel without NUMA)")


def fill_and_check(arena, seed):
    """Allocate most of the arena, write a pattern, read it back."""
    src = patterned((arena.capacity // 2 // 4,), np.int32, seed)
    block, (offset,) = arena.pin([(src.ctypes.data, src.nbytes)])
    out = block.numpy(offset, src.shape, (4,), np.int32)
    assert out.tobytes() == src.tobytes()
    return block


@needs_numa_maps
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_arena_pages_prefer_the_node(shared):
    a = _C.Arena(8 * MiB, cuda=False, shared=shared, numa_node=0)
    if a.stats()["numa_node"] == -1 and not mbind_works_here():
        pytest.skip("the kernel refuses mbind to this process (seccomp, or no NUMA)")
    assert a.stats()["numa_node"] == 0
    assert "prefer:0" in vma_policy(a.base)
    block = fill_and_check(a, 1)
    line = vma_policy(a.base)
    pages = dict(kv.split("=") for kv in line.split()[2:] if "=" in kv)
    assert int(pages.get("N0", 0)) >= (a.capacity // 2) // 4096  # faulted in on node 0
    del block
    assert a.is_valid()


@needs_numa_maps
def test_no_node_leaves_the_default_policy():
    a = _C.Arena(4 * MiB, cuda=False)
    assert a.stats()["numa_node"] == -1
    assert "prefer" not in vma_policy(a.base) and "bind" not in vma_policy(a.base)


@pytest.mark.parametrize("node", [1000, 5000, -7], ids=["absent", "past-the-mask", "negative"])
def test_a_refused_node_still_makes_a_working_arena(node):
    a = _C.Arena(4 * MiB, cuda=False, numa_node=node)
    assert a.stats()["numa_node"] == -1
    block = fill_and_check(a, 2)
    del block
    assert a.is_valid()


def test_an_attached_arena_reports_no_node():
    a = _C.Arena(4 * MiB, cuda=False, shared=True, numa_node=0)
    peer = _C.Arena.attach(a.fd)
    assert peer.stats()["numa_node"] == -1


# ---- the copy threads: affinity -------------------------------------------------------

def copy_thread_cpus() -> list:
    """Cpus_allowed_list of every fastpin-copy thread of this process."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "fastpin-copy":
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out.append(tuple(_numa.parse_cpulist(line.split(":", 1)[1])))
        except FileNotFoundError:
            continue  # a thread that just ended
    return out


def wait_for_threads(n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(copy_thread_cpus()) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return copy_thread_cpus()


@pytest.fixture
def pool():
    """A pool of 3 (two threads); afterwards: unpinned, the default size, no placement."""
    _C.set_threads(3)
    assert _C.get_threads() == 3
    # The old pool's threads are joined, but a joined thread can stay listed in
    # /proc/self/task for a moment after it exits: wait until only ours remain.
    assert len(wait_for_threads(2)) == 2
    yield
    _numa._pinned.clear()
    _C.set_affinity(None)
    _C.set_threads(0)
    _C.get_threads()


def big_copy_is_exact(seed):
    src = patterned((8 * MiB // 4,), np.int32, seed)
    dst = np.empty_like(src)
    _C.copy(dst.ctypes.data, src.ctypes.data, src.nbytes)   # large: the pool takes part
    return dst.tobytes() == src.tobytes()


def test_pool_threads_follow_set_affinity(pool):
    mine = tuple(sorted(os.sched_getaffinity(0)))
    one = mine[-1]
    assert wait_for_threads(2) == [mine, mine]
    _C.set_affinity([one])
    assert copy_thread_cpus() == [(one,), (one,)]
    assert tuple(sorted(os.sched_getaffinity(0))) == mine     # the caller is left alone
    assert big_copy_is_exact(3)
    # A pool made later (new size) is pinned too.
    _C.set_threads(2)
    assert _C.get_threads() == 2
    assert wait_for_threads(1) == [(one,)]
    assert big_copy_is_exact(4)
    _C.set_affinity(None)
    assert copy_thread_cpus() == [mine]


def test_set_affinity_rejects(pool):
    before = copy_thread_cpus()
    with pytest.raises(ValueError, match="no CPU"):
        _C.set_affinity([-1])
    with pytest.raises(ValueError, match="no CPU"):
        _C.set_affinity([1 << 30])
    outside = max(os.sched_getaffinity(0)) + 1 + 4096   # a CPU this process may not use
    with pytest.raises(ValueError, match="may be used"):
        _C.set_affinity([outside])
    with pytest.raises(TypeError):
        _C.set_affinity(3)
    assert copy_thread_cpus() == before                     # unchanged by the failures
    assert big_copy_is_exact(5)


def test_set_affinity_in_a_forked_child_pins_the_childs_pool(pool):
    one = max(os.sched_getaffinity(0))
    _C.set_affinity([one])
    pid = os.fork()
    if pid == 0:  # the child: a new pool, pinned like the parent's
        try:
            ok = big_copy_is_exact(6) and wait_for_threads(2) == [(one,), (one,)]
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---- from a GPU to a placement: fastpin's own flow, with a fake GPU and sysfs -----------

@pytest.fixture
def fake_gpu(tmp_path, monkeypatch, pool):
    """CUDA device 0 sits at GPU0 on node 0 of a fake two-node sysfs whose node 0 has
    this machine's last CPU, device 1 at GPU1 on node 1 (absent from this machine)."""
    last = max(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path, {0: str(last), 1: "4096-4099"}, {GPU0: 0, GPU1: 1})
    monkeypatch.setenv(_numa.SYSFS_ROOT_ENV, root)
    monkeypatch.setattr(_numa, "gpu_bus_id", {0: GPU0, 1: GPU1}.get)
    was = _numa.enabled()
    yield last
    _numa.set_enabled(was)


def test_placed_arena_and_threads(fake_gpu, caplog):
    last = fake_gpu
    assert _numa.for_device(0) == (0, (last,))
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        a = _arena.make_placed_arena(4 * MiB, 0)
    if a.stats()["numa_node"] == -1 and not mbind_works_here():
        pytest.skip("the kernel refuses mbind to this process")
    assert a.stats()["numa_node"] == 0
    assert not caplog.records
    assert copy_thread_cpus() == [(last,), (last,)]
    fill_and_check(a, 7)


def test_a_refused_placement_is_logged_and_harmless(fake_gpu, caplog):
    if fastpin.cuda_available() and fastpin.cuda_status().device_count < 2:
        pytest.skip("places an arena on CUDA device 1, which this GPU machine lacks")
    # Node 1 is not this machine's: mbind fails, the arena works, a warning says so.
    assert _numa.for_device(1) == (1, ())
    with caplog.at_level(logging.WARNING, logger="fastpin"):
        a = _arena.make_placed_arena(4 * MiB, 1)
    assert a.stats()["numa_node"] == -1
    assert any("NUMA node 1" in r.getMessage() for r in caplog.records)
    fill_and_check(a, 8)


def test_configure_numa_off(fake_gpu):
    last = fake_gpu
    mine = tuple(sorted(os.sched_getaffinity(0)))
    _numa.pin_threads(_numa.for_device(0))
    assert copy_thread_cpus() == [(last,), (last,)]
    fastpin.configure(numa=False)
    try:
        assert _numa.for_device(0) == _numa.NONE
        assert copy_thread_cpus() == [mine, mine]             # given back
        a = _arena.make_placed_arena(4 * MiB, 0)
        assert a.stats()["numa_node"] == -1
    finally:
        fastpin.configure(numa=True)
    assert _numa.for_device(0).node == 0


def test_pin_this_thread(fake_gpu):
    import threading

    last = fake_gpu
    seen = []

    def body():
        _numa.pin_this_thread(_numa.for_device(0))
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [{last}]


def test_no_gpu_no_placement():
    assert _numa.for_device(None) == _numa.NONE
    assert _numa.for_device(-1) == _numa.NONE
    if not fastpin.cuda_available():
        with pytest.raises(fastpin.CudaError):
            _C.pci_bus_id(0)
        assert _numa.gpu_bus_id(0) is None
