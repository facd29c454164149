"""Staging segments, both ends: the client's writer, and the daemon's reader and reaper.

A client writes new blocks into its own staging segment (StagingWriter) and names it in a Put
event. The daemon reads them (StagingFile) and releases each slot once it is done with it. It
never maps the segment: the client owns the file and could shrink it under a mapping, and touching a
mapped page past the end of the file kills the reader with SIGBUS. Through pread/pwrite a
shrunken file is just a short read, which is a miss. The bytes are untrusted either way: the
worker verifies key, length and checksum under the seqlock before storing anything.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier.core.events import StagedBlock
from kvtier.errors import SegmentError
from kvtier.keys import BlockKey
from kvtier.processes import pid_alive
from kvtier.shm.onepass import pread_hashed
from kvtier.shm.segment import SHM_DIR, ShmSegment
from kvtier.shm.slots import (
    EMPTY_KEY,
    HEADER_OFF,
    SLOT_HDR,
    SLOT_HEADER,
    SLOT_MAGIC,
    Flags,
    Kind,
    SlotHeader,
    SlotTable,
    checksum,
    parse_segment_header,
    segment_bytes,
)

if TYPE_CHECKING:
    from kvtier.logs import Log

_FLAGS_OFF = 4
# A staged block the daemon has not taken within this long is given up (see StagingWriter._reclaimed_slot).
STAGING_RECLAIM_S = 10.0
# The client's own counters, in the staging segment's header page past the segment header: what
# never reaches the daemon over the bus (blocks dropped while the bus is down, or staging full).
# The client writes `dropped` and `closed`; the daemon writes `collected`, what it has counted.
# So a restarted daemon counts only what is new, and a client that closes with uncounted drops
# leaves its segment for the daemon to count and unlink (StagingSegments.collect).
CLIENT_COUNTS = struct.Struct("<QQQ")  # dropped, collected, closed
CLIENT_COUNTS_OFF = 2048
_COLLECTED_OFF = CLIENT_COUNTS_OFF + 8
# A daemon adds at most this much per segment and collection: the counts are a client's word.
MAX_COUNT_STEP = 1 << 32


def staging_prefix(node: str) -> str:
    return f"kvtier.{node}.stage."


class StagingWriter:
    """A client's own staging segment for one pool: it takes free slots, writes blocks into them
    under the seqlock, and takes back slots the daemon never released."""

    def __init__(self, table: SlotTable, reclaim_s: float = STAGING_RECLAIM_S) -> None:
        self.table = table
        self.reclaim_s = reclaim_s  # a slot the daemon has not released this long is taken back
        self._cursor = 0
        self._staged_at: dict[int, float] = {}  # staging slot -> when it was last staged
        self._slot_of: dict[bytes, int] = {}  # the last slot each key was staged in (a hint: reads verify)

    @classmethod
    def create(cls, node: str, blocks: int, block_bytes: int, fingerprint: bytes, *, daemon_uid: int,
               shm_gid: int | None) -> StagingWriter:
        same_user = os.geteuid() == daemon_uid
        seg = ShmSegment.create(
            f"{staging_prefix(node)}{os.getpid()}.{secrets.token_hex(8)}", segment_bytes(blocks, block_bytes),
            mode=0o600 if same_user or shm_gid is None else 0o660,
            gid=None if same_user else shm_gid,
            reserve=True,  # every page now: a full /dev/shm fails here, not as a SIGBUS mid-put
        )
        return cls(SlotTable.format(seg, Kind.STAGING, blocks, block_bytes, fingerprint))

    @property
    def seg(self) -> ShmSegment:
        return self.table.seg

    def take_slots(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> list[StagedBlock]:
        """Take free slots for the leading keys (stops at the first with none) and mark each as
        being written (odd gen), so no other put takes it. `gen` is that odd gen until
        `fill_slot` (or `fill_slot_with`) has written the block."""
        taken: list[StagedBlock] = []
        free = iter(self._free_slots(len(keys)))
        for key in keys:
            slot = next(free, None)
            if slot is None:
                slot = self._reclaimed_slot()
            if slot is None:
                break
            taken.append(StagedBlock(key, parent, slot, self.table.begin_write(slot)))
            parent = key
        return taken

    def fill_slot(self, b: StagedBlock, row: npt.NDArray[Any]) -> StagedBlock:
        """Write a taken slot's block from `row` (uint8) and publish it READY, with its even gen.
        Touches only that slot, so the blocks of one put may be filled in threads side by side."""
        return StagedBlock(b.key, b.parent, b.slot,
                           self.table.write_reserved(b.slot, b.gen, b.key, row, Flags.READY, parent=b.parent))

    def fill_slot_with(self, b: StagedBlock, write: Callable[[npt.NDArray[np.uint8]], object]) -> StagedBlock:
        """As fill_slot, but `write(dst)` fills the slot's payload (a uint8 view of block_bytes)
        in place: a caller whose block is scattered (vLLM's per-layer pages) copies it once."""
        table = self.table
        dst = table.payloads()[b.slot, : table.block_bytes]
        write(dst)
        gen = table.end_write(b.slot, b.gen, b.key, table.block_bytes, checksum(dst), Flags.READY, b.parent)
        return StagedBlock(b.key, b.parent, b.slot, gen)

    def staged(self, blocks: list[StagedBlock]) -> None:
        """Note when these filled (READY) blocks were staged: a slot the daemon has not released
        STAGING_RECLAIM_S later may be taken back (see _reclaimed_slot)."""
        now = time.monotonic()
        for b in blocks:
            self._staged_at[b.slot] = now
            self._slot_of[b.key] = b.slot
        if len(self._slot_of) > 2 * self.table.n:  # forget keys whose slots were staged again since
            self._slot_of = {k: s for k, s in self._slot_of.items() if self.table.header(s).key == k}

    def slot_of(self, key: bytes) -> int | None:
        """The slot this client last staged `key` in, while it may still hold it (read your own
        writes before the daemon has placed them). A hint: the slot may have been released and
        written again since, so a read must verify it under the seqlock, flags READY."""
        return self._slot_of.get(key)

    def unstage(self, staged: list[StagedBlock]) -> None:
        """The daemon never heard of these (publishing failed, or the fill did): make the slots
        reusable, including one left half written (odd gen)."""
        for b in staged:
            if (g := self.table.gen(b.slot)) % 2:
                self.table.end_write(b.slot, g, EMPTY_KEY, 0, 0, Flags.EMPTY)
            else:
                self.table.set_flags(b.slot, Flags.EMPTY)

    def _free_slots(self, most: int) -> list[int]:
        """Up to `most` free slots (EMPTY, even gen), from the cursor on: one vectorised scan of
        the headers rather than a Python loop per slot."""
        table = self.table
        h = table.headers(0, table.n)
        free = np.flatnonzero((h["flags"] == Flags.EMPTY) & (h["gen"] % 2 == 0))
        if not free.size:
            return []
        start = int(np.searchsorted(free, self._cursor % table.n))
        picked: list[int] = np.concatenate((free[start:], free[:start]))[:most].tolist()
        self._cursor = picked[-1] + 1
        return picked

    def _reclaimed_slot(self) -> int | None:
        """None free. A slot the daemon has not released for `reclaim_s` belongs to a put it
        will never store (dead-lettered, or lost with a Redis restart): take it back, or the
        client would stay full for ever. Safe even if the put turns up later: rewriting the
        slot changes its generation, so the daemon's read of the old put fails verification."""
        table = self.table
        now = time.monotonic()
        for slot, at in sorted(self._staged_at.items(), key=lambda kv: kv[1]):
            if now - at < self.reclaim_s:
                break
            del self._staged_at[slot]
            if table.flags(slot) == Flags.READY and table.gen(slot) % 2 == 0:
                return slot
        return None

    def count_dropped(self, n: int) -> None:
        """`n` more blocks of this client's puts were dropped (never handed over): counted where
        the daemon reads them, since the bus may be what failed."""
        buf = self.seg.buf
        dropped, collected, closed = CLIENT_COUNTS.unpack_from(buf, CLIENT_COUNTS_OFF)
        CLIENT_COUNTS.pack_into(buf, CLIENT_COUNTS_OFF, dropped + n, collected, closed)

    def close(self, leave_uncounted: bool = True) -> None:
        """Unmap and unlink: the daemon forgets a segment whose file is gone (StagingSegments.reap).
        With drops the daemon has not counted yet (and `leave_uncounted`: a daemon is there), the
        segment is marked closed and left for the daemon to count and unlink."""
        dropped, collected, _ = CLIENT_COUNTS.unpack_from(self.seg.buf, CLIENT_COUNTS_OFF)
        if dropped != collected and leave_uncounted:
            CLIENT_COUNTS.pack_into(self.seg.buf, CLIENT_COUNTS_OFF, dropped, collected, 1)
            self.table.close()
        else:
            self.table.close()
            self.seg.unlink()


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
        if not 0 <= slot < self.n:
            return None
        raw = os.pread(self.fd, SLOT_HDR, HEADER_OFF + SLOT_HDR * slot)
        return SlotHeader(*SLOT_HEADER.unpack_from(raw, 0)) if len(raw) == SLOT_HDR else None

    def read_into(self, slot: int, key: bytes, gen: int, dst: npt.NDArray[np.uint8]) -> int | None:
        """Copy the block the client staged as (key, gen) into dst and verify it; checksum or None."""
        h = self.header(slot)
        if (h is None or h.magic != SLOT_MAGIC or h.gen != gen or gen % 2 or h.flags != Flags.READY
                or h.key != key or h.length != self.block_bytes or dst.nbytes != self.block_bytes):
            return None
        got, csum = pread_hashed(self.fd, dst, self._payload_off + self._stride * slot)
        again = self.header(slot)
        if got != self.block_bytes or again is None or again.gen != gen or again.key != key:
            return None
        return h.checksum if csum == h.checksum else None

    def release(self, slot: int, gen: int) -> bool:
        """Mark the slot EMPTY (free for its client), unless the client has already rewritten it."""
        h = self.header(slot)
        if h is None or h.gen != gen:
            return False
        os.pwrite(self.fd, Flags.EMPTY.to_bytes(4, "little"), HEADER_OFF + SLOT_HDR * slot + _FLAGS_OFF)
        return True

    def collect_drops(self) -> tuple[int, bool]:
        """The client's drops not counted yet (marked counted now), and whether the client has
        closed the segment. Untrusted: a count that went back counts nothing, and a step is capped."""
        raw = os.pread(self.fd, CLIENT_COUNTS.size, CLIENT_COUNTS_OFF)
        if len(raw) != CLIENT_COUNTS.size:
            return 0, False
        dropped, collected, closed = CLIENT_COUNTS.unpack(raw)
        new = min(max(0, dropped - collected), MAX_COUNT_STEP)
        if new:
            os.pwrite(self.fd, (collected + new).to_bytes(8, "little"), _COLLECTED_OFF)
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

    def reap(self, on_drops: Callable[[bytes, int], None] | None = None) -> int:
        """Count what each client dropped (`on_drops(fingerprint, blocks)`), unlink staging
        segments whose client died or closed them with drops to count, and forget those their
        client removed."""
        try:
            present = {p.name for p in SHM_DIR.iterdir() if self._name_re.fullmatch(p.name)}
        except OSError:
            return 0
        for name in [n for n in self._open if n not in present]:  # the client closed it
            self._open.pop(name).close()
        reaped = 0
        for name in present:
            pid = int(name[len(self._prefix):].split(".")[0])
            closed = self._collect(name, on_drops)
            if pid_alive(pid) and not closed:
                continue
            f = self._open.pop(name, None)
            if f is not None:
                f.close()
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
