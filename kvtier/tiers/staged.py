"""Stores from client staging into a tier whose slots are in shared memory (the cpu arena, or a gpu
pool kept in host memory), batched: each command reserves its slot as it is handled; the batch's
slots are filled together at its end, in one thread hop, straight from the staging files (no
buffer in between), and their facts reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.core.events import Store
from kvtier.core.index import Entry
from kvtier.core.outcomes import read, stored, written
from kvtier.failpoints import Failpoints
from kvtier.keys import BlockKey
from kvtier.offload import map_shares
from kvtier.shm.staging_files import StagingFile, StagingSegments
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

    def __len__(self) -> int:  # blocks queued in this batch
        return len(self._blocks)

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
        settled = []
        for s, got in zip(stores, results):
            outcome, detail = read(s.ev, s.dst.tier, got), ""
            if outcome is None:
                outcome = stored(s.ev, s.dst.tier, s.rt.finish(s.dst, s.entry).slot)
            else:
                s.rt.abort(s.dst, s.entry)
                detail = CHANGED if got is None else str(got)
            settled.append(self.facts.settle(s.rt, outcome, s.ev, detail))
        # Released once the blocks are visible: a client reads its own staged blocks until then
        # (ClientPool._read_host), so there is no moment when neither copy is there.
        for (segment, bb), slots in _by_segment(stores).items():
            self.staging.release_many(segment, bb, slots)
        for s, fact in zip(stores, settled):
            self.facts.report(s.rt, fact, s.t0)


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


def _by_segment(stores: Sequence[StagedStore]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for s in stores:
        out.setdefault((s.ev.segment, s.rt.layout.block_bytes), []).append((s.ev.slot, s.ev.gen))
    return out


def _fill_from_staging(stores: Sequence[StagedStore]) -> list[Filled]:
    """Off the loop: touches only the reserved slots and the staging files. Each staging file's
    headers are read once before the batch's copies and once after (StagingFile.headers); each
    block is pread straight into its slot and hashed as it lands (shm/onepass.py)."""
    out: list[Filled] = [None] * len(stores)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(stores):
        groups.setdefault(id(s.staging), []).append(i)
    for idxs in groups.values():
        f = stores[idxs[0]].staging
        begun: list[tuple[int, int, int | None]] = []  # (store, odd gen, checksum if the copy matched)
        try:
            before = f.headers()
            for i in idxs:
                s = stores[i]
                want = f.staged_checksum(f.header_in(before, s.ev.slot), s.ev.key, s.ev.gen)
                if want is None:
                    continue  # out[i] stays None: changed, gone or never staged
                g, payload = s.dst.begin_fill(s.entry)
                begun.append((i, g, None))
                got, csum = f.read_payload(s.ev.slot, payload)
                begun[-1] = (i, g, want if got == payload.nbytes and csum == want else None)
            after = f.headers()
        except OSError as e:
            for i, g, _ in begun:
                stores[i].dst.end_fill(stores[i].entry, g, None)
            for i in idxs:
                out[i] = e
            continue
        for i, g, verified in begun:
            s = stores[i]
            ok = verified is not None and f.unchanged(f.header_in(after, s.ev.slot), s.ev.key, s.ev.gen)
            out[i] = s.dst.end_fill(s.entry, g, verified if ok else None)
    return out
