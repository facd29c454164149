"""A tier worker's writes into its local tier: reserve a slot (making room if full), copy, commit.

The slot I/O is the LocalTier's; the index changes go through the pool's Placement (`PoolRuntime`
`finish`, `abort`). Copies big enough to stall the event loop run in a thread, and are waited
for even when the caller is cancelled: they write into a slot that is about to be freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from kvtier.core.events import Tier
from kvtier.core.index import Entry
from kvtier.failpoints import Failpoints
from kvtier.keys import BlockKey
from kvtier.offload import run_off_loop
from kvtier.tiers.evicting import Evictions
from kvtier.tiers.facts import Facts
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime, SlotTier

T = TypeVar("T")


class LocalWrites:
    def __init__(self, tier: Tier, evictions: Evictions, facts: Facts, failpoints: Failpoints,
                 off_loop_bytes: int) -> None:
        self.tier = tier
        self.evictions = evictions
        self.facts = facts
        self.failpoints = failpoints
        self.off_loop_bytes = off_loop_bytes

    async def write(self, rt: PoolRuntime, dst: SlotTier, key: BlockKey, parent: BlockKey | None,
                    data: np.ndarray, csum: int) -> Entry | None:
        """Store a verified block and make it visible; the entry already there if there is one.
        None when the tier has no room, even after making some."""
        if (have := dst.index.get(key)) is not None:
            return have
        e = await self.reserve(rt, dst, key, parent)
        if e is None:
            return None
        self.maybe_tear(dst, e)
        try:
            await self.off_loop(data.nbytes, dst.fill, e, data, csum)
        except BaseException:
            rt.abort(dst, e)
            raise
        self.failpoints.reached("shm_written")
        return rt.finish(dst, e)

    async def reserve(self, rt: PoolRuntime, dst: SlotTier, key: BlockKey, parent: BlockKey | None) -> Entry | None:
        """A PENDING slot for `key`, making room once if the tier is full; None when there is none."""
        e = rt.placement.reserve(dst.tier, key, parent)
        if e is None and (dropped := await self.evictions.make_room(rt, dst)) is not None:
            self.facts.add(dropped)  # reported like any eviction
            e = rt.placement.reserve(dst.tier, key, parent)
        return e

    def maybe_tear(self, dst: SlotTier, e: Entry) -> None:
        """The `shm_torn` failpoint: die halfway through a cpu-arena write, the slot left odd."""
        if self.tier == Tier.CPU and isinstance(dst, LocalTier) and dst.device_payload is None \
                and self.failpoints.due("shm_torn"):
            dst.table.begin_write(e.slot)
            dst.table.payload(e.slot)[: dst.block_bytes // 2] = 0xA5
            self.failpoints.die()

    async def off_loop(self, nbytes: int, fn: Callable[..., T], *args: object) -> T:
        """Run a block copy in a thread when it is big enough to stall the loop."""
        if nbytes < self.off_loop_bytes:
            return fn(*args)
        out: T = await run_off_loop(None, fn, *args)
        return out
