"""Shedding: a local tier above its high watermark sends its coldest blocks down. Pure: no I/O;
time is passed in.

Above `high_watermark` of its slots (counting blocks on their way in, and for cpu the prefetched
blocks waiting for room), a tier sheds its coldest evictable blocks down to `low_watermark`: a
block the next tier already holds is evicted at once; any other is demoted (write-back) and
stays readable, pinned, until the next tier reports it stored (then `Placement.on_fact` sends the
evict). Candidates are the tier's LRU leaves (no resident child in the same tier), never leased
ones nor ones whose children are on their way in; a block is also kept while a child of it sits
in the other local tier and the move would take it off the node, so no block leaves the node
before its extensions, nor a session-pinned one (core/pins.py) before its pin ends. When cpu
has no room, gpu writes its victims that have no child in cpu straight to Redis: cpu may be full
of exactly those protected parents, and waiting for it would freeze both tiers. With the
frequency filter (`redis_admit_after_hits` = N > 0) a block read fewer than N times is not
written to Redis: cpu drops it, with the reason "unreused".

A block chosen to leave carries a leaving mark (a pin of its own, so it is never chosen twice)
until its worker acts, the command fails, or `transfer_timeout_s` passes.
"""

from __future__ import annotations

from kvtier.core.disk_admission import AdmissionCounts, DiskAdmit, disk_admission
from kvtier.core.events import Command, Demote, Evict, Reason, Tier
from kvtier.core.index import Entry, TierIndex
from kvtier.core.knobs import PolicyKnobs
from kvtier.core.residency import NODE
from kvtier.core.room import Room
from kvtier.keys import BlockKey

# Evict reasons that may drop a block no lower tier holds: documented rules, not accidents.
DROP_REASONS = frozenset({Reason.UNREUSED})


class Shedding(Room):
    def __init__(self, pool: str, tiers: dict[Tier, TierIndex], knobs: PolicyKnobs) -> None:
        super().__init__(tiers)
        self.pool = pool
        self.knobs = knobs
        self._leaving: dict[tuple[Tier, BlockKey], float] = {}  # (tier, key) chosen to leave -> give-up time
        # Demotes in flight: (destination, key) -> source. A block can be leaving gpu and cpu at
        # once (gpu -> cpu done, its gpu evict not yet carried out, cpu -> redis under way), so
        # the fact alone does not say which copy a completed write-back releases.
        self._demoting: dict[tuple[Tier, BlockKey], Tier] = {}
        self.disk_admissions = AdmissionCounts()  # why blocks shed from cpu went to disk, or did not

    def reused(self, key: BlockKey) -> bool:
        """Whether Redis should admit this block (the frequency filter): read often enough, or no
        filter. The filter's drop (reason "unreused") is for the others only."""
        n = self.knobs.redis_admit_after_hits
        return not n or any((e := self.tiers[t].get(key)) is not None and e.hits >= n for t in NODE)

    def refused(self, t: Tier, key: BlockKey) -> None:
        """A worker refused to evict: the block stays and may be chosen again."""
        self._unmark(t, key)

    def _expire(self, now: float) -> None:
        super()._expire(now)
        for t, key in [tk for tk, until in self._leaving.items() if until <= now]:
            self._unmark(t, key)

    def _unmark(self, t: Tier, key: BlockKey) -> None:
        """`key` no longer leaves `t`: its mark, and any write-back of it from `t`, are called off."""
        self._leaving.pop((t, key), None)
        for dst in (Tier.CPU, Tier.DISK, Tier.REDIS):
            if self._demoting.get((dst, key)) == t:
                del self._demoting[(dst, key)]
        self.tiers[t].clear_leaving(key)

    def _shed(self, t: Tier, now: float) -> list[Command]:
        idx = self.tiers[t]
        if not idx.capacity:
            return []
        wanted = len(self._wanted) if t == Tier.CPU else 0
        staying = idx.used + self.incoming(t) + wanted - idx.leaving
        if staying <= self.knobs.high_watermark * idx.capacity:
            return []
        excess = staying - int(self.knobs.low_watermark * idx.capacity)
        lower = self.below(t)
        give_up = now + self.knobs.transfer_timeout_s
        out: list[Command] = []
        # While a tenant is over its share of `t`, only theirs (core/tenants.py).
        leaving = [k for u, k in self._leaving if u == t]
        for key in list(self.tenants.shed_order(t, idx.candidates(), idx.capacity, leaving)):
            if excess <= 0:
                break
            if key in self._leases or self._incoming[t].kids(key):
                continue  # leased; or a child is on its way into this tier (tail first)
            e = idx.get(key)
            assert e is not None
            dst = lower
            if (held := self.held_below(t, key)) in NODE:
                dst = held  # a copy further down on the node (gpu: on disk): evicted clean, nothing to write
            elif lower == Tier.CPU and key not in self.tiers[lower] and self.room(Tier.CPU) <= 0:
                # cpu is full, perhaps of the very parents of these gpu blocks, which may not
                # leave before them: write the gpu block straight to Redis rather than deadlock.
                dst = Tier.REDIS
            admitted = None
            if dst == Tier.DISK and key not in self.tiers[Tier.DISK]:
                admitted = self._disk_verdict(e) if self.room(Tier.DISK) > 0 else None
                if admitted is None or not admitted.admitted:
                    dst = Tier.REDIS  # not worth a disk write (or no room there): on to Redis as before
            if self.kept_on_node(t, key, dst) or (dst, key) in self._demoting:
                # Tail first across tiers too (it waits for room in cpu, or for its children), and
                # a session-pinned block stays. One write-back of a block into a tier at a time (the
                # fact settles one source).
                continue
            if admitted is not None:
                self.disk_admissions.counts[admitted] += 1
            if key in self.tiers[dst]:
                out.append(Evict(self.pool, key, t, Reason.CLEAN))
            elif dst == Tier.REDIS and not self.reused(key):
                out.append(Evict(self.pool, key, t, Reason.UNREUSED))  # the frequency filter's drop
            else:
                out.append(Demote(self.pool, key, e.parent, t, dst, e.slot, 0))
                self._demoting[(dst, key)] = t
                if dst in self._incoming:
                    self._incoming[dst].add(key, e.parent, give_up)
            idx.mark_leaving(key)  # readable until the worker acts, never picked twice
            self._leaving[(t, key)] = give_up
            excess -= 1
        return out

    def _disk_verdict(self, e: Entry) -> DiskAdmit:
        """Whether a block cpu sheds deserves a disk write (core/disk_admission.py): its reads,
        and its parent's on this node."""
        parent = None
        if e.parent is not None:
            parent = max((p.hits for t in NODE if (p := self.tiers[t].get(e.parent)) is not None), default=None)
        return disk_admission(self.knobs.disk_admit_after, e.hits, parent)
