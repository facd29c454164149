"""Client staging segments as the daemon sees them: read through a file descriptor, reaped when the client dies.

A client writes new blocks into its own staging segment and names it in a Put event. The daemon
never maps it: the client owns the file and could shrink it under a mapping, and touching a
mapped page past the end of the file kills the reader with SIGBUS. Through pread/pwrite a
shrunken file is just a short read, which is a miss. The bytes are untrusted either way: the
worker verifies key, length and checksum under the seqlock before storing anything.
"""

from __future__ import annotations

import os
import re
import stat

import numpy as np

from kvtier.errors import SegmentError
from kvtier.processes import pid_alive
from kvtier.tiers.segment import SHM_DIR
from kvtier.tiers.slots import (HEADER_OFF, SLOT_HDR, SLOT_HEADER, SLOT_MAGIC, Flags, Kind, SlotHeader,
                                checksum, parse_segment_header)

_FLAGS_OFF = 4


def staging_prefix(node: str) -> str:
    return f"kvtier.{node}.stage."


class StagingFile:
    """One client's staging segment, opened read-write as a plain file."""

    def __init__(self, name: str, fd: int, n: int, block_bytes: int, stride: int, payload_off: int) -> None:
        self.name = name
        self.fd = fd
        self.n = n
        self.block_bytes = block_bytes
        self._stride = stride
        self._payload_off = payload_off

    @classmethod
    def open(cls, name: str) -> "StagingFile":
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentError(f"cannot open staging segment {name}: {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o002:
                raise SegmentError(f"staging segment {name} is not a private regular file")
            head = os.pread(fd, HEADER_OFF, 0)
            n, bb, stride, payload_off, _fp = parse_segment_header(head, st.st_size, name, Kind.STAGING, None, None)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, n, bb, stride, payload_off)

    def header(self, slot: int) -> SlotHeader | None:
        if not 0 <= slot < self.n:
            return None
        raw = os.pread(self.fd, SLOT_HDR, HEADER_OFF + SLOT_HDR * slot)
        return SlotHeader(*SLOT_HEADER.unpack_from(raw, 0)) if len(raw) == SLOT_HDR else None

    def read_into(self, slot: int, key: bytes, gen: int, dst: np.ndarray) -> int | None:
        """Copy the block the client staged as (key, gen) into dst and verify it; checksum or None."""
        h = self.header(slot)
        if (h is None or h.magic != SLOT_MAGIC or h.gen != gen or gen % 2 or h.flags != Flags.READY
                or h.key != key or h.length != self.block_bytes or dst.nbytes != self.block_bytes):
            return None
        got = os.preadv(self.fd, [memoryview(dst)], self._payload_off + self._stride * slot)
        again = self.header(slot)
        if got != self.block_bytes or again is None or again.gen != gen or again.key != key:
            return None
        return h.checksum if checksum(dst) == h.checksum else None

    def release(self, slot: int, gen: int) -> bool:
        """Mark the slot EMPTY (free for its client), unless the client has already rewritten it."""
        h = self.header(slot)
        if h is None or h.gen != gen:
            return False
        os.pwrite(self.fd, Flags.EMPTY.to_bytes(4, "little"), HEADER_OFF + SLOT_HDR * slot + _FLAGS_OFF)
        return True

    def close(self) -> None:
        os.close(self.fd)


class StagingSegments:
    def __init__(self, node: str, log) -> None:
        self._prefix = staging_prefix(node)
        self._name_re = re.compile(re.escape(self._prefix) + r"[0-9]+\.[0-9a-f]{8,32}")
        self._open: dict[str, StagingFile] = {}
        self.log = log

    def get(self, name: str, block_bytes: int) -> StagingFile:
        """The staging segment `name`, opened and validated; SegmentError if it cannot be used."""
        f = self._open.get(name)
        if f is None:
            if not self._name_re.fullmatch(name):
                raise SegmentError(f"{name!r} is not a staging segment of this node")
            f = self._open[name] = StagingFile.open(name)
        if f.block_bytes != block_bytes:
            raise SegmentError(f"staging {name} holds blocks of {f.block_bytes} bytes, pool needs {block_bytes}")
        return f

    def release(self, name: str, block_bytes: int, slot: int, gen: int) -> bool:
        try:
            return self.get(name, block_bytes).release(slot, gen)
        except (SegmentError, OSError) as e:
            self.log.warning("staging.release_failed", segment=name, slot=slot, error=str(e))
            return False

    def reap(self) -> int:
        """Unlink staging segments whose client died; forget those their client removed."""
        try:
            present = {p.name for p in SHM_DIR.iterdir() if p.name.startswith(self._prefix)}
        except OSError:
            return 0
        for name in [n for n in self._open if n not in present]:  # the client closed it
            self._open.pop(name).close()
        reaped = 0
        for name in present:
            try:
                pid = int(name[len(self._prefix):].split(".")[0])
            except ValueError:
                continue
            if pid_alive(pid):
                continue
            f = self._open.pop(name, None)
            if f is not None:
                f.close()
            try:
                (SHM_DIR / name).unlink()
            except FileNotFoundError:
                continue
            reaped += 1
            self.log.info("staging.reaped", segment=name, pid=pid)
        return reaped

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
