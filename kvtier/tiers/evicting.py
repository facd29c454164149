"""A tier worker's evictions: an `evict` command, and making room in a full tier for a new block.

I/O only: whether a block may go is decided by the pure rules (kvtier/core/eviction.py), what is
reported and counted by kvtier/core/outcomes.py, and what was done is told to the pool's
Placement. Redis is asked whether it still holds a block before the last local copy goes.
"""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from kvtier.bus.failures import REDIS_ERRORS
from kvtier.core.events import Evict, Reason, Tier
from kvtier.core.eviction import REFUSED, ROOM_TRIES, Verdict, after_redis_check, evict_verdict, room_victim
from kvtier.core.outcomes import Fact, asked_redis, evicted, kept
from kvtier.keys import BlockKey
from kvtier.tiers.facts import Facts
from kvtier.tiers.pool import PoolRuntime, SlotTier


class Evictions:
    def __init__(self, tier: Tier, facts: Facts, log: FilteringBoundLogger) -> None:
        self.tier = tier
        self.facts = facts
        self.log = log

    async def evict(self, rt: PoolRuntime, ev: Evict) -> Fact | None:
        """Carry out an `evict`: the fact, or None when there is nothing to report (a duplicate,
        a late command, or a refusal)."""
        if self.tier == Tier.REDIS:
            try:
                await rt.redis.delete(ev.key)
            except REDIS_ERRORS:
                rt.redis.stats.errors += 1
                raise  # leave the command pending: it is retried, then dead-lettered
            return self.facts.settle(rt, evicted(rt.name, ev.key, self.tier, ev.reason))
        local = rt.local(self.tier)
        if local is None:
            return None
        verdict = evict_verdict(rt.placement, self.tier, ev.key, ev.reason)
        if verdict is Verdict.ASK_REDIS:
            present = await self._redis_has(rt, ev.key)
            # Asked again: the tier may have changed while Redis answered (a child adopted by the
            # coordinator, a reader's pin, another eviction of the block).
            verdict = evict_verdict(rt.placement, self.tier, ev.key, ev.reason)
            if verdict is Verdict.ASK_REDIS:
                verdict = after_redis_check(present, ev.reason)
        if verdict is Verdict.DROP:
            rt.drop(local, ev.key)
            return self.facts.settle(rt, evicted(rt.name, ev.key, self.tier, ev.reason))
        if verdict in REFUSED:
            # BUSY: a child arrived or a reader pins it since the choice. ONLY_COPY: refuse rather
            # than lose it; the policy may choose it again later, and will then demote it first.
            rt.placement.refused(self.tier, ev.key)
            if verdict is Verdict.ONLY_COPY:
                self.log.warning("tier.evict_refused", pool=rt.name, key=ev.key.hex()[:16], reason=ev.reason.value)
        return self.facts.settle(rt, kept(verdict))

    async def make_room(self, rt: PoolRuntime, dst: SlotTier) -> Fact | None:
        """Full: drop one block the next tier holds, as `room_victim` picks it (confirmed with
        Redis for the cpu tier). Nothing is lost. The eviction's fact, or None when no such
        block exists."""
        for _ in range(ROOM_TRIES):
            choice = room_victim(rt.placement, self.tier)
            if choice is None:
                return None
            victim, verdict = choice
            if verdict is Verdict.ASK_REDIS:
                verdict = after_redis_check(await self._redis_has(rt, victim), Reason.MAKE_ROOM)
                if not rt.placement.still_clean(self.tier, victim):
                    continue  # changed while Redis answered (a child arrived, another evictor took it)
            if verdict is Verdict.DROP:
                rt.drop(dst, victim)
                self.log.debug("tier.evicted", pool=rt.name, key=victim.hex()[:16], reason=Reason.MAKE_ROOM.value)
                return self.facts.settle(rt, evicted(rt.name, victim, self.tier, Reason.MAKE_ROOM))
        return None

    async def room_for_grant(self, rt: PoolRuntime) -> bool:
        """Free one cpu slot for a grant by dropping a clean block (`make_room`), its fact queued
        like any eviction's: whether one was freed."""
        dropped = await self.make_room(rt, rt.cpu)
        if dropped is not None:
            self.facts.add(dropped)
        return dropped is not None

    async def _redis_has(self, rt: PoolRuntime, key: BlockKey) -> bool:
        """Confirm a block is really in Redis before dropping the last local copy: Redis may have
        expired or evicted it since we wrote it (`asked_redis`: forgotten then; an error means no)."""
        (got,) = await rt.redis.exists([key])
        if isinstance(got, Exception):
            rt.redis.stats.errors += 1
            self.log.warning("tier.redis_check_failed", pool=rt.name, error=f"{type(got).__name__}: {got}")
        present, in_redis = asked_redis(got)
        if in_redis is False:
            rt.not_in_redis(key)
        return present
