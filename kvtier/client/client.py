"""The async client: find the local daemon, hash prefixes, look up; reads, writes and Redis
questions are its mixins' (client/reads.py, client/writes.py, client/redis_queries.py).

Reads never leave the node: lookup and get go straight to shared memory. Events to the daemon
(puts, prefetches, batched read reports) go over the node's client stream and carry no block bytes.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

from kvtier.bus.connect import AsyncRedis, is_cluster, make_blocks_redis, make_redis
from kvtier.bus.publisher import BusStats, Publisher
from kvtier.client.access import AccessReports
from kvtier.client.discovery import library_logger, read_descriptor
from kvtier.client.pools import ClientPool, map_pools
from kvtier.client.reads import ClientReads
from kvtier.client.redis_queries import RedisQueries
from kvtier.client.remote import RemoteReads
from kvtier.client.results import ClientStats, Lookup
from kvtier.client.writes import ClientWrites
from kvtier.core.events import Tier
from kvtier.descriptor import Descriptor
from kvtier.errors import BadRequest, DaemonUnavailable, SegmentError, UnknownPool
from kvtier.keys import BlockKey, chain_keys, check_keys, root_key
from kvtier.logs import Log, LogThrottle
from kvtier.offload import CopyThreads, default_copy_threads
from kvtier.processes import pid_alive
from kvtier.runtime import DESCRIPTOR, runtime_dir_for
from kvtier.store.batches import batches_for

OFF_LOOP_BYTES = 256 << 10  # copies at least this big leave the caller's event loop
DESCRIPTOR_CHECK_S = 0.5  # how often calls look for a restarted daemon (a new epoch)
STREAM_MAXLEN = 100_000


class Client(ClientReads, ClientWrites, RedisQueries):
    """The reads (client/reads.py), writes (client/writes.py) and Redis questions
    (client/redis_queries.py) of one connection to the node's daemon."""

    def __init__(self, rdir: Path, desc: Descriptor, daemon_uid: int, redis_client: AsyncRedis,
                 staging_blocks: int, log: Log, copy_threads: int | None = None,
                 blocks_redis: AsyncRedis | None = None, remote_timeout: float = 2.0) -> None:
        copy_threads = default_copy_threads() if copy_threads is None else copy_threads
        if copy_threads < 1:
            raise BadRequest(f"copy_threads must be at least 1, got {copy_threads}")
        self._rdir = rdir
        self._staging_blocks = staging_blocks
        self._copy_threads = copy_threads
        self._copier: CopyThreads | None = None  # made on the first big copy
        self.off_loop_bytes = OFF_LOOP_BYTES
        self.desc = desc
        self.node = desc.node
        self.log = log.bind(node=self.node)
        self._redis = redis_client
        # Block keys live on the blocks Redis, which is the bus's unless the daemon has a bus_url.
        self._blocks = redis_client if blocks_redis is None else blocks_redis
        self._block_batches = batches_for(self._blocks)
        self._client_stream = desc.streams.client
        self._publisher = Publisher(redis_client, f"{self.node}/client/{os.getpid()}/{secrets.token_hex(3)}",
                                    time.time_ns(), STREAM_MAXLEN, BusStats())
        self.pools = map_pools(desc, self.node, daemon_uid, staging_blocks)
        self.stats = ClientStats()
        # What fails on every call while Redis is down is logged once, then counted every few
        # seconds: an engine's stderr must not get a line per request.
        self.quiet = LogThrottle(self.log)
        self._access = AccessReports(self._publisher, self._client_stream, self.stats, self.quiet)
        self._remote = RemoteReads(self._blocks, desc.redis, remote_timeout, self.stats, self.log, self.quiet)
        self._next_check = time.monotonic() + DESCRIPTOR_CHECK_S

    def _follow_restarts(self) -> None:
        """Re-map the pools when the daemon has restarted (a new epoch in its descriptor): its
        directory and gpu segments are new ones. While no descriptor is there (daemon down or
        starting), keep reading what is mapped: lookups go on working."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + DESCRIPTOR_CHECK_S
        try:
            desc, uid = read_descriptor(self._rdir)
            if desc.epoch == self.desc.epoch or desc.node != self.node:
                return
            pools = map_pools(desc, self.node, uid, self._staging_blocks)
        except (DaemonUnavailable, SegmentError, OSError, KeyError, ValueError, TypeError):
            return
        old, self.pools, self.desc = self.pools, pools, desc
        for p in old.values():
            p.close()
        self.log.info("client.daemon_restarted", epoch=desc.epoch)

    # --- connect / close -----------------------------------------------------------------------

    @classmethod
    async def connect(cls, runtime_dir: str | os.PathLike[str] | None = None, *, staging_blocks: int = 32,
                      socket_timeout: float = 2.0, copy_threads: int | None = None,
                      remote_timeout: float | None = None, blocks_url: str | None = None) -> Client:
        """Find the local daemon through its descriptor (runtime_dir, $KVTIER__NODE__RUNTIME_DIR,
        or the default runtime directory) and map its pools. Gets and puts of more than 256 KiB
        copy in `copy_threads` threads (default min(4, CPU cores)), off the caller's event loop,
        but a `put` of blocks under 256 KiB from a host tensor: up to `inline_put_bytes` (8 MiB)
        of it is copied on the loop, which it holds meanwhile (client/writes.py INLINE_PUT_BYTES).
        A read-through (`get(..., remote=True)`) gives Redis at most `remote_timeout` seconds
        (default: socket_timeout) before the local answer stands. `blocks_url` reads blocks
        (read-through, locate, present) with the client's own credentials instead of the daemon's
        (the descriptor's URL); the events still go over the daemon's bus."""
        rdir = runtime_dir_for(runtime_dir, os.environ)
        desc, daemon_uid = read_descriptor(rdir)
        if not pid_alive(desc.pid):
            raise DaemonUnavailable(f"the daemon named in {rdir / DESCRIPTOR} (pid {desc.pid}) is not running")
        r = make_redis(desc.redis.bus_url, socket_timeout=socket_timeout, connect_timeout=socket_timeout,
                       retries=1)
        url = blocks_url or desc.redis.url or desc.redis.bus_url
        blocks = None if url == desc.redis.bus_url and not is_cluster(r) else make_blocks_redis(
            url, socket_timeout=socket_timeout, connect_timeout=socket_timeout, retries=1)
        try:
            client = cls(rdir, desc, daemon_uid, r, staging_blocks, library_logger(), copy_threads, blocks,
                         socket_timeout if remote_timeout is None else remote_timeout)
            client.log.info("client.connected", node=desc.node, daemon_pid=desc.pid, pools=sorted(desc.pools),
                            pid=os.getpid())
            return client
        except BaseException:
            await r.aclose()
            if blocks is not None:
                await blocks.aclose()
            raise

    async def close(self) -> None:
        await self._access.close()
        self.quiet.flush()
        await self._remote.aclose()
        alive = pid_alive(self.desc.pid)  # or our staging drops would wait for no one
        for p in self.pools.values():
            p.close(daemon_alive=alive)
        if self._copier is not None:
            self._copier.shutdown(wait=False)  # idle: every copy is waited for by its call
        await self._redis.aclose()
        if self._blocks is not self._redis:
            await self._blocks.aclose()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def prefix_index(self) -> bool:
        """Whether this node's daemon writes the cluster prefix index that `where` reads
        ([prefix_index] enabled): without it, `where` cannot name this node."""
        return self.desc.prefix_index

    def pool(self, name: str) -> ClientPool:
        self._follow_restarts()
        p = self.pools.get(name)
        if p is None:
            raise UnknownPool(f"unknown pool {name!r}; this daemon serves {sorted(self.pools)}")
        return p

    # --- keys and lookup ---------------------------------------------------------------------

    def block_keys(self, pool: str, token_ids: Sequence[int], *, salt: bytes | None = None,
                   lora_id: str | None = None) -> list[BlockKey]:
        p = self.pool(pool)
        return chain_keys(root_key(p.fingerprint, salt, lora_id), token_ids, p.layout.block_tokens)

    def lookup(self, pool: str, keys: Sequence[bytes]) -> Lookup:
        """Longest prefix of `keys` resident on this node (gpu or cpu). No I/O: works with Redis down."""
        p = self.pool(pool)
        tiers: list[Tier] = []
        at, size = 0, 1  # chunks of 1, 4, 16...: a chain that misses early costs a probe or two
        while at < len(keys):
            chunk = check_keys(keys[at:at + size])
            run = p.leading(chunk)
            tiers += run
            if len(run) < len(chunk):
                break
            at, size = at + size, size * 4
        return Lookup(len(tiers), tuple(tiers))

    def resident(self, pool: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key, not as a prefix: resident on this node (gpu or cpu). No I/O."""
        return [t is not None for t in self.pool(pool).located(check_keys(keys))]
