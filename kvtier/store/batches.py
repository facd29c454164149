"""Batches of single-key block commands (SET, GET, EXISTS, DEL, the compare-and-delete script) on
one Redis or across a Redis Cluster's masters (store/cluster_batches.py). Every command gets its
own outcome, the reply or the error it met; `run` never raises a Redis error.

One server (also a Sentinel-managed master): the commands in pipelines of at most `per_pipeline`,
`width` of them at once, each on its own pooled connection; a connection-level failure is every
command's error in that pipeline. Shallow pipelines over a few connections are what moves 2 MiB
values fastest (docs/performance.md: a 64 MiB pipeline of SETs ran at a quarter of the speed of
8 MiB ones).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.sentinel import SentinelConnectionPool

from kvtier.bus.connect import AsyncRedis
from kvtier.store.bulk_reads import BulkPool, Endpoint
from kvtier.store.cluster_batches import ClusterBatches
from kvtier.store.commands import Command, KeyBatches, Outcome, bounded_gather, pipelines, run_part

__all__ = ["ClusterBatches", "KeyBatches", "ServerBatches", "batches_for"]
BULK_CONNECTIONS = 8  # bulk-read connections kept per server


def batches_for(client: AsyncRedis) -> KeyBatches:
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        return ClusterBatches(client)
    return ServerBatches(client)


class ServerBatches:
    def __init__(self, client: redis.asyncio.Redis, bulk_connections: int = BULK_CONNECTIONS) -> None:
        self.client = client
        self.redirects = 0
        self.reloads = 0
        self.skipped = 0
        self.bulk = BulkPool(self._endpoint, bulk_connections)

    async def _endpoint(self) -> Endpoint:
        """Where the bulk reads connect: the client's own settings (for a Sentinel-managed master,
        the address the Sentinels name now)."""
        pool = self.client.connection_pool
        ep = Endpoint.of(pool.make_connection())  # type: ignore[no-untyped-call]
        if isinstance(pool, SentinelConnectionPool):
            host, port = await pool.get_master_address()  # type: ignore[no-untyped-call]
            ep = dataclasses.replace(ep, host=host, port=int(port))
        return ep

    async def run(self, commands: Sequence[Command], *, per_pipeline: int | None = None,
                  width: int = 1) -> list[Outcome]:
        out: list[Outcome] = [None] * len(commands)
        pipe = functools.partial(self.client.pipeline, transaction=False)
        await bounded_gather(width, [run_part(pipe, {}, self.bulk, commands, idx, out)
                                     for idx in pipelines(range(len(commands)), per_pipeline)])
        return out

    async def aclose(self) -> None:
        self.bulk.close()
