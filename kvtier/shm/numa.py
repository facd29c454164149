"""NUMA placement of an arena: bind its pages to one node (mbind, and the populating threads'
own policy, set_mempolicy), and find the node a GPU sits on (sysfs, from its PCI address).

glibc wraps neither call (libnuma does, and is not always installed), so they go through
syscall(2); the numbers are per architecture.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

from kvtier.errors import SegmentError

NODES = Path("/sys/devices/system/node")
PCI_DEVICES = Path("/sys/bus/pci/devices")
MPOL_BIND = 2
_SYSCALLS = {"x86_64": {"mbind": 237, "set_mempolicy": 238}, "aarch64": {"mbind": 235, "set_mempolicy": 237}}


def online_nodes(nodes: Path = NODES) -> list[int]:
    try:
        names = [p.name for p in nodes.iterdir()]
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def node_free_bytes(node: int, nodes: Path = NODES) -> int | None:
    """MemFree of one node, or None when sysfs does not say."""
    try:
        for line in (nodes / f"node{node}" / "meminfo").read_text().splitlines():
            if "MemFree:" in line:
                return int(line.split()[-2]) << 10
    except (OSError, ValueError, IndexError):
        return None
    return None


def pci_numa_node(pci_bus_id: str, devices: Path = PCI_DEVICES) -> int | None:
    """The NUMA node of a PCI device ("0000:3b:00.0"); None when unknown (-1 in sysfs, or absent)."""
    try:
        node = int((devices / pci_bus_id.lower() / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_numa_node(device_index: int) -> int | None:
    """The node of CUDA device `device_index`, from its PCI address as torch reports it."""
    import torch  # only asked for a pool on a real GPU

    p = torch.cuda.get_device_properties(device_index)
    # (torch's stubs do not declare the PCI fields its CUDA builds have)
    domain, bus, dev = (int(getattr(p, f"pci_{f}_id")) for f in ("domain", "bus", "device"))
    bus_id = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    return pci_numa_node(bus_id)


class NumaBinder:
    """Binds memory to one node. Raises SegmentError where the node or the calls are missing."""

    def __init__(self, node: int, nodes: Path = NODES) -> None:
        if node not in online_nodes(nodes):
            raise SegmentError(f"NUMA node {node} does not exist here (nodes: {online_nodes(nodes) or 'none'})")
        calls = _SYSCALLS.get(platform.machine())
        if calls is None:
            raise SegmentError(f"NUMA binding is not supported on {platform.machine()}")
        self.node = node
        self._calls = calls
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        words = node // 64 + 1
        self._mask = (ctypes.c_ulong * words)()
        self._mask[node // 64] = 1 << (node % 64)
        self._maxnode = words * 64 + 1  # the kernel reads maxnode - 1 bits

    def bind_range(self, addr: int, length: int) -> None:
        """mbind(MPOL_BIND): pages of this mapping come from the node (for tmpfs, the file's shared
        policy, so the fallocate of any thread follows it)."""
        r = self._libc.syscall(ctypes.c_long(self._calls["mbind"]), ctypes.c_void_p(addr), ctypes.c_ulong(length),
                               ctypes.c_int(MPOL_BIND), self._mask, ctypes.c_ulong(self._maxnode), ctypes.c_uint(0))
        if r != 0:
            raise SegmentError(f"mbind to NUMA node {self.node} failed: {os.strerror(ctypes.get_errno())}")

    def bind_thread(self) -> None:
        """set_mempolicy(MPOL_BIND) for the calling thread: hugetlbfs allocates by the task's policy."""
        r = self._libc.syscall(ctypes.c_long(self._calls["set_mempolicy"]), ctypes.c_int(MPOL_BIND), self._mask,
                               ctypes.c_ulong(self._maxnode))
        if r != 0:
            raise SegmentError(f"set_mempolicy to NUMA node {self.node} failed: {os.strerror(ctypes.get_errno())}")
