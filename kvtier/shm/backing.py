"""Where a cpu arena's pages come from: /dev/shm (4 KiB pages), or a huge-page mount.

Two kinds of mount give 2 MiB pages: hugetlbfs (pages reserved by the administrator in
vm.nr_hugepages; mmap reserves the whole arena's pages up front, so a short pool fails the start)
and tmpfs mounted with `huge=always|within_size|advise` (transparent huge pages for shared
memory: nothing to reserve, the kernel falls back to 4 KiB pages where it cannot find 2 MiB).
The mount's type and options come from /proc/self/mountinfo; the room from statvfs, and for
hugetlbfs from the free pages of its size in sysfs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import SegmentError
from kvtier.shm.segment import SHM_DIR

SMALL_PAGE = 4096
HUGETLB_SYSFS = Path("/sys/kernel/mm/hugepages")
DEFAULT_HUGE_DIR = Path("/dev/hugepages")  # where systemd mounts hugetlbfs
_TMPFS_HUGE = ("always", "within_size", "advise")


@dataclass(frozen=True, slots=True)
class Mount:
    point: Path
    fstype: str
    options: dict[str, str]


@dataclass(frozen=True, slots=True)
class Backing:
    """The directory an arena file lives in, and what its pages are."""

    directory: Path
    fstype: str  # "tmpfs" or "hugetlbfs"
    page_bytes: int  # the page size the arena is meant to get (tmpfs huge=: 2 MiB where it can)
    huge: str  # "" (4 KiB pages), "hugetlbfs", or the tmpfs huge= mode

    @property
    def describe(self) -> str:
        kind = "4 KiB pages" if not self.huge else f"{self.page_bytes >> 20} MiB pages ({self.huge})"
        return f"{self.fstype} {self.directory}, {kind}"


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/self/mountinfo lines: `id parent maj:min root point opts [tags] - type source superopts`."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        opts: dict[str, str] = {}
        for o in (tail[2] if len(tail) > 2 else "").split(","):
            k, _, v = o.partition("=")
            opts[k] = v
        mounts.append(Mount(Path(point), tail[0], opts))
    return mounts


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount `path` lies on: the longest mount point above it (the last one mounted wins)."""
    best: Mount | None = None
    for m in mounts:
        if path == m.point or m.point in path.parents:
            if best is None or len(m.point.parts) >= len(best.point.parts):
                best = m
    return best


def _size_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "": 1}
    text = text.strip().lower()
    unit = text[-1] if text and text[-1] in "kmg" else ""
    return int(text[: len(text) - len(unit)]) * units[unit]


def backing_of(directory: Path, mounts: list[Mount]) -> Backing:
    m = mount_of(directory, mounts)
    if m is None or m.fstype not in ("tmpfs", "hugetlbfs"):
        raise SegmentError(f"{directory} is not on a tmpfs or hugetlbfs mount "
                           f"({m.fstype if m else 'no mount found'}); an arena must live in memory")
    if m.fstype == "hugetlbfs":
        page = _size_bytes(m.options.get("pagesize", "2M"))
        return Backing(directory, "hugetlbfs", page, "hugetlbfs")
    huge = m.options.get("huge", "")
    if huge in _TMPFS_HUGE:
        return Backing(directory, "tmpfs", 2 << 20, huge)
    return Backing(directory, "tmpfs", SMALL_PAGE, "")


def free_bytes(b: Backing) -> int:
    """Room for new pages on the backing: what statvfs says, and for hugetlbfs no more than the
    free, unreserved huge pages of its size (an unlimited hugetlbfs mount reports 0 blocks)."""
    st = os.statvfs(b.directory)
    room = st.f_bavail * st.f_frsize
    if b.fstype != "hugetlbfs":
        return room
    sysfs = HUGETLB_SYSFS / f"hugepages-{b.page_bytes >> 10}kB"
    try:
        pool = (int((sysfs / "free_hugepages").read_text()) - int((sysfs / "resv_hugepages").read_text()))
    except (OSError, ValueError):
        pool = 0
    pool_bytes = max(0, pool) * b.page_bytes
    return min(room, pool_bytes) if st.f_blocks else pool_bytes


def choose_backing(mode: str, huge_dir: str, mounts: list[Mount]) -> tuple[Backing, str]:
    """The backing for `[arena] huge_pages` = off | auto | on, and a reason when huge pages were
    wanted but not used. `on` raises instead of falling back."""
    plain = Backing(SHM_DIR, "tmpfs", SMALL_PAGE, "")
    shm = backing_of(SHM_DIR, mounts) if mount_of(SHM_DIR, mounts) else plain
    if mode == "off":
        return shm, ""
    directory = Path(huge_dir) if huge_dir else DEFAULT_HUGE_DIR
    reason = ""
    if shm.huge and not huge_dir:
        return shm, ""  # /dev/shm itself is mounted huge=
    if not directory.is_dir():
        reason = f"{directory} does not exist"
    else:
        try:
            b = backing_of(directory, mounts)
        except SegmentError as e:
            reason = str(e)
        else:
            if b.huge:
                return b, ""
            reason = f"{directory} is a tmpfs without huge= (mount it with -o huge=within_size)"
    if mode == "on":
        raise SegmentError(f"[arena] huge_pages = \"on\" but no huge-page mount is usable: {reason}")
    return shm, reason
