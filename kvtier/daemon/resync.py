"""The re-replication chore: each round, ask Redis about the next local blocks of every pool and
publish the copies the rule calls for (core/resync.py has the rule and the reasons)."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import RedisError

from kvtier.bus.cancel import raise_if_cancelling
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
                held = await rt.redis.exists(list(keys))
                raise_if_cancelling()  # a cancel redis-py swallowed still ends the chore
                copies = sweeps[name].answered(dict(zip(keys, held)))
                if copies:
                    await publisher.publish_many([(stream, c) for c in copies])
            except RedisError as e:  # Redis down: the next round asks again
                log.warning("redis.resync_failed", pool=name, error=str(e))
                continue
            missing = held.count(False)
            rt.counters.resync_missing += missing
            rt.counters.resync_copies += len(copies)
            if missing:
                log.info("redis.resync", pool=name, checked=len(keys), missing=missing, copies=len(copies))
