"""A tier worker's evictions: an `evict` command, and making room in a full tier for a new block.

I/O only: whether a block may go is decided by the pure rules (kvtier/core/eviction.py), and what
was done is reported to the pool's Placement. Redis is asked whether it still holds a block
before the last local copy goes.
"""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from kvtier.bus.failures import REDIS_ERRORS
from kvtier.core.events import Cause, Evict, Reason, Removed, Tier
from kvtier.core.eviction import REFUSED, ROOM_TRIES, Verdict, after_redis_check, evict_verdict, room_victim
from kvtier.keys import BlockKey
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime


class Evictions:
    def __init__(self, tier: Tier, log: FilteringBoundLogger) -> None:
        self.tier = tier
        self.log = log

    async def evict(self, rt: PoolRuntime, ev: Evict) -> Removed | None:
        """Carry out an `evict`: the fact, or None when there is nothing to report (a duplicate,
        a late command, or a refusal)."""
        c = rt.counters.tiers[self.tier.label]
        if self.tier == Tier.REDIS:
            try:
                await rt.redis.delete(ev.key)
            except REDIS_ERRORS:
                rt.redis.stats.errors += 1
                raise  # leave the command pending: it is retried, then dead-lettered
            rt.not_in_redis(ev.key)
            c.evicted += 1
            return Removed(rt.name, ev.key, self.tier, Cause.EVICT, ev.reason)
        local = rt.local(self.tier)
        if local is None:
            return None
        verdict = evict_verdict(rt.placement, self.tier, ev.key, ev.reason)
        if verdict is Verdict.ASK_REDIS:
            verdict = after_redis_check(await self._redis_has(rt, ev.key), ev.reason)
        if verdict in (Verdict.GONE, Verdict.STALE):
            c.stale += verdict is Verdict.STALE
            return None
        if verdict in REFUSED:
            # BUSY: a child arrived or a reader pins it since the choice. ONLY_COPY: refuse rather
            # than lose it; the policy may choose it again later, and will then demote it first.
            rt.placement.refused(self.tier, ev.key)
            c.refused += 1
            if verdict is Verdict.ONLY_COPY:
                self.log.warning("tier.evict_refused", pool=rt.name, key=ev.key.hex()[:16], reason=ev.reason.value)
            return None
        rt.drop(local, ev.key)
        c.evicted += 1
        return Removed(rt.name, ev.key, self.tier, Cause.EVICT, ev.reason)

    async def make_room(self, rt: PoolRuntime, dst: LocalTier) -> Removed | None:
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
            if verdict is Verdict.DROP:
                rt.drop(dst, victim)
                rt.counters.tiers[self.tier.label].evicted += 1
                self.log.debug("tier.evicted", pool=rt.name, key=victim.hex()[:16], reason=Reason.MAKE_ROOM.value)
                return Removed(rt.name, victim, self.tier, Cause.EVICT, Reason.MAKE_ROOM)
        return None

    async def _redis_has(self, rt: PoolRuntime, key: BlockKey) -> bool:
        """Confirm a block is really in Redis before dropping the last local copy: Redis may have
        expired or evicted it since we wrote it. Forget it if it is gone; any error means no."""
        (present,) = await rt.redis.exists([key])
        if isinstance(present, Exception):
            rt.redis.stats.errors += 1
            self.log.warning("tier.redis_check_failed", pool=rt.name, error=f"{type(present).__name__}: {present}")
            return False
        if not present:
            rt.not_in_redis(key)
        return present
