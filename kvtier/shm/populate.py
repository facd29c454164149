"""Bringing an arena's pages into memory, a range at a time, without holding the GIL.

A range is first allocated in the file (posix_fallocate: tmpfs or hugetlbfs pages, zeroed; a
full mount is an error here, never a SIGBUS on a later write), then faulted into this process's
page tables (madvise MADV_POPULATE_WRITE, Linux 5.14+), so the first write into a slot does not
pay a page fault per 4 KiB. Both calls release the GIL (os.posix_fallocate does; ctypes drops it
around every foreign call), so several threads populate while the event loop serves.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass, field

from kvtier.errors import SegmentError

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def allocated_ranges(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The ranges of [start, end) that hold pages already (SEEK_DATA/SEEK_HOLE): what a killed
    daemon's population got to. A filesystem without hole support reports one data range."""
    out: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after pos
                break
            raise
        if data >= end:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        out.append((data, hole))
        pos = hole
    return out


@dataclass(slots=True)
class PageFiller:
    """Populates byte ranges of one mapped file. `base` is the mapping's address; `page` the
    backing's page size (ranges are widened to whole pages: hugetlbfs works in 2 MiB)."""

    fd: int
    base: int
    size: int
    page: int
    prefault: bool = True
    _libc: ctypes.CDLL = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._libc = _libc()

    def _pages(self, start: int, end: int) -> tuple[int, int]:
        return start // self.page * self.page, min(self.size, -(-end // self.page) * self.page)

    def allocate(self, start: int, end: int) -> None:
        """Give [start, end) its pages in the file. Raises SegmentError (with the errno's words)."""
        lo, hi = self._pages(start, end)
        try:
            os.posix_fallocate(self.fd, lo, hi - lo)
        except OSError as e:
            raise SegmentError(f"cannot allocate bytes {lo}..{hi} of the arena: {e}") from e

    def fault_in(self, start: int, end: int) -> None:
        """Map [start, end)'s pages into this process's page tables (a no-op on old kernels)."""
        lo, hi = self._pages(start, end)
        if self.prefault and self._libc.madvise(self.base + lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # a kernel before 5.14: pages fault in on first write instead
                self.prefault = False
            else:
                raise SegmentError(f"cannot fault in bytes {lo}..{hi} of the arena: {os.strerror(err)}")

    def fill(self, start: int, end: int) -> None:
        """allocate, then fault_in."""
        self.allocate(start, end)
        self.fault_in(start, end)

    def advise_huge(self) -> bool:
        """tmpfs mounted huge=advise: ask for huge pages on this mapping."""
        return bool(self._libc.madvise(self.base, self.size, MADV_HUGEPAGE) == 0)
