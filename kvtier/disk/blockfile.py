"""A disk tier's block file: one preallocated file of fixed slots, with the shm slot header.

Layout (the same geometry as a shm slot table, `shm/slots.py`):
    [0, 4096)                   file header (SEG, kind DISK): magic, version, n, block size, fingerprint
    [4096, 4096 + 128 * n)      slot headers: magic flags gen key length checksum parent
    [payload_off, ...)          n payloads of `stride` bytes (the block size rounded up to 4 KiB)

The header table is mapped (MAP_SHARED): it is small, read on every lookup and scanned when the
file is adopted again. Payloads move with pread/pwrite on a second descriptor, opened O_DIRECT
where the filesystem takes it (ext4, xfs), else through the page cache (`direct` says which).
O_DIRECT needs page-aligned memory, offsets and lengths: slots are page-aligned and a stride is
whole pages; an unaligned buffer goes through an aligned bounce buffer (`aligned_empty`).

A write makes the slot's gen odd (readers miss), writes the payload, then publishes key,
checksum, parent and an even gen. A crash anywhere in between (kill -9, power loss: the header
page and the payload reach the device in either order) leaves a header that is odd, or whose
checksum no longer matches the payload, and a read of it is a miss, never wrong bytes. Every read
checks the header before and after the copy (the seqlock), the key, and the xxh3 of the bytes
it returns.

All I/O errors surface as `DiskFault` (errno and operation): the tier turns itself off on
ENOSPC, EIO or EROFS; the block file does not decide that.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import DiskFault, SegmentError
from kvtier.failpoints import IoFaults
from kvtier.shm.slots import (
    EMPTY_KEY,
    HEADER_DTYPE,
    HEADER_OFF,
    LAYOUT_VERSION,
    PAGE,
    SEG,
    SEG_MAGIC,
    SLOT_HDR,
    SLOT_HEADER,
    SLOT_MAGIC,
    Flags,
    Kind,
    SlotHeader,
    checksum,
    parse_segment_header,
    round_up,
    segment_bytes,
)

_GEN_OFF = 8  # a slot header's gen, after magic and flags


def aligned_empty(nbytes: int) -> npt.NDArray[np.uint8]:
    """A page-aligned, zeroed uint8 buffer (an anonymous mapping), usable with O_DIRECT."""
    size = max(PAGE, round_up(nbytes, PAGE))
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8, count=nbytes)


def thread_buffer(local: threading.local, nbytes: int) -> npt.NDArray[np.uint8]:
    """The calling thread's page-aligned buffer of `nbytes` kept in `local` (made on first use,
    or remade for another size): one per I/O thread, not one mapping per I/O."""
    buf: npt.NDArray[np.uint8] | None = getattr(local, "buf", None)
    if buf is None or buf.nbytes != nbytes:
        buf = local.buf = aligned_empty(nbytes)
    return buf


def _aligned(buf: npt.NDArray[np.uint8]) -> bool:
    return buf.ctypes.data % PAGE == 0 and buf.flags.c_contiguous


@dataclass(frozen=True, slots=True)
class Adopted:
    """Slots whose headers describe a complete block (payloads verified on read)."""

    slots: npt.NDArray[np.int64]
    keys: list[bytes]
    parents: list[bytes | None]


class DiskBlockFile:
    """One pool's block file. Not thread-safe per slot: the tier gives each slot one writer."""

    def __init__(self, path: Path, fd: int, dfd: int, direct: bool, mapping: mmap.mmap, n: int, block_bytes: int,
                 fingerprint: bytes, faults: IoFaults, valid_bytes: int) -> None:
        self.path = path
        self._fd = fd  # buffered: size checks, fallocate, fsync
        self._dfd = dfd  # payload I/O: O_DIRECT when `direct`
        self.direct = direct
        self._map = mapping
        self._hdr = memoryview(mapping)
        self.n = n
        self.block_bytes = block_bytes
        self.stride = round_up(block_bytes, PAGE)
        self.payload_off = segment_bytes(n, block_bytes, with_payload=False)
        self.fingerprint = fingerprint
        self.faults = faults
        self.valid_bytes = valid_bytes  # what the file held when adopted: slots past it were truncated
        self._local = threading.local()  # each I/O thread's bounce buffer

    # --- creation, adoption ----------------------------------------------------------------------

    @staticmethod
    def slots_for(capacity_bytes: int, block_bytes: int) -> int:
        """How many blocks a file of at most `capacity_bytes` holds, headers included."""
        stride = round_up(block_bytes, PAGE)
        n = max(0, (capacity_bytes - HEADER_OFF) // (stride + SLOT_HDR))
        while n and segment_bytes(n, block_bytes) > capacity_bytes:
            n -= 1
        return n

    @classmethod
    def open_or_create(cls, path: Path, n: int, block_bytes: int, fingerprint: bytes, *, reserve_bytes: int = 0,
                       faults: IoFaults | None = None) -> tuple[DiskBlockFile, bool]:
        """Adopt the file at `path` if it holds this layout and geometry, else (re)create it.
        Returns (file, adopted). Creating preallocates every byte (fallocate), so later writes
        cannot run out of space, and refuses to leave less than `reserve_bytes` free."""
        faults = faults or IoFaults()
        if n <= 0:
            raise SegmentError(f"a disk block file needs at least one slot (too small for {block_bytes}-byte blocks)")
        size = segment_bytes(n, block_bytes)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DiskFault(e.errno or errno.EIO, "open", f"disk tier: cannot open {path}: {e.strerror or e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError(f"{path} is not a regular file")
            if st.st_mode & 0o022:
                raise SegmentError(f"{path} is writable by others (mode {st.st_mode & 0o777:o}); refusing")
            adopted = st.st_size >= HEADER_OFF and cls._matches(fd, path, st.st_size, n, block_bytes, fingerprint)
            if not adopted:
                cls._format(fd, path, size, n, block_bytes, fingerprint, reserve_bytes)
            elif st.st_size < size:  # truncated while we were down: the tail's headers are dropped by scan()
                cls._allocate(fd, path, size, reserve_bytes, st.st_size)
            mapping = mmap.mmap(fd, segment_bytes(n, block_bytes, with_payload=False), mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
            dfd, direct = open_payload(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, dfd, direct, mapping, n, block_bytes, fingerprint, faults,
                   st.st_size if adopted else size), adopted

    @staticmethod
    def _matches(fd: int, path: Path, size: int, n: int, block_bytes: int, fingerprint: bytes) -> bool:
        head = os.pread(fd, HEADER_OFF, 0)
        try:
            got_n, bb, _stride, _off, _fp = parse_segment_header(head, max(size, segment_bytes(n, block_bytes)),
                                                                 str(path), Kind.DISK, fingerprint, block_bytes)
        except SegmentError:
            return False
        return got_n == n and size >= segment_bytes(n, block_bytes, with_payload=False)

    @classmethod
    def _format(cls, fd: int, path: Path, size: int, n: int, block_bytes: int, fingerprint: bytes,
                reserve_bytes: int) -> None:
        os.ftruncate(fd, 0)  # another layout or a damaged header: nothing in it is adoptable
        cls._allocate(fd, path, size, reserve_bytes, 0)
        head = bytearray(HEADER_OFF)
        SEG.pack_into(head, 0, SEG_MAGIC, LAYOUT_VERSION, Kind.DISK, n, block_bytes, round_up(block_bytes, PAGE),
                      segment_bytes(n, block_bytes, with_payload=False), fingerprint, os.getpid(), time.time_ns())
        os.pwrite(fd, head, 0)
        os.fsync(fd)

    @staticmethod
    def _allocate(fd: int, path: Path, size: int, reserve_bytes: int, had: int) -> None:
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
        need = size - had
        if need > 0 and free - need < reserve_bytes:
            raise SegmentError(
                f"disk tier: {path.parent} has {free >> 20} MiB free; a {size >> 20} MiB block file would leave "
                f"less than the {reserve_bytes >> 20} MiB reserve ([disk] capacity_bytes or reserve_bytes)")
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise SegmentError(f"disk tier: cannot allocate {size >> 20} MiB in {path}: {e.strerror}") from e

    def share_with_group(self, gid: int) -> None:
        """Clients in group `gid` (the shm group) may read the file: they read blocks themselves."""
        os.fchown(self._fd, -1, gid)
        os.fchmod(self._fd, 0o640)

    def headers(self, lo: int, hi: int) -> npt.NDArray[Any]:
        """Slots [lo, hi)'s headers as HEADER_DTYPE records over the mapping (no copy)."""
        if not 0 <= lo <= hi <= self.n:
            raise IndexError(f"slots {lo}..{hi} outside [0, {self.n}]")
        return np.frombuffer(self._hdr, dtype=HEADER_DTYPE, count=hi - lo, offset=HEADER_OFF + SLOT_HDR * lo)

    def drop_cache(self) -> None:
        """Ask the kernel to drop this file's cached pages (benchmarks: reads from the device)."""
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def adopt(self, lo: int, hi: int) -> Adopted:
        """Slots [lo, hi) whose headers hold a complete block of this file (magic, even gen, VALID,
        full length, payload inside the file as adopted). Untrusted until read: every read
        verifies the bytes against the header's checksum. A header whose payload was cut off by
        a truncation is cleared, so a later adoption does not take the zeros refilled there."""
        h = self.headers(lo, hi)
        slots = np.arange(lo, hi, dtype=np.int64)
        inside = self.payload_off + (slots + 1) * self.stride <= self.valid_bytes
        whole = ((h["magic"] == SLOT_MAGIC) & (h["gen"] % 2 == 0) & (h["flags"] == Flags.VALID)
                 & (h["length"] == self.block_bytes))
        for s in slots[whole & ~inside].tolist():
            self.invalidate(s)
        idx = np.nonzero(whole & inside)[0]
        keys = [bytes(k) for k in h["key"][idx]]
        parents = [None if (p := bytes(q)) == EMPTY_KEY else p for q in h["parent"][idx]]
        valid = [(s, k, p) for s, k, p in zip(slots[idx].tolist(), keys, parents) if k != EMPTY_KEY]
        return Adopted(np.array([v[0] for v in valid], dtype=np.int64), [v[1] for v in valid], [v[2] for v in valid])

    # --- headers -----------------------------------------------------------------------------------

    def _off(self, slot: int) -> int:
        if not 0 <= slot < self.n:
            raise IndexError(f"slot {slot} outside [0, {self.n})")
        return HEADER_OFF + SLOT_HDR * slot

    def header(self, slot: int) -> SlotHeader:
        return SlotHeader(*SLOT_HEADER.unpack_from(self._hdr, self._off(slot)))

    def _gen(self, slot: int) -> int:
        g: int = np.frombuffer(self._hdr, dtype="<u8", count=1, offset=self._off(slot) + _GEN_OFF)[0].item()
        return g

    def _set_gen(self, slot: int, g: int) -> None:
        self._hdr[self._off(slot) + _GEN_OFF: self._off(slot) + _GEN_OFF + 8] = g.to_bytes(8, "little")

    def invalidate(self, slot: int) -> None:
        """The slot no longer holds a block (dropped): its header says EMPTY."""
        g = self._gen(slot)
        g = g + 1 if g % 2 == 0 else g + 2
        SLOT_HEADER.pack_into(self._hdr, self._off(slot), SLOT_MAGIC, Flags.EMPTY, g + 1, EMPTY_KEY, 0, 0, EMPTY_KEY)

    # --- payload I/O -------------------------------------------------------------------------------

    def _io(self, op: str, fn: Any, *args: Any) -> int:
        try:
            self.faults.check(op)
            n: int = fn(*args)
            return n
        except OSError as e:
            raise DiskFault(e.errno or errno.EIO, op, f"disk tier {op} on {self.path}: {e.strerror or e}") from e

    def write(self, slot: int, key: bytes, data: npt.NDArray[np.uint8], parent: bytes | None = None,
              csum: int | None = None) -> int:
        """Write one block (uint8, block_bytes) into `slot`; returns its checksum. On a DiskFault
        the slot is left odd (a miss) and the caller frees it."""
        if data.nbytes != self.block_bytes:
            raise ValueError(f"block of {data.nbytes} bytes, expected {self.block_bytes}")
        src = data.reshape(-1)
        if csum is None:
            csum = checksum(src)
        off = self._off(slot)
        g = self._gen(slot)
        g = g + 1 if g % 2 == 0 else g + 2  # odd: readers miss while the payload changes
        self._set_gen(slot, g)
        if self.direct and not (_aligned(src) and self.block_bytes == self.stride):
            bounce = thread_buffer(self._local, self.stride)
            bounce[: self.block_bytes] = src
            src = bounce
        pos = self.payload_off + slot * self.stride
        wrote = self._io("write", os.pwritev, self._dfd, [src], pos)
        if wrote != src.nbytes:
            raise DiskFault(errno.EIO, "write", f"disk tier write on {self.path}: short ({wrote} of {src.nbytes})")
        SLOT_HEADER.pack_into(self._hdr, off, SLOT_MAGIC, Flags.VALID, g, key, self.block_bytes, csum,
                              parent or EMPTY_KEY)
        self._set_gen(slot, g + 1)
        return csum

    def read_into(self, slot: int, key: bytes, dst: npt.NDArray[np.uint8]) -> int | None:
        """Read the block in `slot` into `dst` (uint8, block_bytes) and verify it: the header's
        key and gen before and after, and the checksum of the bytes landed. Returns the checksum,
        or None (a miss: torn, replaced, corrupt or stale), after which `dst` holds garbage."""
        h = self.header(slot)
        if (h.magic != SLOT_MAGIC or h.gen % 2 or h.flags != Flags.VALID or h.key != key
                or h.length != self.block_bytes):
            return None
        target = dst.reshape(-1)
        direct_ok = not self.direct or (_aligned(target) and self.block_bytes == self.stride)
        buf = target if direct_ok else thread_buffer(self._local, self.stride)
        pos = self.payload_off + slot * self.stride
        got = self._io("read", os.preadv, self._dfd, [buf], pos)
        if got != buf.nbytes:
            return None  # the file ends early: truncated since it was adopted
        if buf is not target:
            target[:] = buf[: self.block_bytes]
        after = self.header(slot)
        if after.gen != h.gen or after.key != key or checksum(target) != h.checksum:
            return None
        return h.checksum

    def sync(self) -> None:
        """Headers and payloads to the device (a clean stop)."""
        try:
            self._map.flush()
            os.fsync(self._fd)
        except OSError as e:
            raise DiskFault(e.errno or errno.EIO, "sync", f"disk tier sync on {self.path}: {e.strerror}") from e

    def close(self) -> None:
        self._hdr.release()
        self._map.close()
        os.close(self._dfd)
        os.close(self._fd)


def open_payload(path: Path, base: int = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC) -> tuple[int, bool]:
    """A descriptor for payload I/O, opened with `base` flags (the daemon's read-write, a
    client's read-only): O_DIRECT if the filesystem takes it (open and one aligned read both
    succeed: some filesystems accept the flag and fail the I/O), else buffered."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            fd = os.open(path, base | direct)
        except OSError:
            pass
        else:
            try:
                os.preadv(fd, [aligned_empty(PAGE).data], 0)
                return fd, True
            except OSError:
                os.close(fd)
    return os.open(path, base), False
