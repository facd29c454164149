"""The re-replication chore: each round, ask Redis about the next local blocks of every pool and
publish the copies the rule calls for (core/resync.py has the rule and the reasons)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.publisher import Publisher
from kvtier.core.resync import ResyncSweep
from kvtier.tiers.pool import PoolRuntime


async def resync_loop(pools: dict[str, PoolRuntime], publisher: Publisher, stream: str, interval: float,
                      keys_per_round: int, log: Any) -> None:
    sweeps = {name: ResyncSweep(rt.placement, record=rt) for name, rt in pools.items()}
    while True:
        await asyncio.sleep(interval)
        for name, rt in pools.items():
            keys = sweeps[name].next_keys(keys_per_round)
            if not keys:
                continue
            try:
                answers = await rt.redis.exists(list(keys))
                raise_if_cancelling()  # a cancel redis-py swallowed still ends the chore
                held = {k: a for k, a in zip(keys, answers) if isinstance(a, bool)}
                copies = sweeps[name].answered(held)
                if copies:
                    await publisher.publish_many([(stream, c) for c in copies])
            except REDIS_ERRORS as e:  # the bus is down: the next round asks again
                log.warning("redis.resync_failed", pool=name, error=str(e))
                continue
            except Exception as e:  # last: see bus/failures.py
                log.warning("redis.resync_failed", pool=name, error=f"{type(e).__name__}: {e}", exc_info=True)
                continue
            unanswered = len(keys) - len(held)  # their master is down (a cluster) or Redis is
            if unanswered:
                log.warning("redis.resync_unanswered", pool=name, keys=unanswered,
                            error=str(next(a for a in answers if not isinstance(a, bool))))
            missing = sum(not a for a in held.values())
            rt.counters.resync_missing += missing
            rt.counters.resync_copies += len(copies)
            if missing:
                log.info("redis.resync", pool=name, checked=len(held), missing=missing, copies=len(copies))
