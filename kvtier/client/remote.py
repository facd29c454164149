"""Read-through: a prefix read from wherever each of its blocks is, this node's shared memory or
Redis, into the caller's tensor (`Client.get(..., remote=True)`).

Past the leading run this node holds, a chain's blocks may alternate between the two: a put
under pressure leaves its head here and sends its tail to Redis, the daemon brings blocks read
from Redis up one by one, another node wrote the rest. So each block is taken from shared memory
when the directory lists it, else from Redis. The Redis values are read in pipelines over a few
connections and land in the tensor's rows straight from the socket (store/bulk_reads.py, through
RedisBlocks.fetch); each is verified where it landed (header, key, layout, xxh3) before it
counts. The leading run of verified blocks is the answer; a block found in neither place,
corrupt (deleted and counted) or unreadable ends it. Nothing waits for room in a local tier:
the client has the bytes, and the daemon is told (RemoteRead) so that it can bring hot blocks up
by its policy.

A Redis outage costs at most `timeout` seconds and the local answer stands. Credentials that
may not read block keys (NOPERM) turn read-through into the pull path (a prefetch, a bounded
wait, a local read), with one warning.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
from redis.exceptions import NoPermissionError

from kvtier.bus.connect import AsyncRedis
from kvtier.client.pools import ClientPool
from kvtier.client.results import ClientStats
from kvtier.descriptor import RedisEndpoints
from kvtier.keys import BlockKey
from kvtier.logs import Log, LogThrottle
from kvtier.store.redis_blocks import CONNECTIONS, PIPELINE_BYTES, RedisBlocks, Verified

FETCH_PART_BYTES = 256 << 20  # a read-through fetches at most this much at once (its buffers' bound)


class Destination(Protocol):
    """Where a read-through's blocks go (client/reads.py `Rows`): a caller's tensor, or memory
    of the caller's own layout."""

    def listed(self, key: BlockKey) -> bool: ...  # this node's directory names a slot for it (a hint)
    async def read(self, rows: Sequence[int], keys: Sequence[BlockKey]) -> list[bool]: ...  # from shared memory
    def landing(self, row: int) -> npt.NDArray[np.uint8] | None: ...  # where a Redis value may land in place
    def deliver(self, row: int, payload: npt.NDArray[np.uint8], checksum: int) -> bool: ...  # it, verified


@dataclass(frozen=True, slots=True)
class Through:
    """A read-through's answer: `n` leading blocks verified; `remote`, the rows among them that
    came from Redis (the rest came from shared memory)."""

    n: int
    remote: list[int]


class RemoteReads:
    def __init__(self, blocks_redis: AsyncRedis, desc_redis: RedisEndpoints, timeout: float, stats: ClientStats,
                 log: Log, quiet: LogThrottle) -> None:
        self._redis = blocks_redis
        self._pipeline_bytes = desc_redis.pipeline_bytes or PIPELINE_BYTES
        self._connections = desc_redis.connections or CONNECTIONS
        self.timeout = timeout
        self.part_bytes = FETCH_PART_BYTES
        self.stats = stats
        self.log = log
        self.warn = quiet.warning  # a Redis outage: one line, then a count every few seconds
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

    async def read(self, pool: ClientPool, keys: Sequence[BlockKey], start: int, executor: Executor | None,
                   dest: Destination) -> Through:
        """Read keys[start:] into their rows of `dest`, each block from wherever it is: this
        node's shared memory when its directory lists it, else Redis. The answer is the leading
        run of verified blocks; a block found in neither ends it. Raises nothing for Redis' sake:
        an outage or a timeout ends the run where Redis was needed (counted, logged once a while)."""
        rb = self._blocks(pool)
        rest = range(start, len(keys))
        # keys[start] is not local, or its read just failed: Redis is its only chance.
        here = {i for i in rest if i > start and dest.listed(keys[i])}
        away = [i for i in rest if i not in here]
        ok: dict[int, bool] = {}
        fetched: list[int] = []
        corrupt = rb.stats.corrupt
        t0 = time.perf_counter()
        stop: object = None
        try:
            async with asyncio.timeout(self.timeout):
                # One round trip first to find the run Redis and this node hold between them:
                # values past a hole in the chain are not worth moving, and the common answer for
                # a prompt's new part, nothing, costs no more.
                there = dict(zip(away, await rb.exists([keys[i] for i in away]) if away else []))
                end = next((i for i in away if there[i] is not True), len(keys))
                if end < len(keys) and isinstance(there[end], Exception):
                    stop = there[end]  # why the run ended: Redis's error, not a miss
                mine = sorted(i for i in here if i < end)
                for i, hit in zip(mine, await dest.read(mine, keys)):
                    ok[i] = hit
                # A local copy that failed verification (evicted, rewritten) may still be in Redis.
                fetched = sorted([i for i in away if i < end] + [i for i in mine if not ok[i]])
                # In parts of at most FETCH_PART_BYTES: a value that cannot land in place lands in
                # a buffer first, and those buffers must not add up to the whole prefix at once.
                per = max(1, self.part_bytes // pool.block_bytes)
                for at in range(0, len(fetched), per):
                    part = fetched[at:at + per]
                    failed = await self._fetch(rb, pool, keys, part, dest, executor, ok)
                    if failed is not None and not isinstance(stop, Exception):
                        stop = failed
                    if not all(ok[i] for i in part):
                        break  # the run ends in this part: what follows cannot count
        except TimeoutError:
            self.stats.remote_s += time.perf_counter() - t0
            self.stats.remote_failures += 1
            self.warn("client.remote_read_timeout", pool=pool.name, blocks=len(rest), timeout_s=self.timeout)
            return Through(0, [])
        self.stats.remote_s += time.perf_counter() - t0
        self.stats.remote_corrupt += rb.stats.corrupt - corrupt
        n = next((j for j, i in enumerate(rest) if not ok.get(i)), len(rest))
        remote = [i for i in fetched if i < start + n and ok[i]]
        self.stats.remote_reads += len(remote)
        if isinstance(stop, NoPermissionError):
            self.denied = True
            self.log.warning("client.remote_read_denied", pool=pool.name, error=str(stop),
                             note="these credentials may not read block keys: read-through pulls through the "
                                  "daemon instead (prefetch, then a local read)")
        elif isinstance(stop, Exception) and start + n < len(keys):
            self.stats.remote_failures += 1
            self.warn("client.remote_read_failed", pool=pool.name, at=n, of=len(rest),
                      error=f"{type(stop).__name__}: {stop}")
        return Through(n, remote)

    @staticmethod
    async def _fetch(rb: RedisBlocks, pool: ClientPool, keys: Sequence[BlockKey], rows: list[int],
                     dest: Destination, executor: Executor | None, ok: dict[int, bool]) -> Exception | None:
        """One part of a read-through: `rows` from Redis into `dest`, each verified; ok[row] set.
        The first error Redis gave, if any."""
        delivered: dict[int, bool] = {}

        def into(j: int) -> npt.NDArray[np.uint8]:
            got = dest.landing(rows[j])
            return np.empty(pool.block_bytes, dtype=np.uint8) if got is None else got

        def then(j: int, v: Verified) -> None:
            delivered[j] = dest.deliver(rows[j], v[0], v[1])

        error: Exception | None = None
        got = await rb.fetch([keys[i] for i in rows], into=into, then=then, executor=executor)
        for j, (i, g) in enumerate(zip(rows, got)):
            ok[i] = isinstance(g, tuple) and delivered.get(j, False)
            if isinstance(g, Exception) and error is None:
                error = g
        return error

    async def aclose(self) -> None:
        for rb in self._pools.values():
            await rb.aclose()
        self._pools.clear()
