"""Read-through: the part of a prefix this node does not hold, read straight from Redis into the
caller's tensor (`Client.get(..., remote=True)`).

The values are read in pipelines over a few connections and land in the tensor's rows straight
from the socket (store/bulk_reads.py, through RedisBlocks.fetch); each is verified where it
landed (header, key, layout, xxh3) before it counts. The leading run of verified blocks is the
answer; a block that is absent, corrupt (deleted and counted) or unreadable ends it. Nothing
waits for room in a local tier: the client has the bytes, and the daemon is told (RemoteRead)
so that it can bring hot blocks up by its policy.

A Redis outage costs at most `timeout` seconds and the local answer stands. Credentials that
may not read block keys (NOPERM) turn read-through into the pull path (a prefetch, a bounded
wait, a local read), with one warning.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from redis.exceptions import NoPermissionError

from kvtier.bus.connect import AsyncRedis
from kvtier.client.pools import ClientPool
from kvtier.client.results import ClientStats
from kvtier.keys import BlockKey
from kvtier.logs import Log
from kvtier.store.redis_blocks import CONNECTIONS, PIPELINE_BYTES, RedisBlocks, Verified


class RemoteReads:
    def __init__(self, blocks_redis: AsyncRedis, desc_redis: dict[str, Any], timeout: float, stats: ClientStats,
                 log: Log) -> None:
        self._redis = blocks_redis
        self._pipeline_bytes = int(desc_redis.get("pipeline_bytes") or PIPELINE_BYTES)
        self._connections = int(desc_redis.get("connections") or CONNECTIONS)
        self.timeout = timeout
        self.stats = stats
        self.log = log
        self.denied = False  # the credentials may not read blocks: pull instead
        self._pools: dict[tuple[str, bytes], RedisBlocks] = {}

    def _blocks(self, pool: ClientPool) -> RedisBlocks:
        key = (pool.name, pool.fingerprint)
        rb = self._pools.get(key)
        if rb is None:
            rb = self._pools[key] = RedisBlocks(self._redis, pool.name, pool.fingerprint, pool.block_bytes, 0,
                                                self.log, pipeline_bytes=self._pipeline_bytes,
                                                connections=self._connections)
        return rb

    async def read(self, pool: ClientPool, keys: Sequence[BlockKey], out: torch.Tensor, start: int,
                   executor: Executor | None) -> int:
        """Read keys[start:] from Redis into out[start:]; how many leading ones were verified.
        Raises nothing for Redis' sake: an outage or a timeout is 0 (counted and logged)."""
        rest = keys[start:]
        rb = self._blocks(pool)
        into, then = _destinations(out, start)
        corrupt = rb.stats.corrupt
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                # One round trip first to find the leading run Redis holds: the values past it
                # (after a hole in the chain) are not worth moving, and the common answer for a
                # prompt's new part, nothing, costs no more.
                there = await rb.exists(list(rest))
                run = next((i for i, t in enumerate(there) if t is not True), len(there))
                got = await rb.fetch(rest[:run], into=into, then=then, executor=executor) if run else []
                if run < len(there) and isinstance(stopped := there[run], Exception):
                    got.append(stopped)  # why the run ended: Redis's error, not a miss
        except TimeoutError:
            self.stats.remote_s += time.perf_counter() - t0
            self.stats.remote_failures += 1
            self.log.warning("client.remote_read_timeout", pool=pool.name, blocks=len(rest), timeout_s=self.timeout)
            return 0
        self.stats.remote_s += time.perf_counter() - t0
        self.stats.remote_corrupt += rb.stats.corrupt - corrupt
        m = next((i for i, g in enumerate(got) if not isinstance(g, tuple)), len(got))
        self.stats.remote_reads += m
        stop = got[m] if m < len(got) else None
        if isinstance(stop, NoPermissionError):
            self.denied = True
            self.log.warning("client.remote_read_denied", pool=pool.name, error=str(stop),
                             note="these credentials may not read block keys: read-through pulls through the "
                                  "daemon instead (prefetch, then a local read)")
        elif isinstance(stop, Exception):
            self.stats.remote_failures += 1
            self.log.warning("client.remote_read_failed", pool=pool.name, at=m, of=len(rest),
                             error=f"{type(stop).__name__}: {stop}")
        return m

    async def aclose(self) -> None:
        for rb in self._pools.values():
            await rb.aclose()
        self._pools.clear()


def _row(out: torch.Tensor, i: int) -> npt.NDArray[np.uint8]:
    return out[i].view(torch.uint8).reshape(-1).numpy()


def _destinations(out: torch.Tensor, start: int) -> tuple[Any, Any]:
    """Where fetched blocks land: straight in the rows of a host tensor; for a device tensor, in
    host buffers, then copied over once verified."""
    if out.device.type == "cpu":
        return (lambda i: _row(out, start + i)), None

    def to_device(i: int, got: Verified) -> None:
        out[start + i].view(torch.uint8).reshape(-1).copy_(torch.from_numpy(got[0]))

    return None, to_device
