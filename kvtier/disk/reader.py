"""A client's read-only view of a disk tier's block file: blocks read with no daemon round trip.

The daemon lists a disk-resident block's slot in the shared directory, as it does for the memory
tiers; the client reads the slot itself, with the same seqlock and checksum rules as a shm slot
(kvtier/disk/blockfile.py writes them): the header's gen, flags and key before the copy, the gen
and key again after it, and the xxh3 of the bytes that landed. The file and its header are
untrusted until verified: the file must belong to the daemon's user and be writable by no one
else, its header must describe this pool's layout, and a torn, replaced, truncated or corrupt
block is a miss. An I/O error is a miss too (the daemon turns its tier off on its own errors).

It offers the read side of SlotTable (`n`, `begin_read`, `end_read`, `read_into`, `read_with`,
`close`), so kvtier/client/pools.py reads it like the other tiers. Payloads come by pread on a
descriptor opened O_DIRECT where the filesystem takes it, through a page-aligned bounce buffer
per thread when the destination is not aligned.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.disk.blockfile import open_payload, thread_buffer
from kvtier.errors import SegmentError
from kvtier.shm.slots import (
    HEADER_OFF,
    PAGE,
    SLOT_HDR,
    SLOT_HEADER,
    SLOT_MAGIC,
    Flags,
    Kind,
    SlotHeader,
    checksum,
    parse_segment_header,
)


class DiskSlots:
    def __init__(self, path: Path, fingerprint: bytes, block_bytes: int, trusted_uid: int) -> None:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        self.path = path
        self._fd = os.open(path, flags)
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != trusted_uid or st.st_mode & 0o022:
                raise SegmentError(f"{path}: not a regular file of uid {trusted_uid} writable only by it; refusing")
            head = os.pread(self._fd, HEADER_OFF, 0)
            self.n, self.block_bytes, self.stride, self.payload_off, _ = parse_segment_header(
                head, st.st_size, str(path), Kind.DISK, fingerprint, block_bytes)
            if st.st_size < self.payload_off:
                raise SegmentError(f"{path}: shorter than its header table")
            self._map = mmap.mmap(self._fd, self.payload_off, mmap.MAP_SHARED, mmap.PROT_READ)
            self._dfd, self.direct = open_payload(path, flags)
        except BaseException:
            os.close(self._fd)
            raise
        self._hdr = memoryview(self._map)
        self._local = threading.local()  # each reading thread's bounce buffer

    def _header(self, slot: int) -> SlotHeader:
        return SlotHeader(*SLOT_HEADER.unpack_from(self._hdr, HEADER_OFF + SLOT_HDR * slot))

    def begin_read(self, slot: int, key: bytes, flags: int = Flags.VALID) -> tuple[int, int] | None:
        """(gen, checksum) when the slot holds `key` as a complete block, else None."""
        if not 0 <= slot < self.n:
            return None
        h = self._header(slot)
        if (h.magic != SLOT_MAGIC or h.gen % 2 or h.flags != flags or h.key != key
                or h.length != self.block_bytes):
            return None
        return h.gen, h.checksum

    def end_read(self, slot: int, gen: int, key: bytes) -> bool:
        h = self._header(slot)
        return h.gen == gen and h.key == key

    def _pread(self, slot: int, buf: npt.NDArray[np.uint8]) -> bool:
        try:
            return os.preadv(self._dfd, [buf.data], self.payload_off + slot * self.stride) == buf.nbytes
        except OSError:
            return False  # an I/O error, or a file cut short: a miss

    def read_into(self, slot: int, key: bytes, dst: npt.NDArray[np.uint8], flags: int = Flags.VALID) -> int | None:
        """Copy the block into `dst` (uint8, block_bytes) and verify it. Its checksum, or None."""
        target = dst.reshape(-1)
        aligned = target.ctypes.data % PAGE == 0 and self.block_bytes == self.stride
        if self.direct and not aligned:
            return self.read_with(slot, key, lambda src: np.copyto(target, src), lambda: checksum(target), flags)
        snap = self.begin_read(slot, key, flags)
        if snap is None or not self._pread(slot, target):
            return None
        if not self.end_read(slot, snap[0], key) or checksum(target) != snap[1]:
            return None
        return snap[1]

    def read_with(self, slot: int, key: bytes, copy_out: Callable[[npt.NDArray[np.uint8]], object],
                  digest: Callable[[], int], flags: int = Flags.VALID) -> int | None:
        """As SlotTable.read_with: the payload read into this thread's bounce buffer, then
        `copy_out(payload)`, the seqlock re-check, and `digest()` of what landed."""
        snap = self.begin_read(slot, key, flags)
        if snap is None:
            return None
        buf = thread_buffer(self._local, self.stride)
        if not self._pread(slot, buf):
            return None
        copy_out(buf[: self.block_bytes])
        if not self.end_read(slot, snap[0], key) or digest() != snap[1]:
            return None
        return snap[1]

    def drop_cache(self) -> None:
        """Ask the kernel to drop the file's cached pages (benchmarks: reads from the device)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._hdr.release()
        self._map.close()
        os.close(self._dfd)
        os.close(self._fd)

