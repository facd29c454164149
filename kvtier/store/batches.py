"""Batches of single-key block commands (SET, GET, EXISTS, DEL, the compare-and-delete script) on
one Redis or across a Redis Cluster's masters (store/cluster_batches.py). Every command gets its
own outcome, the reply or the error it met; `run` never raises a Redis error.

One server (also a Sentinel-managed master): one pipeline, and a connection-level failure is
every command's error.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio
import redis.asyncio.cluster

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.store.cluster_batches import ClusterBatches
from kvtier.store.commands import Command, KeyBatches, Outcome

__all__ = ["ClusterBatches", "KeyBatches", "ServerBatches", "batches_for"]


def batches_for(client: AsyncRedis) -> KeyBatches:
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        return ClusterBatches(client)
    return ServerBatches(client)


class ServerBatches:
    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self.redirects = 0
        self.reloads = 0
        self.skipped = 0

    async def run(self, commands: Sequence[Command]) -> list[Outcome]:
        if not commands:
            return []
        pipe = self.client.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        try:
            return list(await pipe.execute(raise_on_error=False))
        except REDIS_ERRORS as e:
            return [e] * len(commands)
