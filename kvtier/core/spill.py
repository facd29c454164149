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

from kvtier.core.events import Copy, Failure, Tier
from kvtier.core.residency import LOCAL, Residency
from kvtier.keys import BlockKey

# How far up a spilled chain's ancestors are followed; a longer chain's older part was most
# likely written back long ago (a chain leaves tail first, and the ancestors are its head).
MAX_ANCESTORS = 4096


class SpillCopies:
    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._on_store: dict[BlockKey, float] = {}  # stored by a spilled put -> give-up time
        # Copies sent -> give-up time. A copy names the tier it reads from, which may shed the
        # block first (gpu demotes it to cpu): such a copy is redone from where the block is now.
        self._sent: dict[BlockKey, float] = {}

    def spilled(self, res: Residency, keys: Sequence[BlockKey], tiers: Sequence[Tier | None],
                parent: BlockKey | None, until: float) -> list[Copy]:
        """A put of `keys` was placed in `tiers` and part of it went to Redis: the copies to send
        now (local blocks Redis lacks: the put's own blocks already here, and its ancestors),
        and the blocks to copy once stored, remembered until `until`."""
        out: list[Copy] = []
        for key, tier in zip(keys, tiers):
            if tier in LOCAL:
                self._on_store[key] = until
            elif tier is None and (c := self._copy_now(res, key, until)) is not None:
                out.append(c)
        seen = 0
        while parent is not None and seen < MAX_ANCESTORS and (c := self._copy_now(res, parent, until)) is not None:
            out.append(c)
            parent, seen = c.parent, seen + 1
        return out

    def _copy_now(self, res: Residency, key: BlockKey, until: float) -> Copy | None:
        """A copy of `key` from the local tier that holds it now, unless Redis holds it."""
        if key in res.tiers[Tier.REDIS] or (found := res.ready_in(key)) is None:
            return None
        src, e = found
        self._sent[key] = until
        return Copy(self.pool, key, e.parent, src, Tier.REDIS)

    def stored(self, res: Residency, key: BlockKey, until: float) -> Copy | None:
        """A block stored locally: its copy, if a spilled put brought it."""
        if self._on_store.pop(key, None) is None:
            return None
        return self._copy_now(res, key, until)

    def copy_failed(self, res: Residency, key: BlockKey, why: Failure, until: float) -> Copy | None:
        """A copy found its source gone (the block moved between local tiers meanwhile): redo it
        from where the block is now. Other failures (a Redis error) are not redone at once: the
        block is written back when the cpu tier sheds it."""
        if self._sent.pop(key, None) is None or why != Failure.SOURCE_MISS:
            return None
        return self._copy_now(res, key, until)

    def copied(self, key: BlockKey) -> None:
        self._sent.pop(key, None)

    def forget(self, key: BlockKey) -> None:
        """Its store failed: nothing to copy."""
        self._on_store.pop(key, None)

    def expire(self, now: float) -> None:
        for marks in (self._on_store, self._sent):
            for key in [k for k, until in marks.items() if until <= now]:
                del marks[key]

    def __len__(self) -> int:
        return len(self._on_store) + len(self._sent)
