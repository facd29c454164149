"""The async client: find the local daemon, hash prefixes, look up, read, put and prefetch blocks.

Reads never leave the node: lookup and get go straight to shared memory. Events to the daemon
(puts, prefetches, batched read reports) go over the node's client stream and carry no block bytes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvtier.bus.connect import AsyncRedis, is_cluster, make_blocks_redis, make_redis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.publisher import BusStats, Publisher
from kvtier.client.access import AccessReports
from kvtier.client.discovery import library_logger, read_descriptor
from kvtier.client.pools import ClientPool, host_rows, map_pools
from kvtier.client.redis_queries import RedisQueries
from kvtier.client.remote import RemoteReads, Through
from kvtier.client.results import ClientStats, Lookup, PutResult
from kvtier.core.events import Prefetch, Put, StagedBlock, Tier, TokenIds
from kvtier.errors import BadRequest, DaemonUnavailable, SegmentError, UnknownPool
from kvtier.keys import BlockKey, chain_keys, check_key, encode_tokens, root_key
from kvtier.logs import Log, LogThrottle
from kvtier.offload import default_copy_threads, map_shares
from kvtier.processes import pid_alive
from kvtier.runtime import DESCRIPTOR, runtime_dir_for
from kvtier.shm.staging import StagingWriter
from kvtier.store.batches import batches_for

T = TypeVar("T")  # what a copy works through (block indexes, staged blocks)
R = TypeVar("R")  # what it answers per item
# Fills staging slot b with block i of a put: made per put by a StagingWriter and the number staged.
SlotWriter = Callable[[StagingWriter, int], Callable[[int, StagedBlock], StagedBlock]]

OFF_LOOP_BYTES = 256 << 10  # copies at least this big leave the caller's event loop
DESCRIPTOR_CHECK_S = 0.5  # how often calls look for a restarted daemon (a new epoch)
STREAM_MAXLEN = 100_000


class Client(RedisQueries):
    def __init__(self, rdir: Path, desc: dict[str, Any], daemon_uid: int, redis_client: AsyncRedis,
                 staging_blocks: int, log: Log, copy_threads: int | None = None,
                 blocks_redis: AsyncRedis | None = None, remote_timeout: float = 2.0) -> None:
        copy_threads = default_copy_threads() if copy_threads is None else copy_threads
        if copy_threads < 1:
            raise BadRequest(f"copy_threads must be at least 1, got {copy_threads}")
        self._rdir = rdir
        self._staging_blocks = staging_blocks
        self._copy_threads = copy_threads
        self._copier: ThreadPoolExecutor | None = None  # made on the first big copy
        self.off_loop_bytes = OFF_LOOP_BYTES
        self.desc = desc
        self.node: str = desc["node"]
        self.log = log.bind(node=self.node)
        self._redis = redis_client
        # Block keys live on the blocks Redis, which is the bus's unless the daemon has a bus_url.
        self._blocks = redis_client if blocks_redis is None else blocks_redis
        self._block_batches = batches_for(self._blocks)
        self._client_stream: str = desc["streams"]["client"]
        self._publisher = Publisher(redis_client, f"{self.node}/client/{os.getpid()}/{secrets.token_hex(3)}",
                                    time.time_ns(), STREAM_MAXLEN, BusStats())
        self.pools = map_pools(desc, self.node, daemon_uid, staging_blocks)
        self.stats = ClientStats()
        # What fails on every call while Redis is down is logged once, then counted every few
        # seconds: an engine's stderr must not get a line per request.
        self.quiet = LogThrottle(self.log)
        self._access = AccessReports(self._publisher, self._client_stream, self.stats, self.quiet)
        self._remote = RemoteReads(self._blocks, desc["redis"], remote_timeout, self.stats, self.log, self.quiet)
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
            if desc.get("epoch") == self.desc.get("epoch") or desc.get("node") != self.node:
                return
            pools = map_pools(desc, self.node, uid, self._staging_blocks)
        except (DaemonUnavailable, SegmentError, OSError, KeyError, ValueError, TypeError):
            return
        old, self.pools, self.desc = self.pools, pools, desc
        for p in old.values():
            p.close()
        self.log.info("client.daemon_restarted", epoch=desc.get("epoch"))

    # --- connect / close -----------------------------------------------------------------------

    @classmethod
    async def connect(cls, runtime_dir: str | os.PathLike[str] | None = None, *, staging_blocks: int = 32,
                      socket_timeout: float = 2.0, copy_threads: int | None = None,
                      remote_timeout: float | None = None, blocks_url: str | None = None) -> Client:
        """Find the local daemon through its descriptor (runtime_dir, $KVTIER__NODE__RUNTIME_DIR,
        or the default runtime directory) and map its pools. Gets and puts of more than 256 KiB
        copy in `copy_threads` threads (default min(4, CPU cores)), off the caller's event loop.
        A read-through (`get(..., remote=True)`) gives Redis at most `remote_timeout` seconds
        (default: socket_timeout) before the local answer stands. `blocks_url` reads blocks
        (read-through, locate, present) with the client's own credentials instead of the daemon's
        (the descriptor's URL); the events still go over the daemon's bus."""
        rdir = runtime_dir_for(runtime_dir, os.environ)
        desc, daemon_uid = read_descriptor(rdir)
        if not pid_alive(desc.get("pid")):
            raise DaemonUnavailable(f"the daemon named in {rdir / DESCRIPTOR} (pid {desc.get('pid')}) is not running")
        r = make_redis(desc["redis"]["bus_url"], socket_timeout=socket_timeout, connect_timeout=socket_timeout,
                       retries=1)
        url = blocks_url or desc["redis"].get("url") or desc["redis"]["bus_url"]
        blocks = None if url == desc["redis"]["bus_url"] and not is_cluster(r) else make_blocks_redis(
            url, socket_timeout=socket_timeout, connect_timeout=socket_timeout, retries=1)
        try:
            client = cls(rdir, desc, daemon_uid, r, staging_blocks, library_logger(), copy_threads, blocks,
                         socket_timeout if remote_timeout is None else remote_timeout)
            client.log.info("client.connected", node=desc.get("node"), daemon_pid=desc.get("pid"),
                            pools=sorted(desc.get("pools", {})), pid=os.getpid())
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
        alive = pid_alive(self.desc.get("pid"))  # or our staging drops would wait for no one
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
        return bool(self.desc.get("prefix_index"))

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
        for key in keys:
            hit = p.locate(check_key(key))
            if hit is None:
                break
            tiers.append(hit[0])
        return Lookup(len(tiers), tuple(tiers))

    # --- get -----------------------------------------------------------------------------------

    async def get(self, pool: str, keys: Sequence[bytes], out: torch.Tensor, *, remote: bool = False) -> int:
        """Copy the leading blocks of `keys` into out[0..n) (CPU or CUDA tensor [>=len(keys), *block_shape]).
        Returns n, the number of leading blocks read and verified. Only out[:n] is meaningful:
        rows from n on may hold bytes of copies that failed verification or came after a miss.

        `remote=True` (read-through, client/remote.py): each block of the leading run comes from
        wherever it is, this node's shared memory or Redis (straight into `out`), verified; a
        block found in neither ends the run. The daemon hears of the Redis reads and may bring
        those blocks up. It never waits for room in a local tier, and a Redis outage costs at
        most `remote_timeout` seconds."""
        p = self.pool(pool)
        bkeys = [check_key(k) for k in keys]
        p.check_tensor(out, len(bkeys), "out")
        n = await self._get_local(p, bkeys, out, 0)
        if remote and n < len(bkeys):
            if self._remote.denied:
                n += await self._pull(p, bkeys, out, n)
            else:
                got = await self._remote.read(p, bkeys, out, n, self._copier_for(len(bkeys) - n, p),
                                              _PoolReads(self, p, bkeys, out))
                for first, last in _runs(got.remote):  # each run read from Redis, with its parent
                    self._access.note_remote(pool, bkeys[first:last + 1], bkeys[first - 1] if first else None)
                if not got.n and self._remote.denied:
                    got = Through(await self._pull(p, bkeys, out, n), [])
                n += got.n
        self.stats.reads += n
        self.stats.read_misses += len(bkeys) - n
        self._access.note(pool, bkeys[:n], len(bkeys) - n)
        return n

    async def _get_local(self, p: ClientPool, bkeys: list[BlockKey], out: torch.Tensor, start: int) -> int:
        """The leading run of bkeys[start:] this node holds, copied into out[start:]."""
        ok = await _PoolReads(self, p, bkeys, out).read(range(start, len(bkeys)))
        return next((i for i, hit in enumerate(ok) if not hit), len(ok))

    async def _pull(self, p: ClientPool, bkeys: list[BlockKey], out: torch.Tensor, start: int) -> int:
        """Read-through for credentials that may not read blocks: the daemon pulls them up
        (prefetch), then a local read, within remote_timeout."""
        try:
            await self.prefetch(p.name, bkeys[start:], parent=bkeys[start - 1] if start else None)
        except REDIS_ERRORS as e:
            self.stats.event_errors += 1
            self.quiet.warning("client.pull_failed", pool=p.name, error=str(e))
            return 0
        await self.wait_resident(p.name, bkeys, timeout=self._remote.timeout)
        return await self._get_local(p, bkeys, out, start)

    def _copier_for(self, blocks: int, p: ClientPool) -> ThreadPoolExecutor | None:
        """The copy threads for a read-through's verification, once it is big enough for them."""
        if blocks * p.block_bytes < self.off_loop_bytes:
            return None
        if self._copier is None:
            self._copier = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="kvtier-copy")
        return self._copier

    async def get_with(self, pool: str, keys: Sequence[bytes],
                       copy_out: Callable[[int, npt.NDArray[np.uint8]], object], digest: Callable[[int], int]) -> int:
        """`get` into host memory of the caller's own layout: `copy_out(i, src)` copies block i
        from its slot (`src`, uint8, block_bytes) and `digest(i)` returns the xxh3-64 of what it
        wrote, in block order; a block whose digest or seqlock does not check out ends the prefix.
        Returns n as get does; what copy_out wrote for blocks from n on must not be used."""
        p = self.pool(pool)
        bkeys = [check_key(k) for k in keys]

        def read_one(i: int) -> bool:
            return p.read_with(bkeys[i], lambda src: copy_out(i, src), lambda: digest(i))

        def read(share: Sequence[int]) -> list[bool]:
            return [read_one(i) for i in share]

        with p.in_use():
            ok = await self._copy(read, range(len(bkeys)), len(bkeys) * p.block_bytes)
        return self._read_prefix(pool, bkeys, ok)

    def _read_prefix(self, pool: str, keys: list[BlockKey], ok: list[bool]) -> int:
        """How many leading blocks were read; counted, and reported to the daemon."""
        n = next((i for i, hit in enumerate(ok) if not hit), len(keys))
        self.stats.reads += n
        self.stats.read_misses += len(keys) - n
        self._access.note(pool, keys[:n], len(keys) - n)
        return n

    async def _copy(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], nbytes: int,
                    threads: int | None = None) -> list[R]:
        """fn over items: inline when small, else in this client's copy threads, off the caller's
        event loop. A GPU destination uses one thread (its pinned bounce buffer is per pool)."""
        if nbytes < self.off_loop_bytes or not items:
            return fn(items)
        if self._copier is None:
            self._copier = ThreadPoolExecutor(self._copy_threads, thread_name_prefix="kvtier-copy")
        return await map_shares(self._copier, fn, items, threads or self._copy_threads)

    # --- put / prefetch ------------------------------------------------------------------------

    async def put(self, pool: str, keys: Sequence[bytes], kv: torch.Tensor, *,
                  parent: bytes | None = None, token_ids: Sequence[int] | None = None) -> PutResult:
        """Hand new blocks to the daemon. `keys` is a chain: keys[0]'s parent is `parent` (None
        for the chain's first block). Never blocks on a busy daemon: what cannot be staged at
        once is dropped and counted. `token_ids` (block_tokens per block, in block order) are
        only passed on to routers, in the daemon's KV events (docs/integrations/events.md)."""
        p = self.pool(pool)
        p.check_tensor(kv, len(keys), "kv")

        def writer(w: StagingWriter, n: int) -> Callable[[int, StagedBlock], StagedBlock]:
            rows = host_rows(kv, n)  # only the staged blocks leave a GPU
            return lambda i, b: w.fill_slot(b, rows[i])

        return await self._put(p, keys, parent, writer, token_ids)

    async def put_with(self, pool: str, keys: Sequence[bytes], fill: Callable[[int, npt.NDArray[np.uint8]], object],
                       *, parent: bytes | None = None, token_ids: Sequence[int] | None = None) -> PutResult:
        """`put`, but `fill(i, dst)` writes block i's bytes straight into its staging slot (`dst`,
        a uint8 array of block_bytes), so a block gathered from scattered pages is copied once.
        `fill` may run in the client's copy threads, several blocks side by side."""
        p = self.pool(pool)
        return await self._put(p, keys, parent, lambda w, n: lambda i, b: w.fill_slot_with(b, lambda dst: fill(i, dst)),
                               token_ids)

    async def _put(self, p: ClientPool, keys: Sequence[bytes], parent: bytes | None, writer: SlotWriter,
                   token_ids: Sequence[int] | None = None) -> PutResult:
        """Stage what fits, filled by writer(staging, n_staged)(i, slot) in copy threads, then publish."""
        pool = p.name
        bkeys = [check_key(k) for k in keys]
        bparent = None if parent is None else check_key(parent)
        tokens = None
        if token_ids is not None:
            tokens = encode_tokens(token_ids).tobytes()  # BadRequest for ids outside [0, 2**32)
            want = len(bkeys) * p.layout.block_tokens
            if len(tokens) != 4 * want:
                raise BadRequest(f"token_ids: {len(bkeys)} blocks of {p.layout.block_tokens} tokens need {want} ids, "
                                 f"got {len(tokens) // 4}")
        if not bkeys:
            return PutResult(0, 0)
        w = p.stager()
        staged = w.take_slots(bkeys, bparent)
        segment = w.seg.name
        if staged:
            try:
                write = writer(w, len(staged))
                with p.in_use():
                    parts = await self._copy(lambda share: [write(i, b) for i, b in share],
                                             list(enumerate(staged)), len(staged) * p.block_bytes)
            except BaseException:
                w.unstage(staged)
                raise
            staged = parts
            w.staged(staged)
        dropped = len(bkeys) - len(staged)
        if staged:
            try:
                part = None if tokens is None else TokenIds(tokens[:4 * len(staged) * p.layout.block_tokens])
                await self._publisher.publish(self._client_stream, Put(pool, segment, tuple(staged), part))
            except REDIS_ERRORS as e:
                w.unstage(staged)
                dropped = len(bkeys)
                staged = []
                self.stats.event_errors += 1
                self.quiet.warning("client.put_failed", pool=pool, error=str(e))
            except BaseException:
                # Cancelled mid-publish: free the slots. Safe even if the event did land, because
                # the daemon re-checks each slot's generation before trusting it.
                w.unstage(staged)
                raise
        if dropped:
            self.stats.put_dropped += dropped
            w.count_dropped(dropped)  # where the daemon collects it: the bus may be what failed
            self.quiet.info("client.put_dropped", pool=pool, dropped=dropped,
                            reason="staging full or daemon unreachable")
        return PutResult(len(staged), dropped)

    async def prefetch(self, pool: str, keys: Sequence[bytes], *, parent: bytes | None = None) -> None:
        """Ask the daemon to bring these blocks (a chain) into the cpu tier, e.g. from Redis.
        Read reports still pending go first, in the same round trip (AccessReports.take)."""
        self.pool(pool)
        bkeys = tuple(check_key(k) for k in keys)
        if bkeys:
            reads = await self._access.take_in_order()
            ask = Prefetch(pool, bkeys, None if parent is None else check_key(parent))
            try:
                await self._publisher.publish_many([*reads, (self._client_stream, ask)])
            except REDIS_ERRORS as e:
                if reads:
                    self._access.lost(e)
                raise

    async def wait_resident(self, pool: str, keys: Sequence[bytes], timeout: float = 5.0) -> bool:
        """Wait until all `keys` are resident locally (e.g. after put or prefetch), or time out."""
        deadline = time.monotonic() + timeout
        while self.lookup(pool, keys).length < len(keys):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True


class _PoolReads:
    """Shared-memory reads for a read-through (client/remote.py LocalReads): rows of `out`."""

    def __init__(self, client: Client, p: ClientPool, keys: list[BlockKey], out: torch.Tensor) -> None:
        self._client, self._p, self._keys, self._out = client, p, keys, out

    def listed(self, key: BlockKey) -> bool:
        return self._p.locate(key) is not None

    async def read(self, rows: Sequence[int]) -> list[bool]:
        p, keys, out = self._p, self._keys, self._out

        def read(share: Sequence[int]) -> list[bool]:
            return [p.read(keys[i], out[i]) for i in share]

        with p.in_use():
            return await self._client._copy(read, rows, len(rows) * p.block_bytes,
                                            threads=1 if out.device.type != "cpu" else None)


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs of consecutive ones: [(first, last), ...]."""
    runs: list[tuple[int, int]] = []
    for i in rows:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs
