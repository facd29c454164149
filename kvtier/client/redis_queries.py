"""The client's questions that go to Redis itself rather than to this node's shared memory: what
Redis holds after the local head (locate, present), the cluster prefix index (where), the
epoch counters integrations mix into their keys, and the compatibility manifest
(core/manifest.py). A mixin of Client, which provides the pools, the blocks Redis (per master
on a cluster), the bus Redis, the stats and the log.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.client.pools import ClientPool
from kvtier.client.results import ClientStats, Lookup
from kvtier.client.where_query import query_where
from kvtier.core.manifest import ManifestEntry, conflict, manifest_key, stored_key
from kvtier.core.where import Where
from kvtier.errors import NamespaceConflict, RedisUnavailable
from kvtier.keys import check_key, check_keys
from kvtier.logs import Log, LogThrottle
from kvtier.store.commands import KeyBatches
from kvtier.store.redis_blocks import redis_block_key


class RedisQueries:
    _block_batches: KeyBatches
    _redis: AsyncRedis
    stats: ClientStats
    log: Log
    quiet: LogThrottle

    def pool(self, name: str) -> ClientPool:
        raise NotImplementedError  # Client's

    def lookup(self, pool: str, keys: Sequence[bytes]) -> Lookup:
        raise NotImplementedError  # Client's

    async def locate(self, pool: str, keys: Sequence[bytes]) -> Lookup:
        """`lookup`, then how many of the following blocks can be read too, each from wherever it
        is: this node's shared memory, or Redis (any node may have put them). So `length +
        redis_length` is the prefix `get(..., remote=True)` reads. Blocks Redis could not be
        asked about (it, or the cluster master serving them, is unreachable) count as absent, so
        with Redis down the answer is the local one."""
        local = self.lookup(pool, keys)
        rest = keys[local.length:]
        if not rest:
            return local
        p = self.pool(pool)
        here = [p.locate(check_key(k)) is not None for k in rest]
        away = [k for k, h in zip(rest, here) if not h]
        found = iter(await self._in_redis(pool, away, "client.locate_redis_failed"))
        n = next((i for i, h in enumerate(here) if not h and not next(found)), len(rest))
        return Lookup(local.length, local.tiers, n)

    async def present(self, pool: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key, not as a prefix: resident on this node, or in Redis (written by any node).
        Keys Redis could not be asked about (it is unreachable) count as absent."""
        p = self.pool(pool)
        found = [p.locate(check_key(k)) is not None for k in keys]
        rest = [i for i, f in enumerate(found) if not f]
        if rest:
            for i, f in zip(rest, await self._in_redis(pool, [keys[i] for i in rest], "client.present_redis_failed")):
                found[i] = f
        return found

    async def _in_redis(self, pool: str, keys: Sequence[bytes], failed: str) -> list[bool]:
        """One pipelined EXISTS per key on the blocks Redis (per master, on a cluster). A key
        Redis could not answer for is absent; one log line (`failed`) and one error per call."""
        names = [redis_block_key(pool, bytes(check_key(k))) for k in keys]
        answers = await self._block_batches.run([("EXISTS", n) for n in names])
        errors = [a for a in answers if isinstance(a, Exception)]
        if errors:
            self.stats.event_errors += 1
            self.quiet.warning(failed, pool=pool, keys=len(errors), error=f"{type(errors[0]).__name__}: {errors[0]}")
        return [not isinstance(a, Exception) and bool(a) for a in answers]

    async def where(self, pool: str, keys: Sequence[bytes]) -> Where:
        """The router's question, from the cluster prefix index (core/where.py), kept by every
        daemon with [prefix_index] enabled: which nodes hold the longest leading run of `keys`
        locally, in which tier, and how much of it Redis holds (asked of Redis itself): see
        client/where_query.py. RedisUnavailable when Redis cannot answer."""
        self.pool(pool)
        try:
            return await query_where(self._block_batches, pool, check_keys(keys))
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"where: {type(e).__name__}: {e}") from e

    async def epoch(self, pool: str, name: str, *, bump: bool = False) -> int:
        """A counter on the bus Redis, per pool and `name` (0 until first bumped). Integrations mix
        it into their keys: bumping it retires every block written under the old value, on every
        node at once, without deleting blocks that other namespaces share (they age out by LRU).
        A reader that has not seen the new value yet still finds the old blocks: callers bound
        that staleness (the SGLang backend reads the value again every second).
        RedisUnavailable when Redis cannot answer."""
        self.pool(pool)
        key = f"kvtier:epoch:{pool}:{name}"
        try:
            value = await (self._redis.incr(key) if bump else self._redis.get(key))
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"epoch {name!r}: {type(e).__name__}: {e}") from e
        return int(value or 0)

    async def register_namespace(self, pool: str, entry: ManifestEntry) -> None:
        """Enter `entry` in the pool's manifest, unless its namespace is there already. Then the
        entry there must describe the same page bytes: NamespaceConflict says why not (and the
        caller must not use the namespace). A malformed entry there is replaced. RedisUnavailable
        when Redis cannot answer."""
        self.pool(pool)
        key, raw = manifest_key(pool), entry.to_json()
        try:
            if await self._redis.hsetnx(key, entry.namespace, raw):
                return
            theirs = await self._redis.hget(key, entry.namespace)
            if theirs is not None:
                try:
                    why = conflict(entry, ManifestEntry.from_json(theirs))
                except (ValueError, TypeError):
                    self.quiet.warning("client.manifest_entry_replaced", pool=pool, namespace=entry.namespace)
                    why = None
                    await self._redis.hset(key, entry.namespace, raw)
                if why is not None:
                    raise NamespaceConflict(why)
            else:  # removed since the HSETNX: ours now
                await self._redis.hsetnx(key, entry.namespace, raw)
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"manifest: {type(e).__name__}: {e}") from e

    async def count_stored(self, pool: str, namespace: str, blocks: int, nbytes: int) -> None:
        """Add to what the namespace stored (the manifest's counts). RedisUnavailable on failure:
        the caller keeps the counts and adds them again later."""
        self.pool(pool)
        try:
            async with self._redis.pipeline(transaction=False) as p:
                p.hincrby(stored_key(pool), f"{namespace}:blocks", blocks)
                p.hincrby(stored_key(pool), f"{namespace}:bytes", nbytes)
                await p.execute()
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"manifest counts: {type(e).__name__}: {e}") from e
