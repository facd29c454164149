"""Opening a pool's cpu arena: its backing (/dev/shm or huge pages), the room check, NUMA
binding, and the population plan that kvtier/daemon/population.py then carries out.

What happens before READY is bounded whatever the arena's size: create (or re-attach) the file,
check that its backing has room for the pages still missing, bind it to its NUMA node, populate
the slot headers and the first chunk. The rest of the pages come in the background.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.config import ArenaConfig
from kvtier.errors import SegmentError
from kvtier.layout import BlockLayout
from kvtier.shm.backing import Backing, choose_backing, free_bytes, parse_mountinfo
from kvtier.shm.numa import NumaBinder, gpu_numa_node, node_free_bytes
from kvtier.shm.populate import PageFiller, allocated_ranges
from kvtier.shm.segment import SHM_DIR, ShmSegment
from kvtier.shm.slots import Kind, SlotTable, segment_bytes
from kvtier.tiers.arena_fill import holes_in

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(slots=True)
class OpenedArena:
    table: SlotTable
    warm: bool
    backing: Backing
    filler: PageFiller
    binder: NumaBinder | None
    allocated: list[tuple[int, int]]  # byte ranges of the payload region that hold pages already
    huge_fallback: str


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def resolve_numa_node(setting: str, device: str) -> int | None:
    """`[arena] numa_node` for a pool on `device`: a number, nothing ("off"), or for "auto" the
    node of the pool's GPU when the device is a CUDA GPU whose node sysfs reports."""
    if setting == "off":
        return None
    if setting != "auto":
        return int(setting)
    if not device.startswith("cuda"):
        return None  # "auto" or "cpu": no GPU named, so no node to follow
    try:
        return gpu_numa_node(int(device.partition(":")[2] or 0))
    except Exception:  # no CUDA, no such device: no binding, as on a one-node host
        return None


def _held(directory: Path, name: str) -> int:
    """Bytes of pages an arena file left by an earlier run holds already (a warm restart needs
    only the rest)."""
    try:
        return (directory / name).stat().st_blocks * 512
    except OSError:
        return 0


def _backing(cfg: ArenaConfig, size: int, name: str, log) -> tuple[Backing, str]:
    backing, reason = choose_backing(cfg.huge_pages, cfg.huge_pages_dir, parse_mountinfo(MOUNTINFO.read_text()))
    need = size - _held(backing.directory, name)
    free = free_bytes(backing) if backing.huge == "hugetlbfs" else need
    if free < need:
        reason = (f"{backing.directory} has {_gib(free)} of free huge pages, the arena needs {_gib(need)} more "
                  f"(raise vm.nr_hugepages)")
        if cfg.huge_pages == "on":
            raise SegmentError(f"[arena] huge_pages = \"on\": {reason}")
        backing = Backing(SHM_DIR, "tmpfs", 4096, "")
    if reason:
        log.warning("arena.huge_pages_unavailable", reason=reason, using=backing.describe)
    return backing, reason


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return None


def _check_room(name: str, need: int, backing: Backing) -> None:
    """Fail the start now, with the figures, rather than a SIGBUS or the OOM killer later."""
    room = free_bytes(backing)
    if room < need:
        raise SegmentError(f"cpu arena {name} needs {_gib(need)} more, {backing.directory} has {_gib(room)} free "
                           f"(lower cpu_bytes, or enlarge the mount: mount -o remount,size=... {backing.directory})")
    avail = mem_available() if backing.fstype == "tmpfs" else None  # hugetlbfs pages are set aside already
    if avail is not None and avail < need:
        raise SegmentError(f"cpu arena {name} needs {_gib(need)} more, the host has {_gib(avail)} of memory "
                           f"available (MemAvailable); lower cpu_bytes")


def _leftover(name: str, directory: Path, log) -> None:
    """Unlink an arena of ours left in a backing we no longer use (its pages stay taken otherwise).
    Someone else's file of that name there is left alone: it is not in our way."""
    if directory.is_dir() and ShmSegment.exists(name, directory):
        try:
            ShmSegment.attach(name, trusted_uid=os.geteuid(), directory=directory).close()
        except SegmentError as e:
            log.warning("arena.leftover_not_ours", path=str(directory / name), reason=str(e))
            return
        ShmSegment.unlink_name(name, directory)
        log.info("arena.leftover_removed", path=str(directory / name))


def _base(seg: ShmSegment) -> int:
    view = np.frombuffer(seg.buf, dtype=np.uint8, count=1)
    addr: int = view.ctypes.data
    return addr


def open_cpu_arena(name: str, n: int, layout: BlockLayout, gid: int | None, mode: int, cfg: ArenaConfig,
                   device: str, log) -> OpenedArena:
    """Re-attach a surviving arena of the same geometry (warm restart), else create a new one.
    Raises SegmentError, with the figures, when the backing has no room for what is missing."""
    bb = layout.block_bytes
    want = segment_bytes(n, bb)
    backing, fallback = _backing(cfg, want, name, log)
    size = _round_up(want, backing.page_bytes)  # hugetlbfs takes whole huge pages only
    for other in {SHM_DIR, Path(cfg.huge_pages_dir or "/dev/hugepages")} - {backing.directory}:
        _leftover(name, other, log)
    node = resolve_numa_node(cfg.numa_node, device)
    binder = NumaBinder(node) if node is not None else None
    seg, table = _reattach(name, n, layout, backing.directory, log)
    warm = table is not None
    if seg is None:
        _check_room(name, size, backing)
        seg = ShmSegment.create(name, size, mode=mode, gid=gid, directory=backing.directory, keep_fd=True)
    assert seg.fd is not None
    if warm:
        os.fchmod(seg.fd, mode)  # an arena kept by a daemon before grants was not group-writable
    try:
        filler = PageFiller(seg.fd, _base(seg), seg.size, backing.page_bytes)
        if binder is not None:
            binder.bind_range(filler.base, seg.size)  # before any page of it is allocated
            free = node_free_bytes(binder.node)
            if free is not None and free < seg.size:
                log.warning("arena.numa_node_short", node=binder.node, free=free, needs=seg.size)
        if backing.huge == "advise":
            filler.advise_huge()
        payload_off = segment_bytes(n, bb, with_payload=False)
        allocated = allocated_ranges(seg.fd, 0, seg.size) if warm else []
        if warm:  # what a population cut short (kill -9) left to allocate must fit too
            _check_room(name, sum(hi - lo for lo, hi in holes_in(payload_off, seg.size, allocated)), backing)
        # The headers are read by every client and by the warm-restart scan: populated now.
        for lo, hi in holes_in(0, payload_off, allocated):
            filler.fill(lo, hi)
        if table is None:
            table = SlotTable.format(seg, Kind.ARENA, n, bb, layout.fingerprint)
    except BaseException:
        seg.close()
        if not warm:
            seg.unlink()
        raise
    return OpenedArena(table, warm, backing, filler, binder, allocated, fallback)


def _reattach(name: str, n: int, layout: BlockLayout, directory: Path, log
              ) -> tuple[ShmSegment | None, SlotTable | None]:
    if not ShmSegment.exists(name, directory):
        return None, None
    seg = ShmSegment.attach(name, writable=True, trusted_uid=os.geteuid(), directory=directory, keep_fd=True)
    try:
        table = SlotTable.open(seg, Kind.ARENA, layout.fingerprint, layout.block_bytes)
        if table.n == n:
            return seg, table
        log.info("arena.resized", segment=name, old=table.n, new=n)
    except SegmentError as e:
        log.warning("arena.discarded", segment=name, reason=str(e))
    seg.close()
    ShmSegment.unlink_name(name, directory)
    return None, None
