"""A put's granted blocks, adopted while the coordinator handles the put: no command, no fact on a stream.

A client with grants has written its blocks into their final cpu arena slots already
(kvtier/tiers/grants.py); what is left is to check each header and make it visible, which touches
no payload and waits on nothing. Sent through the streams as every other command is, it cost a
store_batch to the cpu worker and a stored_batch back, each encoded, written to Redis, read,
decoded and acked: about a sixth of the daemon's CPU on a put of 64 KiB blocks (13.5 us a block
against 11.2; docs/performance.md, the thirteenth stop). A grant is this daemon's alone (its
epoch): a restarted daemon refuses an earlier daemon's grants, so the blocks themselves lose
nothing by not travelling. What their facts call for (write-through and spill copies to Redis,
the router's events) is kept in memory until the coordinator's next flush publishes it: a
daemon killed in between loses that, where the old store_batch would have been redelivered; the
blocks come back with a warm restart, without those copies.

So the coordinator adopts them itself, through the same GrantBook code the cpu worker used, and
applies their facts in-process as if read from the facts stream. What stays with the cpu worker:
a put whose key it has queued work for (the put then goes as a store_batch, so that the worker's
per-block order holds), staged stores, transfers and evictions. Each adoption is stamped in the cpu
worker's command fence with a seq of the daemon's publisher that no entry carries, so that a late
redelivery of an older command for the same block (an evict) cannot undo it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from structlog.typing import FilteringBoundLogger

from kvtier.core.events import StagedBlock, StoreBatch, StoredBatch, Tier
from kvtier.core.fence import CommandFence, Stamp
from kvtier.keys import BlockKey
from kvtier.tiers.evicting import Evictions
from kvtier.tiers.facts import Fact, Facts
from kvtier.tiers.grants import GrantBook
from kvtier.tiers.pool import PoolRuntime

InProcessFact = Fact | StoredBatch


class GrantedPuts:
    def __init__(self, grants: GrantBook, fence: CommandFence, queued: Callable[[str, Iterable[BlockKey]], bool],
                 stamp: Callable[[], Stamp], log: FilteringBoundLogger) -> None:
        self.grants = grants
        self.fence = fence  # the cpu worker's
        self.queued = queued  # whether the cpu worker holds queued work for any of (pool, keys)
        self.stamp = stamp  # a fresh (epoch, seq) of the daemon's publisher
        self.facts = Facts(Tier.CPU, log)  # its own: the cpu worker's may hold a batch in progress
        self.evictions = Evictions(Tier.CPU, self.facts, log)

    def can_adopt(self, rt: PoolRuntime, blocks: Sequence[StagedBlock]) -> bool:
        """Whether a put's granted `blocks` may be adopted here: not when the cpu worker has work
        queued for one of them (the caller sends them as a store_batch then, so that the worker's
        per-block order holds)."""
        return rt.cpu.device_payload is None and not self.queued(rt.name, [b.key for b in blocks])

    def adopt(self, rt: PoolRuntime, segment: str, blocks: list[StagedBlock]) -> list[InProcessFact]:
        """Adopt a put's granted `blocks` (bound for the cpu tier; `can_adopt` said so, nothing
        having run since); their facts, for the coordinator to apply."""
        t0 = time.perf_counter()
        batch = StoreBatch(rt.name, Tier.CPU, segment, tuple(blocks))
        self.facts.report_adopted(rt, batch, blocks, self.grants.adopt_blocks(rt, batch, blocks), t0)
        self.fence.record_many(rt.name, [b.key for b in blocks], self.stamp())
        return self.facts.take()

    async def top_up(self) -> list[InProcessFact]:
        """Refill the rings of the clients whose grants were used, freeing clean blocks where no
        slot is free; the evictions' facts, for the coordinator to apply."""
        await self.grants.top_up(self.evictions.room_for_grant)
        return self.facts.take()
