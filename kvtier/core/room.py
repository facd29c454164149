"""What one pool's tiers have room for: the blocks on their way in (and the prefetched ones
waiting for room), the clean blocks a full tier can drop at once, and the rule that keeps a
chain's head on the node while its extensions are here. Pure: no I/O; time is passed in.

`Placement` (kvtier/core/policy.py) is a Room: its decisions mark what they send in flight here,
and ask here how much room a tier has. The tier workers' make-room rule (core/eviction.py
`room_victim`) takes its victim from `clean_victim`, in the order `_clean_spares` counts them.
A session-pinned block (core/pins.py) is a victim only where a tier below on the node holds it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, KeysView

from kvtier.core.events import Tier
from kvtier.core.index import Entry, State, TierIndex
from kvtier.core.pins import Pins
from kvtier.core.residency import NODE, Residency
from kvtier.keys import BlockKey

# How many of a tier's coldest blocks a put that does not fit looks through for clean ones.
SPARE_WINDOW = 4096


class InFlight:
    """Blocks commanded into one local tier whose outcome fact has not come back, with their
    give-up times and parents. Counting them keeps a burst of puts from over-filling a tier
    before its worker catches up; their parents keep a chain's head from leaving the node while
    its tail is still on its way into the other tier (an index counts only visible children)."""

    def __init__(self) -> None:
        self._until: dict[BlockKey, float] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._kids: dict[BlockKey, int] = {}
        # (until, key), soonest first, so that `expire` (on every decision) walks only what is
        # due, not every block in flight. An entry whose key has gone or was added again with
        # another time is skipped when met, and the heap is rebuilt once it holds far more.
        self._due: list[tuple[float, BlockKey]] = []

    def add(self, key: BlockKey, parent: BlockKey | None, until: float) -> None:
        self.pop(key)
        self._until[key], self._parent[key] = until, parent
        if parent is not None:
            self._kids[parent] = self._kids.get(parent, 0) + 1
        heapq.heappush(self._due, (until, key))
        if len(self._due) > 4 * len(self._until) + 65536:  # rebuilt: its cost spread over as many adds
            self._due = [(u, k) for k, u in self._until.items()]
            heapq.heapify(self._due)

    def pop(self, key: BlockKey) -> None:
        if self._until.pop(key, None) is None:
            return
        parent = self._parent.pop(key)
        if parent is not None:
            n = self._kids[parent] - 1
            if n:
                self._kids[parent] = n
            else:
                del self._kids[parent]

    def expire(self, now: float) -> list[BlockKey]:
        """Give up what was due by `now`; the keys given up."""
        due, gone = self._due, []
        while due and due[0][0] <= now:
            until, key = heapq.heappop(due)
            if self._until.get(key) == until:
                gone.append(key)
                self.pop(key)
        return gone

    def kids(self, parent: BlockKey) -> int:
        """How many blocks on their way in hang off `parent`."""
        return self._kids.get(parent, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._until

    def keys(self) -> KeysView[BlockKey]:
        return self._until.keys()

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._until)

    def __len__(self) -> int:
        return len(self._until)


class Room(Residency):
    pins: Pins  # session pins (core/pins.py), kept on the node: Placement makes them, with the pool's rules

    def __init__(self, tiers: dict[Tier, TierIndex]) -> None:
        super().__init__(tiers)
        self._incoming: dict[Tier, InFlight] = {t: InFlight() for t in NODE}
        self._leases: dict[BlockKey, float] = {}  # prefetched key -> lease expiry
        # Prefetched blocks waiting for a free cpu slot, in request order (a chain's head
        # first): key -> (parent, give-up time). Promoted as shedding frees room (core/promotion.py).
        self._wanted: dict[BlockKey, tuple[BlockKey | None, float]] = {}

    def node_slots(self) -> int:
        """The node's slots in service now (gpu, cpu and disk)."""
        return sum(self.tiers[t].capacity or 0 for t in NODE)

    def _expire(self, now: float) -> None:
        """Give up what has been in flight, leased or waiting since before `now`."""
        for key in [k for k, until in self._leases.items() if until <= now]:
            del self._leases[key]
        for key in [k for k, (_, until) in self._wanted.items() if until <= now]:
            del self._wanted[key]
        for pending in self._incoming.values():
            for key in pending.expire(now):
                self.forget_tenant(key)
        self.pins.expire(now)

    def forget_tenant(self, key: BlockKey) -> None:
        """A block gone from the node, or that never arrived: its tenant is forgotten, unless it
        is on the node or on its way there after all."""
        if all(self.tiers[u].get(key) is None and key not in self._incoming[u] for u in NODE):
            self.tenants.forget(key)

    def incoming(self, t: Tier) -> int:
        """Blocks on their way into `t` that its index does not hold yet. (Once the worker has
        reserved a slot the block counts in the index; counting it here too would double it.)"""
        return self.tiers[t].absent(self._incoming[t].keys())

    def room(self, t: Tier) -> int:
        idx = self.tiers[t]
        return max(0, idx.free - self.incoming(t)) if idx.capacity else 0

    def still_clean(self, t: Tier, key: BlockKey) -> bool:
        """Whether `key`, which `clean_victim` chose, may still be dropped from `t`: visible there,
        with no child there, and clean. For a worker that waited on Redis since the choice."""
        idx = self.tiers[t]
        e = idx.get(key)
        return e is not None and e.state is State.READY and not idx.children(key) and self._clean(t, e)

    def clean_victim(self, t: Tier) -> BlockKey | None:
        """A block `t` may drop right now to make room: one the next tier is believed to hold.
        For cpu that belief is the record of what was written to Redis; the worker confirms it
        with Redis before dropping the last local copy."""
        if t == Tier.REDIS:
            return None
        return next(self._clean_victims(t), None)

    def _clean_victims(self, t: Tier) -> Iterator[BlockKey]:
        idx = self.tiers[t]
        fair = self.tenants.evictable(t, idx.capacity or 0)
        for e in idx.ready():
            if not idx.children(e.key) and self._clean(t, e) and (fair is None or self.tenants.owner(e.key) in fair):
                yield e.key

    def held_below(self, t: Tier, key: BlockKey) -> Tier | None:
        """A tier below `t` that holds `key`, so `t` may drop its copy: a node tier first; Redis
        only below cpu and disk (gpu's copy does not leave the node for Redis this way)."""
        for u in NODE:
            if u > t and key in self.tiers[u]:
                return u
        return Tier.REDIS if t != Tier.GPU and key in self.tiers[Tier.REDIS] else None

    def _clean(self, t: Tier, e: Entry) -> bool:
        """`e` may be dropped from `t` as soon as no child of it is left there: a tier below
        holds it, and nothing else keeps it. A block already leaving for the tier below counts:
        its pin is ours, not a reader's."""
        lower = self.held_below(t, e.key)
        return (e.pins == int(e.leaving) and lower is not None and e.key not in self._leases
                and not self.kept_on_node(t, e.key, lower))

    def _clean_spares(self, t: Tier, want: int) -> int:
        """How many more blocks a full `t` can take now, at most `want`: the worker makes room
        for each by dropping a block the next tier holds (a chain's tail first, then the block
        that tail hung off), beyond those that blocks already on their way in will take. Only
        the coldest SPARE_WINDOW blocks are looked at: this runs for every put that does not fit."""
        idx = self.tiers[t]
        need = max(0, self.incoming(t) - idx.free) + want
        fair = self.tenants.evictable(t, idx.capacity or 0)  # while a tenant is over its share: only theirs
        clean = {e.key: e for e in itertools.islice(idx.ready(), SPARE_WINDOW)
                 if self._clean(t, e) and (fair is None or self.tenants.owner(e.key) in fair)}
        kids = {key: idx.children(key) for key in clean}  # children not yet counted as dropped
        below = {key: self.held_below(t, key) for key in clean}
        leaves = [key for key, n in kids.items() if n == 0]
        found = 0
        while leaves and found < need:
            leaf = leaves.pop()
            parent = clean[leaf].parent
            found += 1
            if parent in kids:
                if below[parent] not in NODE and (below[leaf] in NODE or self.tiers[Tier.DISK].capacity):
                    # The dropped child may stay on the node: on disk now, or written back there
                    # before the worker makes room (shedding, decided after this count, may send
                    # it). Its parent, held only off the node, then may not go (strands_children),
                    # so it is no spare.
                    kids[parent] = -1
                    continue
                kids[parent] -= 1
                if kids[parent] == 0:
                    leaves.append(parent)
        return max(0, found - (need - want))

    def children(self, t: Tier, key: BlockKey) -> int:
        """Children of `key` in local tier `t`: visible there, or on their way in."""
        return self.tiers[t].children(key) + self._incoming[t].kids(key)

    def kept_on_node(self, t: Tier, key: BlockKey, dst: Tier | None = None) -> bool:
        """Whether `key` may not leave node tier `t` for `dst` (None: dropped, the copy below
        stays, if any): the move would take it off the node while a child of it stays there
        (`strands_children`) or while a session pins it."""
        if dst is None:
            dst = self.held_below(t, key) or Tier.REDIS
        return dst not in NODE and (key in self.pins or self.strands_children(t, key, dst))

    def strands_children(self, t: Tier, key: BlockKey, dst: Tier | None = None) -> bool:
        """Whether `key` leaving node tier `t` (for `dst`) would take it off the node while a
        child of it stays in another node tier (resident, or on its way in): every lookup and
        read of that prefix would then stop short of the cached tail. Going down into a node
        tier (gpu to cpu, cpu or gpu to disk) keeps it on the node. Leaving cpu or disk for Redis
        means leaving the node (children in the tiers above keep it, and a cpu block's children
        on disk); leaving gpu does when no tier below on the node holds it."""
        if dst is None:  # dropped: the copy that stays is the one below, if any (else it leaves the node)
            dst = self.held_below(t, key) or Tier.REDIS
        if dst in NODE:
            return False
        if t == Tier.GPU:
            return (all(key not in self.tiers[u] for u in (Tier.CPU, Tier.DISK))
                    and any(self.children(u, key) > 0 for u in (Tier.CPU, Tier.DISK)))
        return any(self.children(u, key) > 0 for u in NODE if u != t)
