"""Which tier of one pool holds which block: the pool's tier indices, and the one way to change them.

`Placement` (kvtier/core/policy.py) is a Residency: it owns the indices, and its decisions read
and mark them. The tier workers report what they did to a tier through the methods here and
never touch an index themselves; the eviction rules (kvtier/core/eviction.py) only read them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.core.events import Tier
from kvtier.core.index import Entry, State, TierIndex
from kvtier.keys import BlockKey

LOCAL = (Tier.GPU, Tier.CPU)


class Residency:
    """`tiers` maps every Tier to its index (Redis: the blocks known to be there)."""

    def __init__(self, tiers: dict[Tier, TierIndex]) -> None:
        self.tiers = tiers

    def where(self, key: BlockKey) -> Tier | None:
        """The highest tier known to hold `key` as a visible block."""
        for t in (Tier.GPU, Tier.CPU, Tier.REDIS):
            if key in self.tiers[t]:
                return t
        return None

    def ready_in(self, key: BlockKey) -> tuple[Tier, Entry] | None:
        """The highest local tier holding `key` as a visible block, with its entry."""
        for t in LOCAL:
            if (e := self.tiers[t].get(key)) is not None and e.state is State.READY:
                return t, e
        return None

    # --- what the tier workers did ------------------------------------------------------------

    def reserve(self, t: Tier, key: BlockKey, parent: BlockKey | None) -> Entry | None:
        """A PENDING slot in local tier `t` for a block being written (counted as used, not
        visible); None when the tier is full or already has `key`."""
        return self.tiers[t].reserve(key, parent)

    def commit(self, t: Tier, key: BlockKey) -> Entry | None:
        """The reserved slot holds its block: visible, the most recently used."""
        return self.tiers[t].commit(key)

    def restore(self, t: Tier, key: BlockKey, parent: BlockKey | None, slot: int) -> Entry | None:
        """Warm restart: a verified block found in slot `slot` of local tier `t` (READY); None
        if the slot or the key is taken already."""
        return self.tiers[t].add(key, parent, slot)

    def bring_into_service(self, t: Tier, slots: Iterable[int]) -> int:
        """Slots of local tier `t` whose pages are now populated may be handed out."""
        return self.tiers[t].bring_into_service(slots)

    def unreserve(self, t: Tier, key: BlockKey) -> None:
        """The write into the reserved slot failed: free it."""
        self.tiers[t].remove(key)

    def dropped(self, t: Tier, key: BlockKey) -> None:
        """A worker dropped `key` from local tier `t`. Once no local tier holds it, its Redis copy
        is forgotten too: the daemon needs to know about Redis only for blocks it might drop
        locally, which keeps that record bounded by local capacity."""
        self.tiers[t].remove(key)
        if all(self.tiers[u].get(key) is None for u in LOCAL):
            self.tiers[Tier.REDIS].remove(key)

    def in_redis(self, key: BlockKey, parent: BlockKey | None) -> bool:
        """Redis holds `key` now (written there, or read back from there). Remembered, and True,
        only while a local copy exists: eviction consults this record, and `dropped` ends it."""
        if all(self.tiers[t].get(key) is None for t in LOCAL):
            return False
        self.tiers[Tier.REDIS].add(key, parent)
        return True

    def not_in_redis(self, key: BlockKey) -> None:
        """Redis no longer holds `key` (deleted, expired, evicted or corrupt there): stop believing it."""
        self.tiers[Tier.REDIS].remove(key)
