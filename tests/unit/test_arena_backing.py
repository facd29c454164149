"""Where an arena's pages come from (kvtier/shm/backing.py), how it is cut into chunks
(kvtier/tiers/arena_fill.py), NUMA binding (kvtier/shm/numa.py) and page population
(kvtier/shm/populate.py), on this machine's real kernel interfaces where they exist."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.daemon.arena import resolve_numa_node
from kvtier.errors import SegmentError
from kvtier.shm.backing import (
    DEFAULT_HUGE_DIR,
    Backing,
    backing_of,
    choose_backing,
    free_bytes,
    mount_of,
    parse_mountinfo,
)
from kvtier.shm.numa import NumaBinder, online_nodes, pci_numa_node
from kvtier.shm.populate import PageFiller, allocated_ranges
from kvtier.shm.segment import SHM_DIR
from kvtier.tiers.arena_fill import holes_in, plan_chunks

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
27 22 0:24 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24684084k
40 22 0:40 / /dev/hugepages rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M
41 22 0:41 / /mnt/thp rw,relatime shared:5 - tmpfs none rw,size=1048576k,huge=within_size
42 22 0:42 / /mnt/plain\\040dir rw,relatime - tmpfs none rw,size=1024k
43 22 0:43 / /mnt/g rw,relatime - hugetlbfs none rw,pagesize=1024M
"""


def test_mountinfo_parsing_finds_the_mount_and_its_options():
    mounts = parse_mountinfo(MOUNTINFO)
    assert [m.point for m in mounts][-1] == Path("/mnt/g")
    assert mount_of(Path("/dev/shm/kvtier.x"), mounts).fstype == "tmpfs"
    assert mount_of(Path("/mnt/plain dir"), mounts).options["size"] == "1024k"
    assert mount_of(Path("/var/tmp"), mounts).fstype == "ext4"


def test_backing_of_each_kind_of_mount():
    mounts = parse_mountinfo(MOUNTINFO)
    assert backing_of(Path("/dev/shm"), mounts) == Backing(Path("/dev/shm"), "tmpfs", 4096, "")
    assert backing_of(Path("/dev/hugepages"), mounts) == Backing(Path("/dev/hugepages"), "hugetlbfs", 2 << 20,
                                                                 "hugetlbfs")
    assert backing_of(Path("/mnt/thp"), mounts).huge == "within_size"
    assert backing_of(Path("/mnt/g"), mounts).page_bytes == 1 << 30
    with pytest.raises(SegmentError, match="not on a tmpfs or hugetlbfs"):
        backing_of(Path("/var/tmp"), mounts)


def test_choose_backing_off_auto_on(tmp_path):
    mounts = parse_mountinfo(MOUNTINFO + f"50 22 0:50 / {tmp_path} rw - tmpfs none rw,huge=always\n")
    assert choose_backing("off", str(tmp_path), mounts) == (Backing(SHM_DIR, "tmpfs", 4096, ""), "")
    b, why = choose_backing("auto", str(tmp_path), mounts)
    assert b.directory == tmp_path and b.huge == "always" and why == ""
    plain = tmp_path / "plain"
    plain.mkdir()  # on the same mount as tmp_path in this table... so give it a plain tmpfs of its own
    mounts2 = parse_mountinfo(MOUNTINFO + f"51 22 0:51 / {plain} rw - tmpfs none rw,size=1m\n")
    b, why = choose_backing("auto", str(plain), mounts2)
    assert b.directory == SHM_DIR and "without huge=" in why
    with pytest.raises(SegmentError, match="no huge-page mount is usable"):
        choose_backing("on", str(plain), mounts2)
    b, why = choose_backing("auto", str(tmp_path / "missing"), mounts)
    assert b.directory == SHM_DIR and "does not exist" in why
    if not DEFAULT_HUGE_DIR.is_dir():
        assert "does not exist" in choose_backing("auto", "", mounts)[1]


def test_holes_and_chunks():
    assert holes_in(0, 100, []) == [(0, 100)]
    assert holes_in(0, 100, [(0, 100)]) == []
    assert holes_in(10, 90, [(0, 20), (40, 50), (80, 200)]) == [(20, 40), (50, 80)]
    chunks = plan_chunks(10, 4096, 8192, 3 * 4096, [(8192, 8192 + 5 * 4096)])
    assert [c.slots for c in chunks] == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    assert chunks[0].holes == [] and chunks[1].holes == [(8192 + 5 * 4096, 8192 + 6 * 4096)]
    assert plan_chunks(3, 1 << 20, 4096, 1, [])[0].slots == range(0, 1), "at least one slot per chunk"


def test_populating_a_real_dev_shm_file_allocates_exactly_the_range():
    size = 8 << 20
    path = SHM_DIR / f"kvtier.unit-populate.{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data
        assert allocated_ranges(fd, 0, size) == []
        f = PageFiller(fd, base, size, 4096)
        f.fill(1 << 20, 3 << 20)
        assert allocated_ranges(fd, 0, size) == [(1 << 20, 3 << 20)]
        assert os.fstat(fd).st_blocks * 512 == 2 << 20
        f.fill(100, 200)  # widened to whole pages
        assert allocated_ranges(fd, 0, size)[0] == (0, 4096)
        m.close()
    finally:
        os.close(fd)
        path.unlink()


def test_free_bytes_of_dev_shm_is_what_statvfs_says():
    st = os.statvfs("/dev/shm")
    assert abs(free_bytes(Backing(SHM_DIR, "tmpfs", 4096, "")) - st.f_bavail * st.f_frsize) < (64 << 20)


def test_numa_binding_on_this_machine():
    """This machine has one node: binding to it works (the kernel says so in numa_maps); a node
    it does not have is refused up front."""
    nodes = online_nodes()
    assert nodes and nodes[0] == 0
    with pytest.raises(SegmentError, match="does not exist"):
        NumaBinder(max(nodes) + 7)
    binder = NumaBinder(0)
    size = 4 << 20
    m = mmap.mmap(-1, size)
    base = np.frombuffer(m, dtype=np.uint8, count=1).ctypes.data
    binder.bind_range(base, size)
    line = next(x for x in Path("/proc/self/numa_maps").read_text().splitlines() if x.startswith(f"{base:x} "))
    assert "bind:0" in line, line
    m.close()


def test_numa_node_setting_and_the_gpu_node_from_sysfs(tmp_path):
    assert resolve_numa_node("off", "cuda:0") is None
    assert resolve_numa_node("3", "cpu") == 3
    assert resolve_numa_node("auto", "cpu") is None  # no GPU named: no binding
    assert resolve_numa_node("auto", "auto") is None
    # The PCI path a GPU's node is read from (no GPU here: a sysfs-shaped tree stands in).
    dev = tmp_path / "0000:3b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert pci_numa_node("0000:3B:00.0", tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert pci_numa_node("0000:3b:00.0", tmp_path) is None
    assert pci_numa_node("0000:00:00.0", tmp_path) is None
