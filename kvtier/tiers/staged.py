"""Stores from client staging into a tier whose slots are in shared memory (the cpu arena, or a gpu
pool kept in host memory), batched: each command reserves its slot as it is handled; the batch's
slots are filled together at its end, in one thread hop, straight from the staging files (no
buffer in between), and their facts reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvtier.core.events import Store
from kvtier.core.index import Entry
from kvtier.core.outcomes import read, stored, written
from kvtier.failpoints import Failpoints
from kvtier.keys import BlockKey
from kvtier.offload import map_shares
from kvtier.shm.staging import StagingFile, StagingSegments
from kvtier.tiers.facts import Fact, Facts
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime
from kvtier.tiers.writes import LocalWrites

CHANGED = "staging slot changed or failed its checksum"
NO_ROOM = "no free slot and nothing clean to evict"

Filled = int | None | OSError  # the checksum verified in the slot; None: changed or corrupt; the read's error


@dataclass(slots=True)
class StagedStore:
    rt: PoolRuntime
    ev: Store
    dst: LocalTier
    entry: Entry  # the reserved (PENDING) slot
    staging: StagingFile
    t0: float  # when the command was received


class StagedStores:
    def __init__(self, staging: StagingSegments, writes: LocalWrites, facts: Facts, failpoints: Failpoints,
                 threads: int) -> None:
        self.staging = staging
        self.writes = writes
        self.facts = facts
        self.failpoints = failpoints
        self.threads = threads
        self._stores: list[StagedStore] = []
        self._blocks: set[tuple[str, BlockKey]] = set()
        self.nbytes = 0

    def __contains__(self, block: tuple[str, BlockKey]) -> bool:
        """Whether (pool, key) is queued in this batch."""
        return block in self._blocks

    async def queue(self, rt: PoolRuntime, dst: LocalTier, ev: Store, staging: StagingFile, t0: float) -> Fact | None:
        """Reserve the slot now (None: the fact comes at `drain`), or fail for want of room."""
        e = await self.writes.reserve(rt, dst, ev.key, ev.parent)
        if e is None:
            self.staging.release(ev.segment, rt.layout.block_bytes, ev.slot, ev.gen)
            return self.facts.settle(rt, written(ev, dst.tier, None), ev, NO_ROOM)
        self._stores.append(StagedStore(rt, ev, dst, e, staging, t0))
        self._blocks.add((rt.name, ev.key))
        self.nbytes += rt.layout.block_bytes
        return None

    def take(self) -> list[StagedStore]:
        stores, self._stores = self._stores, []
        self._blocks.clear()
        self.nbytes = 0
        return stores

    async def drain(self, stores: list[StagedStore]) -> None:
        """Fill the slots of `stores` (taken from the queue), release their staging slots, and
        report each store's outcome."""
        if not stores:
            return
        self.writes.maybe_tear(stores[0].dst, stores[0].entry)
        results = await fill(stores, self.writes.off_loop_bytes, self.threads)
        self.failpoints.reached("shm_written")
        for s, got in zip(stores, results):
            outcome, detail = read(s.ev, s.dst.tier, got), ""
            if outcome is None:
                outcome = stored(s.ev, s.dst.tier, s.rt.finish(s.dst, s.entry).slot)
            else:
                s.rt.abort(s.dst, s.entry)
                detail = CHANGED if got is None else str(got)
            # Released once the block is visible: its client reads its own staged blocks until
            # then (ClientPool._read_own), so there is no moment when neither copy is there.
            self.staging.release(s.ev.segment, s.rt.layout.block_bytes, s.ev.slot, s.ev.gen)
            self.facts.report(s.rt, self.facts.settle(s.rt, outcome, s.ev, detail), s.t0)


async def fill(stores: list[StagedStore], off_loop_bytes: int, threads: int) -> list[Filled]:
    """Read each staged block straight into its reserved slot, verified there: on the loop when
    small, else in `threads` threads, each filling only its own share of the slots. Cancelled
    (the copies themselves have finished): every slot is unreserved, and the staging slots are
    left to the redelivery of these commands, or to their client's reclaim."""
    try:
        if sum(s.rt.layout.block_bytes for s in stores) < off_loop_bytes:
            return _fill_from_staging(stores)
        return await map_shares(None, _fill_from_staging, stores, threads)
    except BaseException:
        for s in stores:
            s.rt.abort(s.dst, s.entry)
        raise


def _fill_from_staging(stores: Sequence[StagedStore]) -> list[Filled]:
    """Off the loop: touches only the reserved slots and the staging files."""
    out: list[Filled] = []
    for s in stores:
        try:
            out.append(s.dst.fill_from(s.entry, partial(s.staging.read_into, s.ev.slot, s.ev.key, s.ev.gen)))
        except OSError as e:
            out.append(e)
    return out
