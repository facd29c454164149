"""Placement policy: a pure function of the tier indices that returns commands for the workers.

It imports neither asyncio, redis nor torch. The coordinator calls it after each batch of client
events and tier facts and publishes what it returns; the tier workers carry the commands out.

Rules (config `[policy]`):
- A put lands in the highest local tier with room (gpu, then cpu); with no local room it is
  written to Redis, so a burst of puts is not dropped while write-backs catch up.
- Above `high_watermark` of its slots, a tier sheds its coldest evictable blocks down to
  `low_watermark`: a block the next tier already holds is evicted at once; any other is demoted
  (write-back) and stays readable, pinned, until the next tier reports it stored.
- A block read `promote_after_hits` times while only in cpu is promoted to gpu if gpu has room.
- A prefetch promotes the blocks that are not local from Redis into cpu, and leases them for
  `prefetch_lease_s`: shedding skips them until they are read or the lease runs out, so a
  prefetch into a full tier is not undone before the client gets to read it.
Time is passed in (`now`), never read here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.bus.events import Demote, Evict, Promote, Removed, Store, Stored, Tier
from kvtier.tiers.index import State, TierIndex


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    promote_after_hits: int = 2
    prefetch_lease_s: float = 5.0


Command = Promote | Demote | Evict
LOCAL = (Tier.GPU, Tier.CPU)


class Placement:
    """Decisions for one pool. `tiers` maps every Tier to its index (Redis: unbounded, by key)."""

    def __init__(self, pool: str, tiers: dict[Tier, TierIndex], knobs: PolicyKnobs) -> None:
        self.pool = pool
        self.tiers = tiers
        self.knobs = knobs
        # Blocks commanded into a local tier whose outcome fact has not come back yet. Counting
        # them keeps a burst of puts from over-filling a tier before its worker catches up.
        self.incoming: dict[Tier, int] = {t: 0 for t in LOCAL}
        self._leases: dict[bytes, float] = {}  # prefetched key -> lease expiry

    def room(self, t: Tier) -> int:
        idx = self.tiers[t]
        return max(0, idx.free - self.incoming[t]) if idx.capacity else 0

    def where(self, key: bytes) -> Tier | None:
        """The highest tier known to hold `key` as a visible block."""
        for t in (Tier.GPU, Tier.CPU, Tier.REDIS):
            if key in self.tiers[t]:
                return t
        return None

    def admit(self, keys: Sequence[bytes]) -> list[Tier | None]:
        """Where each new block from a client goes: the highest local tier with room (counting
        blocks already on their way in), else straight to Redis rather than dropping it.
        None for a block already here (the put is a duplicate)."""
        out: list[Tier | None] = []
        seen: set[bytes] = set()
        for key in keys:
            if key in seen or any(self.tiers[t].get(key) is not None for t in LOCAL):
                out.append(None)
                continue
            seen.add(key)
            tier = next((t for t in LOCAL if self.room(t) > 0), Tier.REDIS)
            if tier in self.incoming:
                self.incoming[tier] += 1
            out.append(tier)
        return out

    def on_access(self, keys: Iterable[bytes]) -> list[Command]:
        out: list[Command] = []
        gpu, cpu = self.tiers[Tier.GPU], self.tiers[Tier.CPU]
        for key in keys:
            self._leases.pop(key, None)  # read: the lease has served its purpose
            g = gpu.touch(key)
            c = cpu.touch(key)
            if (g is None and c is not None and c.state is State.READY and self.room(Tier.GPU) > 0
                    and c.hits >= self.knobs.promote_after_hits):
                out.append(Promote(self.pool, key, c.parent, Tier.CPU, Tier.GPU, c.slot, 0))
                self.incoming[Tier.GPU] += 1
        return out

    def on_prefetch(self, keys: Sequence[bytes], head_parent: bytes | None, now: float) -> list[Command]:
        out: list[Command] = []
        expiry = now + self.knobs.prefetch_lease_s
        cpu = self.tiers[Tier.CPU]
        parent = head_parent
        for key in keys:
            local = [self.tiers[t].get(key) for t in LOCAL]
            if all(e is None for e in local):
                out.append(Promote(self.pool, key, parent, Tier.REDIS, Tier.CPU, -1, 0))
                self.incoming[Tier.CPU] += 1
            else:
                cpu.touch(key)
            self._leases[key] = expiry
            parent = key
        return out

    def on_fact(self, fact: Stored | Removed) -> list[Command]:
        """Settle the incoming count; finish write-backs: once the next tier stored a demoted
        block, drop it up here."""
        cause = fact.cause.split("_failed:")[0]
        if fact.tier in self.incoming and cause in (Store.TYPE, Promote.TYPE, Demote.TYPE):
            self.incoming[fact.tier] = max(0, self.incoming[fact.tier] - 1)
        if isinstance(fact, Stored) and fact.cause == Demote.TYPE and fact.tier != Tier.GPU:
            src = Tier(fact.tier - 1)
            if self.tiers[src].get(fact.key) is not None:
                return [Evict(self.pool, fact.key, src, "demoted")]
        if isinstance(fact, Removed) and fact.cause.startswith(Demote.TYPE) and fact.tier != Tier.GPU:
            # The demote failed: the block stays where it was and may be chosen again.
            self.tiers[Tier(fact.tier - 1)].clear_leaving(fact.key)
        return []

    def pressure(self, now: float) -> list[Command]:
        """Shed blocks from every local tier above its high watermark."""
        self._expire(now)
        out: list[Command] = []
        for t in LOCAL:
            out.extend(self._shed(t))
        return out

    def _expire(self, now: float) -> None:
        for key in [k for k, until in self._leases.items() if until <= now]:
            del self._leases[key]

    def _shed(self, t: Tier) -> list[Command]:
        idx = self.tiers[t]
        if not idx.capacity:
            return []
        staying = idx.used + self.incoming[t] - idx.leaving
        if staying <= self.knobs.high_watermark * idx.capacity:
            return []
        excess = staying - int(self.knobs.low_watermark * idx.capacity)
        lower = Tier(t + 1)
        out: list[Command] = []
        for key in list(idx.candidates()):
            if excess <= 0:
                break
            if key in self._leases:
                continue
            e = idx.get(key)
            assert e is not None
            if key in self.tiers[lower]:
                out.append(Evict(self.pool, key, t, "clean"))
            else:
                out.append(Demote(self.pool, key, e.parent, t, lower, e.slot, 0))
                if lower in self.incoming:
                    self.incoming[lower] += 1
            idx.mark_leaving(key)  # readable until the worker acts, never picked twice
            excess -= 1
        return out

    def clean_victim(self, t: Tier) -> bytes | None:
        """A block `t` may drop right now to make room: one the next tier already holds."""
        if t == Tier.REDIS:
            return None
        idx, lower = self.tiers[t], self.tiers[Tier(t + 1)]
        for e in idx.ready():
            # A block already leaving for the tier below counts: its pin is ours, not a reader's.
            if (e.pins == int(e.leaving) and not idx.children(e.key) and e.key in lower
                    and e.key not in self._leases):
                return e.key
        return None
