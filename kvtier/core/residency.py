"""Which tier of one pool holds which block: the pool's tier indices, and the one way to change them.

`Placement` (kvtier/core/policy.py) is a Residency: it owns the indices, and its decisions read
and mark them. The tier workers report what they did to a tier through the methods here and
never touch an index themselves; the eviction rules (kvtier/core/eviction.py) only read them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtier.core.events import Tier
from kvtier.core.index import Entry, State, TierIndex
from kvtier.core.tenants import TenantUsage
from kvtier.keys import BlockKey

# The memory tiers: clients read them through shared memory; puts, prefetches and promotions on
# hits land there.
LOCAL = (Tier.GPU, Tier.CPU)
# Every tier on this node: the memory tiers and the disk tier below them. A block in any of them
# has not left the node.
NODE = (Tier.GPU, Tier.CPU, Tier.DISK)
# Every tier, upper first: iterating the enum itself costs a microsecond a call on a read's path.
ALL = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REDIS)


class Residency:
    """`tiers` maps every Tier to its index (Redis: the blocks known to be there). A pool without
    a disk tier gets an empty one (capacity 0), so every rule can ask it."""

    def __init__(self, tiers: dict[Tier, TierIndex]) -> None:
        tiers.setdefault(Tier.DISK, TierIndex(0))
        self.tiers = tiers
        # Whose each node block is, and blocks per tenant per node tier (core/tenants.py): kept
        # here, where every change to a node tier passes.
        self.tenants = TenantUsage()
        for t in NODE:
            for e in self.tiers[t].ready():
                self.tenants.added(t, e.key)

    def _added(self, t: Tier, e: Entry | None) -> Entry | None:
        if e is not None and t in NODE:
            self.tenants.added(t, e.key)
        return e

    def _removed(self, t: Tier, key: BlockKey, evicted: bool) -> bool:
        """Remove `key` from node tier `t`; whether no node tier holds it any more."""
        if self.tiers[t].get(key) is not None:
            self.tenants.removed(t, key, evicted)
            self.tiers[t].remove(key)
        gone = all(self.tiers[u].get(key) is None for u in NODE)
        if gone:
            self.forget_tenant(key)
        return gone

    def forget_tenant(self, key: BlockKey) -> None:
        """`key` is on the node no more: its owner goes (core/room.py: unless on its way back in)."""
        self.tenants.forget(key)

    def where(self, key: BlockKey) -> Tier | None:
        """The highest tier known to hold `key` as a visible block."""
        for t in ALL:
            if key in self.tiers[t]:
                return t
        return None

    def on_node(self, keys: Iterable[BlockKey]) -> Iterator[tuple[BlockKey, Tier]]:
        """(key, `where` it is) for each of `keys` some tier on this node holds as a visible
        block. For a read's report of thousands of blocks: the tiers that hold nothing at all
        are not asked about each key."""
        held = [(t, self.tiers[t].__contains__) for t in NODE if self.tiers[t].used]
        for key in keys:
            for t, holds in held:
                if holds(key):
                    yield key, t
                    break

    def below(self, t: Tier) -> Tier:
        """The tier `t` sheds into: the next one down that exists (cpu skips a disk tier of
        capacity 0 and sheds into Redis)."""
        for u in Tier:
            if u > t and (u == Tier.REDIS or self.tiers[u].capacity):
                return u
        raise ValueError(f"{t.label} is the lowest tier")

    def ready_in(self, key: BlockKey) -> tuple[Tier, Entry] | None:
        """The highest tier on this node holding `key` as a visible block, with its entry."""
        for t in NODE:
            if (e := self.tiers[t].get(key)) is not None and e.state is State.READY:
                return t, e
        return None

    # --- what the tier workers did ------------------------------------------------------------

    def reserve(self, t: Tier, key: BlockKey, parent: BlockKey | None) -> Entry | None:
        """A PENDING slot in local tier `t` for a block being written (counted as used, not
        visible); None when the tier is full or already has `key`."""
        return self._added(t, self.tiers[t].reserve(key, parent))

    def commit(self, t: Tier, key: BlockKey) -> Entry | None:
        """The reserved slot holds its block: visible, the most recently used."""
        return self.tiers[t].commit(key)

    def commit_many(self, t: Tier, entries: Iterable[Entry]) -> None:
        """`commit` for a batch's entries of local tier `t` (as `reserve` or `claim` made them)."""
        self.tiers[t].commit_many(entries)

    def restore(self, t: Tier, key: BlockKey, parent: BlockKey | None, slot: int) -> Entry | None:
        """Warm restart: a verified block found in slot `slot` of local tier `t` (READY); None
        if the slot or the key is taken already."""
        return self._added(t, self.tiers[t].add(key, parent, slot))

    def bring_into_service(self, t: Tier, slots: Iterable[int]) -> int:
        """Slots of local tier `t` whose pages are now populated may be handed out."""
        return self.tiers[t].bring_into_service(slots)

    def grant(self, t: Tier, n: int) -> list[int]:
        """Up to `n` free slots of local tier `t` handed to a client for its next puts (under no
        key, not free), never by evicting."""
        return self.tiers[t].grant(n)

    def claim(self, t: Tier, slot: int, key: BlockKey, parent: BlockKey | None) -> Entry | None:
        """A client wrote `key` into the granted `slot`: its PENDING entry, as `reserve` makes;
        None when the slot is not granted or `key` is here already."""
        return self._added(t, self.tiers[t].claim(slot, key, parent))

    def claim_many(self, t: Tier, claims: Iterable[tuple[int, BlockKey, BlockKey | None]]) -> list[Entry | None]:
        """`claim` for each (slot, key, parent) of a batch, in order; its owners counted at once."""
        got = self.tiers[t].claim_many(claims)
        if t in NODE:
            self.tenants.added_many(t, [e.key for e in got if e is not None])
        return got

    def ungrant(self, t: Tier, slot: int) -> bool:
        """A granted slot comes back unused (its client died, or its put was a duplicate)."""
        return self.tiers[t].ungrant(slot)

    def unreserve(self, t: Tier, key: BlockKey) -> None:
        """The write into the reserved slot failed: free it."""
        self._removed(t, key, evicted=False)

    def dropped(self, t: Tier, key: BlockKey) -> None:
        """A worker dropped `key` from node tier `t`. Once no tier on the node holds it, its Redis
        copy is forgotten too: the daemon needs to know about Redis only for blocks it might drop
        here, which keeps that record bounded by the node's capacity."""
        if self._removed(t, key, evicted=True):
            self.tiers[Tier.REDIS].remove(key)

    def retired(self, t: Tier) -> list[Entry]:
        """Node tier `t` failed (a disk that hit EIO, ENOSPC or a read-only remount): it holds
        nothing from now on and takes nothing, so the tiers above shed past it. Its blocks are
        returned; the Redis record of those no other node tier holds is forgotten, as `dropped`."""
        gone = self.tiers[t].retire()
        for e in gone:
            self.tenants.removed(t, e.key, evicted=False)
            if all(self.tiers[u].get(e.key) is None for u in NODE):
                self.forget_tenant(e.key)
                self.tiers[Tier.REDIS].remove(e.key)
        return gone

    def in_redis(self, key: BlockKey, parent: BlockKey | None) -> bool:
        """Redis holds `key` now (written there, or read back from there). Remembered, and True,
        only while a copy on the node exists: eviction consults this record, and `dropped` ends it."""
        if all(self.tiers[t].get(key) is None for t in NODE):
            return False
        self.tiers[Tier.REDIS].add(key, parent)
        return True

    def not_in_redis(self, key: BlockKey) -> None:
        """Redis no longer holds `key` (deleted, expired, evicted or corrupt there): stop believing it."""
        self.tiers[Tier.REDIS].remove(key)
