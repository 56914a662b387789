"""NUMA placement: the node of a GPU's PCI device and that node's CPUs, from sysfs.

A page-locked batch crosses the bus from host memory to the GPU; on a machine
of several sockets, memory and copy threads on the GPU's own node keep that
traffic off the link between sockets. Here, only the finding:

    GPU ordinal -> PCI bus id     the driver (_C.pci_bus_id), or torch's device
                                  properties (pci_domain_id, pci_bus_id,
                                  pci_device_id)
    bus id -> node                <sysfs>/bus/pci/devices/<bus id>/numa_node
    node -> CPUs                  <sysfs>/devices/system/node/node<N>/cpulist

and the C core applies it: the arena's pages prefer the node (mbind, before
they are touched: _C.Arena(numa_node=N)), the copy pool's threads run on its
CPUs (_C.set_affinity). Where there is nothing to choose (one node, numa_node
-1, no sysfs, no GPU) or it is switched off (fastpin.configure(numa=False),
FASTPIN_NUMA=0: _runtime.settings.numa), the placement is NONE and nothing
changes.

The sysfs root is "/sys", or FASTPIN_SYSFS_ROOT, or the `root` argument: the
tests build a fake tree.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, NamedTuple, Optional

from . import _C
from ._runtime import SYSFS_ROOT_ENV, process, settings

log = logging.getLogger("fastpin")


class Placement(NamedTuple):
    """Where an arena and the copy threads serving one GPU go.

    node: the NUMA node the arena's pages prefer, -1 for no placement.
    cpus: that node's CPUs this process may run on, () to leave threads as they are."""

    node: int
    cpus: tuple

    def __bool__(self) -> bool:
        return self.node >= 0


NONE = Placement(-1, ())


# Node -> the CPUs the copy pool is pinned to for it, in this process (held by
# _runtime: a forked child's is empty).
_pinned = process.pinned


def enabled() -> bool:
    return settings.numa


def set_enabled(on: bool) -> None:
    """fastpin.configure(numa=...): off also gives the copy threads their affinity back."""
    with process.lock:
        settings.numa = bool(on)
        if not on and _pinned:
            _pinned.clear()
            _set_pool_affinity(None)


def sysfs_root(root: Optional[str] = None) -> str:
    return root or os.environ.get(SYSFS_ROOT_ENV) or "/sys"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


# ---- parsing -------------------------------------------------------------------------

def parse_cpulist(text: str) -> list:
    """The CPUs of a kernel cpulist ("0-7,16-23", "3", "", "0-15:2/4"), sorted.
    ValueError for anything else."""
    cpus: set = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        span, _, stride = part.partition(":")
        lo, dash, hi = span.partition("-")
        try:
            first = int(lo)
            last = int(hi) if dash else first
            used, group = (int(x) for x in stride.split("/")) if stride else (1, 1)
        except ValueError:
            raise ValueError(f"not a cpulist: {text!r}") from None
        if first < 0 or last < first or used < 1 or group < used:
            raise ValueError(f"not a cpulist: {text!r}")
        # "a-b:u/g": of each group of g CPUs from a, the first u (the kernel's
        # bitmap_parselist); plain ranges are u = g = 1.
        cpus.update(c for c in range(first, last + 1) if (c - first) % group < used)
    return sorted(cpus)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address as sysfs spells it: "dddd:bb:dd.f", lower case. Accepts the
    driver's "0000:3B:00.0" and nvidia-smi's "00000000:3B:00.0"."""
    text = bus_id.strip().rstrip("\x00")
    try:
        domain, bus, rest = text.split(":")
        device, _, function = rest.partition(".")
        return "%04x:%02x:%02x.%x" % (int(domain, 16), int(bus, 16), int(device, 16),
                                      int(function or "0", 16))
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r}") from None


def bus_id_from_properties(props) -> str:
    """The bus id of torch.cuda.get_device_properties(i)."""
    return "%04x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)


# ---- sysfs ---------------------------------------------------------------------------

def device_node(bus_id: str, root: Optional[str] = None) -> int:
    """The NUMA node of a PCI device, -1 where sysfs does not say."""
    text = _read(os.path.join(sysfs_root(root), "bus", "pci", "devices",
                              normalize_bus_id(bus_id), "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return -1
    return node if node >= 0 else -1


def online_nodes(root: Optional[str] = None) -> list:
    """The nodes online, [] where sysfs has no node directory."""
    base = os.path.join(sysfs_root(root), "devices", "system", "node")
    text = _read(os.path.join(base, "online"))
    if text is not None:
        try:
            return parse_cpulist(text)  # the same list syntax
        except ValueError:
            pass
    try:
        return sorted(int(name[4:]) for name in os.listdir(base)
                      if name.startswith("node") and name[4:].isdigit())
    except OSError:
        return []


def node_cpus(node: int, root: Optional[str] = None) -> list:
    """The CPUs of a node, [] where sysfs does not say."""
    text = _read(os.path.join(sysfs_root(root), "devices", "system", "node", f"node{node}",
                              "cpulist"))
    try:
        return parse_cpulist(text) if text is not None else []
    except ValueError:
        return []


def placement(bus_id: Optional[str], root: Optional[str] = None,
              allowed: Optional[Iterable[int]] = None) -> Placement:
    """Where to put what serves the PCI device `bus_id`: NONE on a machine of one
    node, where sysfs does not know the device's node (-1, no file), or for no
    bus id. `allowed`: the CPUs this process may run on (default: this thread's
    affinity); the node's others are left out, and where none is left the
    threads stay as they are (the memory still goes to the node)."""
    if not bus_id:
        return NONE
    node = device_node(bus_id, root)
    nodes = online_nodes(root)
    if node < 0 or len(nodes) <= 1 or node not in nodes:
        return NONE
    if allowed is None:
        allowed = os.sched_getaffinity(0)
    allowed = set(allowed)
    return Placement(node, tuple(c for c in node_cpus(node, root) if c in allowed))


# ---- this process's GPUs --------------------------------------------------------------

def gpu_bus_id(index: int) -> Optional[str]:
    """The PCI bus id of CUDA device `index`: from the driver (which makes no
    context), else from torch; None where neither knows."""
    try:
        return normalize_bus_id(_C.pci_bus_id(index))
    except (_C.FastpinError, ValueError) as e:
        log.debug("fastpin: no PCI bus id from the driver for device %d: %s", index, e)
    try:
        import torch

        return bus_id_from_properties(torch.cuda.get_device_properties(index))
    except Exception as e:  # noqa: BLE001 - any failure means "unknown"
        log.debug("fastpin: no PCI bus id from torch for device %d: %s", index, e)
        return None


def for_device(index: Optional[int]) -> Placement:
    """The placement for CUDA device `index` (None: no GPU), NONE when switched off."""
    if index is None or index < 0 or not settings.numa:
        return NONE
    where = placement(gpu_bus_id(index))
    log.debug("fastpin: CUDA device %d -> NUMA node %d, CPUs %s", index, where.node,
              list(where.cpus))
    return where


def _set_pool_affinity(cpus) -> bool:
    try:
        _C.set_affinity(cpus)
        return True
    except (ValueError, OSError) as e:
        log.warning("fastpin: could not pin the copy threads to CPUs %s: %s", cpus, str(e))
        return False


def pin_threads(where: Placement) -> None:
    """Pin the copy pool's threads to the CPUs of `where`. A process whose GPUs
    sit on several nodes pins them to the union of those nodes' CPUs."""
    if not where.cpus:
        return
    with process.lock:
        if _pinned.get(where.node) == where.cpus:
            return
        _pinned[where.node] = where.cpus
        cpus = sorted(set().union(*_pinned.values()))
        if not _set_pool_affinity(cpus):
            del _pinned[where.node]


def pin_this_thread(where: Placement) -> None:
    """Run the calling thread on the CPUs of `where` (a Loader's producer, which
    copies its share of every batch); nothing when there are none."""
    if where.cpus:
        try:
            os.sched_setaffinity(0, where.cpus)  # 0: this thread, on Linux
        except OSError as e:
            log.debug("fastpin: could not pin this thread to CPUs %s: %s", list(where.cpus), e)


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` where the OS shows it too (top -H, perf,
    /proc/<pid>/task/<tid>/comm; Python before 3.14 names its threads only in
    Python). At most 15 bytes; nothing where /proc refuses it."""
    try:
        with open("/proc/thread-self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
