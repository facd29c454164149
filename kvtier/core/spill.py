"""A put that spills to Redis is written there whole (write-back only; pure).

When a chain does not fit locally its tail goes straight to Redis while its head stays here
(`Placement.admit`). Under write-back the head would reach Redis only when this node sheds it, so
for every other node the chain would start with a hole: Redis would hold blocks that no reader
can reach, since a read stops at the first block it finds nowhere. So the local part of a
spilled chain is copied to Redis too: the blocks of the put that this node held already, and
its ancestors that Redis lacks, at once; the blocks the put itself brought, once they are
stored (their `stored` fact). A copy is a write the node would make anyway when it sheds the
block, and it makes that later eviction a clean one.

Not with write-through (every block is copied already) nor with the frequency filter (the
operator asked Redis to hold only blocks read often: the spilled tail is the exception, since the
alternative is to drop it).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.core.events import Copy, Tier
from kvtier.core.residency import LOCAL, Residency
from kvtier.keys import BlockKey

# How far up a spilled chain's ancestors are followed; a longer chain's older part was most
# likely written back long ago (a chain leaves tail first, and the ancestors are its head).
MAX_ANCESTORS = 4096


class SpillCopies:
    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._on_store: dict[BlockKey, float] = {}  # stored by a spilled put -> give-up time

    def spilled(self, res: Residency, keys: Sequence[BlockKey], tiers: Sequence[Tier | None],
                parent: BlockKey | None, until: float) -> list[Copy]:
        """A put of `keys` was placed in `tiers` and part of it went to Redis: the copies to send
        now (local blocks Redis lacks: the put's own blocks already here, and its ancestors),
        and the blocks to copy once stored, remembered until `until`."""
        out: list[Copy] = []
        for key, tier in zip(keys, tiers):
            if tier in LOCAL:
                self._on_store[key] = until
            elif tier is None and (c := self._copy_now(res, key)) is not None:
                out.append(c)
        seen = 0
        while parent is not None and seen < MAX_ANCESTORS and (c := self._copy_now(res, parent)) is not None:
            out.append(c)
            parent, seen = c.parent, seen + 1
        return out

    def _copy_now(self, res: Residency, key: BlockKey) -> Copy | None:
        if key in res.tiers[Tier.REDIS] or (found := res.ready_in(key)) is None:
            return None
        src, e = found
        return Copy(self.pool, key, e.parent, src, Tier.REDIS)

    def stored(self, res: Residency, key: BlockKey, tier: Tier) -> Copy | None:
        """A block stored in local `tier`: its copy, if a spilled put brought it."""
        if self._on_store.pop(key, None) is None or key in res.tiers[Tier.REDIS]:
            return None
        e = res.tiers[tier].get(key)
        return None if e is None else Copy(self.pool, key, e.parent, tier, Tier.REDIS)

    def forget(self, key: BlockKey) -> None:
        """Its store failed: nothing to copy."""
        self._on_store.pop(key, None)

    def expire(self, now: float) -> None:
        for key in [k for k, until in self._on_store.items() if until <= now]:
            del self._on_store[key]

    def __len__(self) -> int:
        return len(self._on_store)
