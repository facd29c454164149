"""POSIX shared-memory segments, created O_EXCL with tight permissions.

On Linux shm_open(3) is open(2) under /dev/shm, so we call it directly: Python 3.11's
multiprocessing.shared_memory registers every segment with the resource tracker, which unlinks it
when the creating process exits. The cpu arena must outlive a daemon crash (warm restart), so that
behaviour is wrong here. O_NOFOLLOW refuses a symlink planted under the name.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from pathlib import Path

from kvtier.errors import SegmentError

SHM_DIR = Path("/dev/shm")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")  # fullmatch: "$" would admit a trailing "\n"


def _path(name: str, directory: Path = SHM_DIR) -> Path:
    if not NAME_RE.fullmatch(name):
        raise SegmentError(f"invalid shared-memory name {name!r}")
    return directory / name


class ShmSegment:
    """A mapped shared-memory segment. `buf` is a writable memoryview over the whole mapping.

    Most segments live in /dev/shm; a cpu arena may live on a huge-page mount (`directory`).
    `fd` stays open only when asked (`keep_fd`): the arena populates its pages in the background.
    `fresh`: created by this call, so every byte reads as zero (nothing to clear)."""

    def __init__(self, name: str, mapping: mmap.mmap, owner: bool, directory: Path = SHM_DIR,
                 fd: int | None = None, fresh: bool = False) -> None:
        self.name = name
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self.writable = not self.buf.readonly
        self.size = len(mapping)
        self.owner = owner
        self.directory = directory
        self.fd = fd
        self.fresh = fresh

    @classmethod
    def create(cls, name: str, size: int, *, mode: int = 0o600, gid: int | None = None,
               reserve: bool = False, directory: Path = SHM_DIR, keep_fd: bool = False) -> ShmSegment:
        """Create a new segment; fails if the name exists (never attaches a squatter's segment).

        `reserve`: allocate every page now (posix_fallocate, then a populated mapping). A
        /dev/shm too small for the segment is then a clear error at start, not a SIGBUS on some
        later write; and the first write into each slot does not pay for page allocation.
        Without it the pages are allocated later (kvtier/shm/populate.py does, for the arena)."""
        if size <= 0:
            raise SegmentError(f"segment size must be positive, got {size}")
        path = _path(name, directory)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError as e:
            raise SegmentError(f"shared-memory segment {name} already exists") from e
        except OSError as e:
            raise SegmentError(f"cannot create shared-memory segment {name}: {e}") from e
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it; we want exactly `mode`
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.ftruncate(fd, size)
            flags = mmap.MAP_SHARED
            if reserve:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    raise SegmentError(f"cannot reserve {size} bytes for shared-memory segment {name}: {e} "
                                       f"(is /dev/shm large enough?)") from e
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            try:
                mapping = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # hugetlbfs reserves the whole mapping's pages here
                raise SegmentError(f"cannot map {size} bytes of shared-memory segment {path}: {e} "
                                   f"(not enough free huge pages?)") from e
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        if not keep_fd:
            os.close(fd)
        return cls(name, mapping, owner=True, directory=directory, fd=fd if keep_fd else None, fresh=True)

    @classmethod
    def attach(cls, name: str, *, writable: bool = False, trusted_uid: int | None = None,
               directory: Path = SHM_DIR, keep_fd: bool = False) -> ShmSegment:
        """Map an existing segment. With `trusted_uid`, refuse one owned by anyone else or
        writable by others: such a segment may have been planted to feed us bytes."""
        path = _path(name, directory)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError as e:
            raise SegmentError(f"shared-memory segment {name} does not exist") from e
        except OSError as e:
            raise SegmentError(f"cannot open shared-memory segment {name}: {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
                raise SegmentError(f"segment {name} is not a usable shared-memory object")
            if st.st_mode & 0o002:
                raise SegmentError(f"segment {name} is writable by others (mode {st.st_mode & 0o777:o}); refusing")
            if trusted_uid is not None and st.st_uid != trusted_uid:
                raise SegmentError(f"segment {name} is owned by uid {st.st_uid}, expected {trusted_uid}; refusing")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
        return cls(name, mapping, owner=False, directory=directory, fd=fd if keep_fd else None)

    @staticmethod
    def exists(name: str, directory: Path = SHM_DIR) -> bool:
        return _path(name, directory).exists()

    @staticmethod
    def unlink_name(name: str, directory: Path = SHM_DIR) -> bool:
        try:
            _path(name, directory).unlink()
            return True
        except FileNotFoundError:
            return False

    def unlink(self) -> None:
        self.unlink_name(self.name, self.directory)

    def close(self) -> None:
        """Unmap. Views handed out (numpy arrays, tensors) must be dropped first."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.buf.release()
        except BufferError:
            return  # a view is still exported; the mapping goes when the process does
        try:
            self._mmap.close()
        except BufferError:
            pass
