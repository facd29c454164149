"""Write-backs into the disk tier, batched: several in flight at once, so the device stays busy.

Each demote (or copy) from a memory tier into the disk tier reserves its disk slot as the disk
worker handles the command, on the event loop (making room there as any write does); at the end
of the batch the blocks move in `threads` threads side by side, each reading its source slot
(verified) into a page-aligned buffer of its own and writing it to the block file with O_DIRECT
(kvtier/disk/blockfile.py); then, back on the loop, each block becomes visible or its slot is
freed, and its fact is reported. One command at a time kept one request in flight; `kvtier bench
--disk` shows the block file needs several for the device's speed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.events import Copy, Demote, Failure, Promote
from kvtier.core.index import Entry
from kvtier.core.outcomes import failed, read, stored
from kvtier.disk.blockfile import thread_buffer
from kvtier.errors import DiskFault
from kvtier.keys import BlockKey
from kvtier.offload import map_shares
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.facts import Fact, Facts
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime
from kvtier.tiers.staged import NO_ROOM
from kvtier.tiers.writes import LocalWrites

Moved = int | None | DiskFault  # the checksum written; None: the source no longer held it; the disk's error


@dataclass(slots=True)
class DiskMove:
    rt: PoolRuntime
    ev: Promote | Demote | Copy
    src: LocalTier
    slot: int  # the source slot
    dst: DiskTier
    entry: Entry  # the reserved (PENDING) disk slot
    t0: float


class DiskMoves:
    def __init__(self, writes: LocalWrites, facts: Facts, threads: int) -> None:
        self.writes = writes
        self.facts = facts
        self.threads = threads
        self._moves: list[DiskMove] = []
        self._blocks: set[tuple[str, BlockKey]] = set()
        self._local = threading.local()  # each copy thread's block buffer
        self.nbytes = 0

    def __len__(self) -> int:  # blocks queued in this batch
        return len(self._blocks)

    def __contains__(self, block: tuple[str, BlockKey]) -> bool:
        return block in self._blocks

    async def queue(self, rt: PoolRuntime, ev: Promote | Demote | Copy, src: LocalTier, slot: int, dst: DiskTier,
                    t0: float) -> Fact | None:
        """Reserve the disk slot now (None: the fact comes at `drain`), or fail for want of room."""
        e = await self.writes.reserve(rt, dst, ev.key, ev.parent)
        if e is None:
            return self.facts.settle(rt, failed(ev, dst.tier, Failure.NO_ROOM), ev, NO_ROOM)
        self._moves.append(DiskMove(rt, ev, src, slot, dst, e, t0))
        self._blocks.add((rt.name, ev.key))
        self.nbytes += rt.layout.block_bytes
        return None

    def take(self) -> list[DiskMove]:
        moves, self._moves = self._moves, []
        self._blocks.clear()
        self.nbytes = 0
        return moves

    async def drain(self, moves: list[DiskMove]) -> None:
        """Move the blocks of `moves` (taken from the queue) side by side; report each outcome."""
        if not moves:
            return
        try:
            results = await map_shares(None, self._move, moves, self.threads)
        except BaseException:
            for m in moves:
                m.rt.abort(m.dst, m.entry)
            raise
        for m, got in zip(moves, results):
            detail = ""
            if isinstance(got, DiskFault):
                m.rt.abort(m.dst, m.entry)
                outcome, detail = failed(m.ev, m.dst.tier, Failure.DISK), f"{got.op}: {got}"
            elif (bad := read(m.ev, m.dst.tier, got)) is not None:
                m.rt.abort(m.dst, m.entry)
                outcome, detail = bad, f"{m.src.tier.label} no longer holds a valid copy"
            else:
                outcome = stored(m.ev, m.dst.tier, m.rt.finish(m.dst, m.entry).slot)
            self.facts.report(m.rt, self.facts.settle(m.rt, outcome, m.ev, detail), m.t0)

    def _move(self, share: Sequence[DiskMove]) -> list[Moved]:
        """Off the loop: each source slot read and verified, then written to its disk slot."""
        out: list[Moved] = []
        for m in share:
            buf = thread_buffer(self._local, m.rt.layout.block_bytes)
            csum = m.src.read_slot(m.slot, m.ev.key, buf)
            if csum is None:
                out.append(None)
                continue
            try:
                m.dst.fill(m.entry, buf, csum)
            except DiskFault as e:
                out.append(e)
                continue
            out.append(csum)
        return out
