"""Staging segments, the client's end: StagingWriter, and the layout both ends share.

A client writes new blocks into its own staging segment (StagingWriter) and names it in a Put
event. The daemon reads them and releases each slot once it is done with it (shm/staging_files.py).
Where the daemon has granted the segment cpu arena slots (shm/grant_ring.py), a put's leading
blocks go straight into those instead, and the daemon only checks their headers.
"""

from __future__ import annotations

import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.core.events import StagedBlock, staged_block
from kvtier.keys import BlockKey
from kvtier.shm.flips import begin_writes, end_writes
from kvtier.shm.grant_ring import GRANT_USE_S, GrantRing
from kvtier.shm.onepass import copy_rows, key_tags
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import (
    EMPTY_KEY,
    Flags,
    Kind,
    SlotTable,
    checksum,
    segment_bytes,
)

FLAGS_OFF = 4
# A staged block the daemon has not taken within this long is given up (see StagingWriter._reclaimed_slot).
STAGING_RECLAIM_S = 10.0
# The client's own counters, in the staging segment's header page past the segment header: what
# never reaches the daemon over the bus (blocks dropped while the bus is down, or staging full).
# The client writes `dropped` and `closed`; the daemon writes `collected`, what it has counted.
# So a restarted daemon counts only what is new, and a client that closes with uncounted drops
# leaves its segment for the daemon to count and unlink (StagingSegments.collect).
CLIENT_COUNTS = struct.Struct("<QQQ")  # dropped, collected, closed
CLIENT_COUNTS_OFF = 2048
COLLECTED_OFF = CLIENT_COUNTS_OFF + 8
# A daemon adds at most this much per segment and collection: the counts are a client's word.
MAX_COUNT_STEP = 1 << 32


def staging_prefix(node: str) -> str:
    return f"kvtier.{node}.stage."


class StagingWriter:
    """A client's own staging segment for one pool: it takes free slots, writes blocks into them
    under the seqlock, and takes back slots the daemon never released."""

    def __init__(self, table: SlotTable, reclaim_s: float = STAGING_RECLAIM_S, arena: SlotTable | None = None) -> None:
        self.table = table
        self.reclaim_s = reclaim_s  # a slot the daemon has not released this long is taken back
        self._cursor = 0
        self._staged_at: dict[int, float] = {}  # staging slot -> when it was last staged
        self._slot_of: dict[bytes, int] = {}  # the last slot each key was staged in (a hint: reads verify)
        # The pool's cpu arena, mapped writable (None: read-only, so no grants are used), the
        # grants taken from the ring and not used yet, and the daemon epoch they came under.
        self.arena = arena
        self._ring = GrantRing(table.seg.buf)
        self.grant_epoch = 0
        # (slot, when it was taken from the ring), oldest first: used in that order, so that none
        # waits in stock until its use-by while newer ones go first.
        self._grants: deque[tuple[int, float]] = deque()
        self._granted_of: dict[bytes, int] = {}  # key -> the granted slot it was written in (a hint)

    @classmethod
    def create(cls, node: str, blocks: int, block_bytes: int, fingerprint: bytes, *, daemon_uid: int,
               shm_gid: int | None, arena: SlotTable | None = None) -> StagingWriter:
        same_user = os.geteuid() == daemon_uid
        seg = ShmSegment.create(
            f"{staging_prefix(node)}{os.getpid()}.{secrets.token_hex(8)}", segment_bytes(blocks, block_bytes),
            mode=0o600 if same_user or shm_gid is None else 0o660,
            gid=None if same_user else shm_gid,
            reserve=True,  # every page now: a full /dev/shm fails here, not as a SIGBUS mid-put
        )
        return cls(SlotTable.format(seg, Kind.STAGING, blocks, block_bytes, fingerprint), arena=arena)

    @property
    def seg(self) -> ShmSegment:
        return self.table.seg

    def take_slots(self, keys: Sequence[BlockKey], parent: BlockKey | None, grants: bool = True
                   ) -> list[StagedBlock]:
        """Take slots for the leading keys (stops at the first with none), granted arena slots
        first, then free staging slots, and mark each as being written (odd gen), so no other
        put takes it. `gen` is that odd gen until `fill_slot` (or `fill_slot_with`) has written
        the block."""
        taken = self._take_grants(keys, parent) if grants else []
        if taken:
            parent = taken[-1].key
        free = iter(self._free_slots(len(keys) - len(taken)))
        for key in keys[len(taken):]:
            slot = next(free, None)
            if slot is None:
                slot = self._reclaimed_slot()
            if slot is None:
                break
            taken.append(StagedBlock(key, parent, slot, self.table.begin_write(slot)))
            parent = key
        return taken

    def grants_waiting(self) -> int:
        """Grants the daemon pushed that no put has taken yet, plus those taken and unused."""
        return self._ring.waiting() + len(self._grants)

    def _take_grants(self, keys: Sequence[BlockKey], parent: BlockKey | None) -> list[StagedBlock]:
        """Granted arena slots for the leading keys, as many as this client holds."""
        if self.arena is None:
            return []
        epoch, fresh, renewed = self._ring.take(self.grant_epoch)
        if renewed:  # a new daemon: what the old one granted is not ours any more
            self._grants.clear()
            self._granted_of.clear()
            self.grant_epoch = epoch
        now = time.monotonic()
        grants = self._grants
        while grants and now - grants[0][1] >= GRANT_USE_S:  # too old to start a write in: the daemon takes it back
            grants.popleft()
        grants.extend((s, now) for s in fresh if 0 <= s < self.arena.n)
        slots = [grants.popleft()[0] for _ in range(min(len(keys), len(grants)))]
        if not slots:
            return []
        odd = begin_writes(self.arena.headers(0, self.arena.n), np.array(slots, dtype=np.int64)).tolist()
        taken = []
        for key, slot, gen in zip(keys, slots, odd):
            taken.append(staged_block((key, parent, slot, gen, True)))
            parent = key
        return taken

    def _table(self, b: StagedBlock) -> SlotTable:
        return self.arena if b.granted and self.arena is not None else self.table

    def fill_slot(self, b: StagedBlock, row: npt.NDArray[Any]) -> StagedBlock:
        """Write a taken slot's block from `row` (uint8) and publish it READY, with its even gen.
        Touches only that slot, so the blocks of one put may be filled in threads side by side."""
        gen = self._table(b).write_reserved(b.slot, b.gen, b.key, row, Flags.READY, parent=b.parent)
        return StagedBlock(b.key, b.parent, b.slot, gen, b.granted)

    def fill_rows(self, share: Sequence[tuple[int, StagedBlock]], rows: npt.NDArray[np.uint8]) -> list[StagedBlock]:
        """fill_slot for (i, block) pairs of a put's taken slots, block i from rows[i] (rows: [*,
        block_bytes] uint8, rows contiguous), in share order: each table's copies in one
        `copy_rows` call (compiled, all of them with the GIL released), then its headers in one
        pass (READY, each with its even gen, as fill_slot writes one). Each source is hashed,
        never a slot."""
        done: dict[int, StagedBlock] = {}
        for granted in (True, False):
            part = [(i, b) for i, b in share if b.granted is granted]
            if part:
                blocks = [b for _, b in part]
                table = self._table(blocks[0])
                slots = np.fromiter((b.slot for b in blocks), np.int64, len(blocks))
                sums = copy_rows(table.payloads(), slots, rows, np.fromiter((i for i, _ in part), np.int64, len(part)),
                                 table.block_bytes, hash_src=True)
                done.update(zip((i for i, _ in part), self._commit_many(table, slots, blocks, sums)))
        return [done[i] for i, _ in share]

    def _commit_many(self, table: SlotTable, slots: npt.NDArray[np.int64], blocks: list[StagedBlock],
                     sums: npt.NDArray[np.uint64]) -> list[StagedBlock]:
        """`_commit` for a batch of one table's filled slots, each header step one store for all."""
        keys = b"".join(b.key for b in blocks)
        odd = np.fromiter((b.gen for b in blocks), np.uint64, len(blocks))
        end_writes(table.headers(0, table.n), slots, odd, {
            "flags": Flags.READY, "key": np.frombuffer(keys, dtype="V32"), "length": table.block_bytes,
            "checksum": sums, "parent": np.frombuffer(b"".join(b.parent or EMPTY_KEY for b in blocks), dtype="V32"),
            "tag": key_tags(keys, sums)})
        return [staged_block((b.key, b.parent, b.slot, b.gen + 1, b.granted)) for b in blocks]

    def _commit(self, b: StagedBlock, csum: int) -> StagedBlock:
        """A filled slot's header (key, parent, length, checksum, READY), then its even gen."""
        table = self._table(b)
        gen = table.end_write(b.slot, b.gen, b.key, table.block_bytes, csum, Flags.READY, b.parent)
        return StagedBlock(b.key, b.parent, b.slot, gen, b.granted)

    def fill_slot_with(self, b: StagedBlock, write: Callable[[npt.NDArray[np.uint8]], object]) -> StagedBlock:
        """As fill_slot, but `write(dst)` fills the slot's payload (a uint8 view of block_bytes)
        in place: a caller whose block is scattered (vLLM's per-layer pages) copies it once.
        `write` may return the xxh3-64 of what it wrote, hashed piece by piece from its own
        source as it wrote (one pass); else dst is hashed here, in the slot. A staging slot has
        no other writer; a granted arena slot could, if a client misbehaved or outlived a
        daemon restart mid-write (kvtier/tiers/grants.py), so a fill that hashes its source is
        the safe one there."""
        table = self._table(b)
        dst = table.payloads()[b.slot, : table.block_bytes]
        got = write(dst)
        return self._commit(b, got if type(got) is int else checksum(dst))

    def staged(self, blocks: list[StagedBlock]) -> None:
        """Note when these filled (READY) blocks were staged: a slot the daemon has not released
        STAGING_RECLAIM_S later may be taken back (see _reclaimed_slot)."""
        now = time.monotonic()
        for b in blocks:
            if b.granted:
                self._granted_of[b.key] = b.slot
                continue
            self._staged_at[b.slot] = now
            self._slot_of[b.key] = b.slot
        if len(self._slot_of) > 2 * self.table.n:  # forget keys whose slots were staged again since
            self._slot_of = {k: s for k, s in self._slot_of.items() if self.table.header(s).key == k}
        if len(self._granted_of) > 1024:  # the daemon has adopted most of them: the directory lists them
            self._granted_of.clear()

    def slot_of(self, key: bytes) -> int | None:
        """The slot this client last staged `key` in, while it may still hold it (read your own
        writes before the daemon has placed them). A hint: the slot may have been released and
        written again since, so a read must verify it under the seqlock, flags READY."""
        return self._slot_of.get(key)

    def granted_slot_of(self, key: bytes) -> int | None:
        """As slot_of, for a block this client wrote into a granted arena slot (read there with
        flags READY until the daemon flips it VALID and lists it)."""
        return self._granted_of.get(key)

    def unstage(self, staged: list[StagedBlock]) -> None:
        """The daemon never heard of these (publishing failed, or the fill did): make the slots
        reusable, including one left half written (odd gen). A granted slot is emptied and
        given up: the daemon takes it back when a put names it, or when it expires (the client's
        clock on it started when it was taken; kvtier/shm/grant_ring.py)."""
        for b in staged:
            if b.granted and self.arena is not None:
                if (g := self.arena.gen(b.slot)) % 2 == 0:
                    g = self.arena.begin_write(b.slot)
                self.arena.end_write(b.slot, g, EMPTY_KEY, 0, 0, Flags.EMPTY)
            elif (g := self.table.gen(b.slot)) % 2:
                self.table.end_write(b.slot, g, EMPTY_KEY, 0, 0, Flags.EMPTY)
            else:
                self.table.set_flags(b.slot, Flags.EMPTY)

    def _free_slots(self, most: int) -> list[int]:
        """Up to `most` free slots (EMPTY, even gen), from the cursor on: one vectorised scan of
        the headers rather than a Python loop per slot."""
        if most <= 0:  # a put wholly into granted slots: no scan
            return []
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
