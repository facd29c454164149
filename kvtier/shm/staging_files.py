"""Staging segments, the daemon's end: reading staged blocks, releasing slots, reaping segments.

The daemon never maps a staging segment: the client owns the file and could shrink it under a
mapping, and touching a mapped page past the end of the file kills the reader with SIGBUS.
Through pread/pwrite a shrunken file is just a short read, which is a miss. The bytes are
untrusted either way: the worker verifies key, length and checksum under the seqlock before
storing anything. The client's end, and the layout both share: shm/staging.py.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvtier.errors import SegmentError
from kvtier.processes import pid_alive
from kvtier.shm.onepass import pread_hashed
from kvtier.shm.segment import SHM_DIR
from kvtier.shm.slots import (
    HEADER_OFF,
    SLOT_HDR,
    SLOT_HEADER,
    Flags,
    Kind,
    SlotHeader,
    parse_segment_header,
)
from kvtier.shm.staging import (
    CLIENT_COUNTS,
    CLIENT_COUNTS_OFF,
    COLLECTED_OFF,
    FLAGS_OFF,
    MAX_COUNT_STEP,
    staging_prefix,
)

if TYPE_CHECKING:
    from kvtier.logs import Log


class StagingFile:
    """The daemon's handle on one client's staging segment, opened read-write as a plain file
    (never mapped): it reads staged blocks and releases their slots."""

    def __init__(self, name: str, fd: int, n: int, block_bytes: int, stride: int, payload_off: int,
                 fingerprint: bytes = b"") -> None:
        self.name = name
        self.fd = fd
        self.n = n
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint  # the pool layout the client staged for
        self._stride = stride
        self._payload_off = payload_off

    @classmethod
    def open(cls, name: str) -> StagingFile:
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise SegmentError(f"cannot open staging segment {name}: {e}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o002:
                raise SegmentError(f"staging segment {name} is not a private regular file")
            head = os.pread(fd, HEADER_OFF, 0)
            n, bb, stride, payload_off, fp = parse_segment_header(head, st.st_size, name, Kind.STAGING, None, None)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, n, bb, stride, payload_off, fp)

    def header(self, slot: int) -> SlotHeader | None:
        """One slot's header, read now (None: no such slot, or the file shrank)."""
        if not 0 <= slot < self.n:
            return None
        return _parse(os.pread(self.fd, SLOT_HDR, HEADER_OFF + SLOT_HDR * slot))

    # A batch of stores reads the whole header table once before its copies and once after,
    # rather than two preads per block: the seqlock check holds across the batch, since a gen
    # unchanged at the later read was unchanged all along.

    def headers(self) -> bytes | None:
        """Every slot's header, in one pread (None if the file shrank); see header_in."""
        raw = os.pread(self.fd, SLOT_HDR * self.n, HEADER_OFF)
        return raw if len(raw) == SLOT_HDR * self.n else None

    def header_in(self, table: bytes | None, slot: int) -> SlotHeader | None:
        """Slot's header as `table` (from headers()) holds it."""
        if table is None or not 0 <= slot < self.n:
            return None
        return _parse(table[SLOT_HDR * slot:SLOT_HDR * (slot + 1)])

    def staged_checksum(self, h: SlotHeader | None, key: bytes, gen: int) -> int | None:
        """The checksum the client wrote for (key, gen), when header `h` shows it staged whole
        (READY, even gen, full length); else None."""
        return h.checksum if h is not None and h.ready(key, gen, self.block_bytes) else None

    @staticmethod
    def unchanged(h: SlotHeader | None, key: bytes, gen: int) -> bool:
        """Header `h`, read after a copy, still names (key, gen): nothing was written meanwhile."""
        return h is not None and h.gen == gen and h.key == key

    def read_payload(self, slot: int, dst: npt.NDArray[np.uint8]) -> tuple[int, int]:
        """pread slot's payload into dst, hashed as it lands: (bytes read, xxh3). Unverified: the
        caller checks headers read before and after (staged_checksum, unchanged)."""
        return pread_hashed(self.fd, dst, self._payload_off + self._stride * slot)

    def read_into(self, slot: int, key: bytes, gen: int, dst: npt.NDArray[np.uint8]) -> int | None:
        """Copy the block the client staged as (key, gen) into dst and verify it; checksum or None."""
        want = self.staged_checksum(self.header(slot), key, gen)
        if want is None or dst.nbytes != self.block_bytes:
            return None
        got, csum = self.read_payload(slot, dst)
        ok = got == self.block_bytes and csum == want and self.unchanged(self.header(slot), key, gen)
        return want if ok else None

    def release(self, slot: int, gen: int) -> bool:
        """Mark the slot EMPTY (free for its client), unless the client has already rewritten it."""
        return self.release_many([(slot, gen)]) == 1

    def release_many(self, slots: Sequence[tuple[int, int]]) -> int:
        """release() of each (slot, gen), the headers read once; how many were released."""
        table = self.headers() if len(slots) > 1 else None
        done = 0
        for slot, gen in slots:
            h = self.header_in(table, slot) if table is not None else self.header(slot)
            if h is not None and h.gen == gen:
                os.pwrite(self.fd, Flags.EMPTY.to_bytes(4, "little"), HEADER_OFF + SLOT_HDR * slot + FLAGS_OFF)
                done += 1
        return done

    def collect_drops(self) -> tuple[int, bool]:
        """The client's drops not counted yet (marked counted now), and whether the client has
        closed the segment. Untrusted: a count that went back counts nothing, and a step is capped."""
        raw = os.pread(self.fd, CLIENT_COUNTS.size, CLIENT_COUNTS_OFF)
        if len(raw) != CLIENT_COUNTS.size:
            return 0, False
        dropped, collected, closed = CLIENT_COUNTS.unpack(raw)
        new = min(max(0, dropped - collected), MAX_COUNT_STEP)
        if new:
            os.pwrite(self.fd, (collected + new).to_bytes(8, "little"), COLLECTED_OFF)
        return new, closed == 1

    def close(self) -> None:
        os.close(self.fd)


class StagingSegments:
    """The daemon's staging segments of this node by name: opened and validated on first use,
    slots released, and the segments of dead clients reaped."""

    def __init__(self, node: str, log: Log) -> None:
        self._prefix = staging_prefix(node)
        self._name_re = re.compile(re.escape(self._prefix) + r"[0-9]+\.[0-9a-f]{8,32}")
        self._open: dict[str, StagingFile] = {}
        self.log = log

    def get(self, name: str, block_bytes: int) -> StagingFile:
        """The staging segment `name`, opened and validated; SegmentError if it cannot be used."""
        f = self.open_unchecked(name)
        if f.block_bytes != block_bytes:
            raise SegmentError(f"staging {name} holds blocks of {f.block_bytes} bytes, pool needs {block_bytes}")
        return f

    def open_unchecked(self, name: str) -> StagingFile:
        """The staging segment `name`, opened and validated, whatever its pool."""
        f = self._open.get(name)
        if f is None:
            if not self._name_re.fullmatch(name):
                raise SegmentError(f"{name!r} is not a staging segment of this node")
            f = self._open[name] = StagingFile.open(name)
        return f

    def present(self) -> set[str]:
        """The staging segments of this node in /dev/shm now."""
        try:
            return {p.name for p in SHM_DIR.iterdir() if self._name_re.fullmatch(p.name)}
        except OSError:
            return set()

    def release(self, name: str, block_bytes: int, slot: int, gen: int) -> bool:
        return self.release_many(name, block_bytes, [(slot, gen)]) == 1

    def release_many(self, name: str, block_bytes: int, slots: Sequence[tuple[int, int]]) -> int:
        try:
            return self.get(name, block_bytes).release_many(slots)
        except (SegmentError, OSError) as e:
            self.log.warning("staging.release_failed", segment=name, slots=[s for s, _ in slots][:8], error=str(e))
            return 0

    def reap(self, on_drops: Callable[[bytes, int], None] | None = None,
             on_gone: Callable[[str], None] | None = None) -> int:
        """Count what each client dropped (`on_drops(fingerprint, blocks)`), unlink staging
        segments whose client died or closed them with drops to count, and forget those their
        client removed; `on_gone(name)` for each segment forgotten or unlinked."""
        present = self.present()
        for name in [n for n in self._open if n not in present]:  # the client closed it
            self._open.pop(name).close()
            if on_gone is not None:
                on_gone(name)
        reaped = 0
        for name in present:
            pid = int(name[len(self._prefix):].split(".")[0])
            closed = self._collect(name, on_drops)
            if pid_alive(pid) and not closed:
                continue
            f = self._open.pop(name, None)
            if f is not None:
                f.close()
            if on_gone is not None:
                on_gone(name)
            try:
                (SHM_DIR / name).unlink()
            except FileNotFoundError:
                continue
            reaped += 1
            self.log.info("staging.reaped", segment=name, pid=pid, why="closed" if closed else "client gone")
        return reaped

    def _collect(self, name: str, on_drops: Callable[[bytes, int], None] | None) -> bool:
        """Count a segment's new drops; whether its client closed it. A segment that cannot be
        opened or validated is left alone (it may be half created)."""
        try:
            f = self._open.get(name) or StagingFile.open(name)
            self._open[name] = f
            n, closed = f.collect_drops()
        except (SegmentError, OSError):
            return False
        if n and on_drops is not None:
            on_drops(f.fingerprint, n)
        return closed

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _parse(raw: bytes) -> SlotHeader | None:
    return SlotHeader(*SLOT_HEADER.unpack_from(raw, 0)) if len(raw) == SLOT_HDR else None
