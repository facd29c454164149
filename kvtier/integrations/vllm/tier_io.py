"""The kvtier side of the vLLM secondary tier: one event-loop thread that owns a kvtier Client.

vLLM calls a secondary tier on its scheduler thread and wants every call to return at once.
`TierIO` runs kvtier's asyncio `Client` on a private loop thread and hands the scheduler
`concurrent.futures.Future`s; the scheduler polls them (`done()`), it never waits on one.

Contract:
- Every job has a deadline. Its waits (staging room, residency after a put or a prefetch) end
  at the deadline; a hard guard one grace period later cancels what is left. Cancelling a copy
  waits for it (kvtier/offload.py), and the reads of one job run in a TaskGroup, so once a
  job's future is done no thread touches vLLM's primary memory on its behalf.
- Outcomes are per chunk (`Outcome.ok`). A chunk counts as stored only once kvtier made it
  visible (two-phase put, verified by the daemon), and as loaded only when `Client.get`
  verified the bytes it copied (seqlock, key, checksum). Anything else is a failed chunk, never
  wrong bytes.
- A daemon that is down, a Redis error, a pool that no longer fits: failed chunks, a counter
  and a rate-limited log line. A health task (every `health_interval_s`) notices a dead daemon
  (its pid), follows a restart, and reconnects.
- No vLLM import here: the adapter (secondary_tier.py) maps vLLM's types onto this.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis.exceptions
import torch

from kvtier.client import Client
from kvtier.client.discovery import library_logger
from kvtier.errors import DaemonUnavailable, KvtierError, UnknownPool
from kvtier.integrations.vllm.tier_chunks import PoolMismatch, pool_help, runs
from kvtier.integrations.vllm.tier_stats import Counters, LogThrottle
from kvtier.processes import pid_alive

POLL_S = 0.001  # residency polls while a load waits for a prefetch
STORE_POLL_S = 0.002  # ... and while a store waits for visibility or staging room
REDIS_CHECK_S = 0.05  # ... and how often it asks Redis about the chunks not visible here
GRACE_S = 2.0  # the hard guard past a job's deadline (copies in flight finish first)
CLOSE_S = 5.0
MISMATCH_RETRY_S = 5.0  # a daemon serving the pool at another size: look again this often


class _Down(Exception):
    """The daemon is not reachable right now (raised inside jobs, turned into failed chunks)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: tuple[bool, ...]  # per chunk of the job, in the job's order
    seconds: float
    reason: str = ""  # why some chunk failed ("" when none did)


class TierIO:
    def __init__(self, rows: np.ndarray, runtime_dir: str | None, pool: str, *, staging_chunks: int = 32,
                 connect_timeout_s: float = 5.0, health_interval_s: float = 0.25,
                 counters: Counters | None = None) -> None:
        self._rows = rows
        self.chunk_bytes = int(rows.shape[1])
        self.pool = pool
        self._rdir = None if runtime_dir is None else Path(runtime_dir)
        self._staging = staging_chunks
        self._connect_timeout = connect_timeout_s
        self._health_s = health_interval_s
        self.counters = counters or Counters()
        self.log = library_logger().bind(component="vllm_tier", pool=pool)
        self.warn = LogThrottle(self.log)
        self.up = False  # read by the scheduler thread; written by the loop thread only
        self._client: Client | None = None
        self._mismatch = ""
        self._retry_at = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-vllm-tier", daemon=True)
        self._thread.start()
        self._health: asyncio.Future | None = None
        try:
            self.call(self._reconnect(first=True), connect_timeout_s + CLOSE_S)
        except BaseException:
            self._stop_loop()
            raise
        self._health = asyncio.run_coroutine_threadsafe(self._health_loop(), self._loop)

    # --- for the scheduler thread ------------------------------------------------------------

    def submit(self, coro):
        """Schedule a coroutine on the loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro, timeout: float):
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def local_has(self, key: bytes) -> bool:
        """Whether `key` is resident on this node, from the shared-memory directory, on the
        caller's thread (no I/O). Reads only; any trouble (a restart remapping the pool right
        now) answers False and leaves the question to `exists` on the loop."""
        client = self._client
        if not self.up or client is None:
            return False
        try:
            p = client.pools.get(self.pool)
            return p is not None and p.locate(key) is not None
        except Exception:
            return False

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        if self._health is not None:
            self._health.cancel()
        with contextlib.suppress(Exception):
            self.call(self._drop_client(), CLOSE_S + 1)
        self._stop_loop()
        self._rows = None  # vLLM releases the primary memoryview next: hold no buffer export on it

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_S)
        if not self._thread.is_alive():
            self._loop.close()

    # --- connection and health (loop thread) -------------------------------------------------

    async def _reconnect(self, first: bool = False) -> None:
        try:
            client = await asyncio.wait_for(Client.connect(self._rdir, staging_blocks=self._staging),
                                            self._connect_timeout)
        except (DaemonUnavailable, OSError, TimeoutError, redis.exceptions.RedisError) as e:
            self.up = False
            if first:
                self.log.warning("vllm_tier.daemon_unavailable", error=str(e),
                                 detail="every lookup misses and every job fails until it is back")
            return
        try:
            self._check_pool(client)
        except PoolMismatch as e:
            await self._close_quietly(client)
            if first:
                raise
            if str(e) != self._mismatch:
                self.log.error("vllm_tier.pool_mismatch", error=str(e))
            self._mismatch = str(e)
            self._retry_at = time.monotonic() + MISMATCH_RETRY_S  # mapping every pool is not free
            self.up = False
            return
        old, self._client, self._mismatch = self._client, client, ""
        self.up = True
        self.log.info("vllm_tier.connected", node=client.node, daemon_pid=client.desc.get("pid"),
                      chunk_bytes=self.chunk_bytes)
        if old is not None:
            await self._close_quietly(old)

    def _check_pool(self, client: Client) -> None:
        try:
            p = client.pool(self.pool)
        except UnknownPool as e:
            raise PoolMismatch(f"kvtier pool {self.pool!r} is not served by the daemon ({e}). "
                               + pool_help(self.pool, self.chunk_bytes)) from e
        if p.block_bytes != self.chunk_bytes:
            raise PoolMismatch(f"kvtier pool {self.pool!r} holds blocks of {p.block_bytes} bytes, but vLLM's "
                               f"offload chunks are {self.chunk_bytes} bytes; they must be equal. "
                               + pool_help(self.pool, self.chunk_bytes))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_s)
            try:
                await self._check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the health task must outlive any surprise
                self.up = False
                self.warn.warning("vllm_tier.health_check_failed", error=repr(e))

    async def _check(self) -> None:
        client = self._client
        if client is not None and pid_alive(client.desc.get("pid")):
            try:
                self._check_pool(client)  # client.pool() follows a daemon restart (a new epoch)
            except PoolMismatch as e:
                if self.up:
                    self.log.error("vllm_tier.pool_mismatch", error=str(e))
                self.up = False
                return
            self.up = True
            return
        if self.up:
            self.log.warning("vllm_tier.daemon_lost", pid=client.desc.get("pid") if client else None)
        self.up = False
        if time.monotonic() >= self._retry_at:
            await self._reconnect()

    async def _drop_client(self) -> None:
        client, self._client, self.up = self._client, None, False
        if client is not None:
            await self._close_quietly(client)

    async def _close_quietly(self, client: Client) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), CLOSE_S)

    def _require(self, current: Client | None = None) -> Client:
        """The live client; with `current`, also that no reconnect replaced it (a job that
        started on a client the health task has since closed gives up)."""
        client = self._client
        if not self.up or client is None or (current is not None and client is not current):
            raise _Down("the kvtier daemon is not reachable")
        return client

    # --- jobs (loop thread) ------------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: resident on this node, or in Redis (put there by any node)."""
        client = self._require()
        return await self._present(client, keys)

    async def _present(self, client: Client, keys: Sequence[bytes]) -> list[bool]:
        """Client.present, with a Redis that cannot be asked counted (its keys count as absent)."""
        errors = client.stats.event_errors
        found = await client.present(self.pool, keys) if keys else []
        if client.stats.event_errors > errors:
            self.counters.add("redis_errors")
        return found

    async def run_job(self, kind: str, keys: Sequence[bytes], chunk_ids: Sequence[int], deadline: float) -> Outcome:
        """`kind` "store" or "load" with a hard guard at deadline + GRACE_S (time.monotonic)."""
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        reason = ""
        try:
            async with asyncio.timeout(max(0.0, deadline + GRACE_S - time.monotonic())):
                fn = self._store if kind == "store" else self._load
                reason = await fn(keys, chunk_ids, deadline, ok)
        except TimeoutError:
            reason = "timeout"
            self.counters.add("timeouts")
        except _Down as e:
            reason = "daemon_unavailable"
            self.counters.add("daemon_unavailable")
            self.warn.warning("vllm_tier.daemon_unavailable", job=kind, error=str(e))
        except (KvtierError, redis.exceptions.RedisError, OSError) as e:
            reason = type(e).__name__
            self.counters.add("redis_errors" if isinstance(e, redis.exceptions.RedisError) else "read_failures")
            self.warn.warning("vllm_tier.job_failed", job=kind, error=str(e))
        except Exception as e:  # a bug: the chunks fail, vLLM must not see it
            reason = repr(e)
            self.log.exception("vllm_tier.job_crashed", job=kind)
        if not all(ok) and not reason:
            reason = "incomplete"
        return Outcome(tuple(ok), time.perf_counter() - t0, reason)

    def _tensor(self, client: Client, first_chunk: int, n: int) -> torch.Tensor:
        p = client.pool(self.pool)
        rows = torch.from_numpy(self._rows[first_chunk:first_chunk + n])
        return rows.view(p.dtype).reshape(n, *p.shape)

    async def _store(self, keys, chunk_ids, deadline: float, ok: list[bool]) -> str:
        client = self._require()
        todo = []
        for i, k in enumerate(keys):
            if client.lookup(self.pool, [k]).length:
                ok[i] = True  # already here: content-addressed, nothing to copy
            else:
                todo.append(i)
        self.counters.add("store_chunks_deduped", len(keys) - len(todo))
        parent = None
        for run in runs(todo, chunk_ids):
            run_keys = [keys[i] for i in run]
            j = 0
            while j < len(run_keys):
                errors = client.stats.event_errors
                res = await client.put(self.pool, run_keys[j:], self._tensor(client, chunk_ids[run[j]], len(run) - j),
                                       parent=run_keys[j - 1] if j else parent)
                j += res.staged
                if j == len(run_keys):
                    break
                if client.stats.event_errors > errors:
                    self.counters.add("redis_errors")
                    return "put_failed"
                if time.monotonic() > deadline:
                    self.counters.add("timeouts")
                    return "staging_full"
                self._require(client)
                await asyncio.sleep(STORE_POLL_S)  # staging full: the daemon frees slots as it stores
            parent = run_keys[-1]
        stored = await self._wait_stored(client, [keys[i] for i in todo], deadline)
        for i in todo:
            ok[i] = keys[i] in stored
        return ""

    async def _load(self, keys, chunk_ids, deadline: float, ok: list[bool]) -> str:
        """Read what is resident here at once; ask the daemon to promote what only Redis holds,
        and read each of those as soon as it lands, until the deadline."""
        client = self._require()
        local = [client.lookup(self.pool, [k]).length == 1 for k in keys]
        absent = [i for i, here in enumerate(local) if not here]
        reason = ""
        pending: list[int] = []
        if absent:
            pending = [i for i, has in zip(absent, await self._present(client, [keys[i] for i in absent])) if has]
            if len(pending) < len(absent):
                reason = "not_found"
            if pending:
                try:
                    await client.prefetch(self.pool, [keys[i] for i in pending])  # Redis -> this node's cpu tier
                    self.counters.add("load_chunks_prefetched", len(pending))
                except redis.exceptions.RedisError as e:
                    self.counters.add("redis_errors")
                    self.warn.warning("vllm_tier.redis_failed", op="prefetch", error=str(e))
                    pending, reason = [], "prefetch_failed"
        readable = [i for i, here in enumerate(local) if here]
        async with asyncio.TaskGroup() as tg:  # every read finishes before this job does

            def read(idx: list[int]) -> None:
                for run in runs(idx, chunk_ids):
                    tg.create_task(self._read_run(client, keys, chunk_ids, run, ok))

            read(readable)
            while pending:
                await asyncio.sleep(POLL_S)
                landed = [i for i in pending if client.lookup(self.pool, [keys[i]]).length]
                if landed:
                    read(landed)
                    readable += landed
                    gone = set(landed)
                    pending = [i for i in pending if i not in gone]
                live = self.up and self._client is client
                if pending and (time.monotonic() >= deadline or not live):
                    self.counters.add("timeouts" if live else "daemon_unavailable")
                    reason = reason or ("prefetch_timeout" if live else "daemon_unavailable")
                    break
        read_failed = sum(1 for i in readable if not ok[i])
        if read_failed:
            self.counters.add("read_failures", read_failed)
            reason = reason or "read_failed"
        return reason

    async def _read_run(self, client: Client, keys, chunk_ids, run: list[int], ok: list[bool]) -> None:
        """Copy one run of consecutive chunks. `get` stops at the first chunk that fails
        verification (or was evicted meanwhile); carry on after it."""
        j = 0
        while j < len(run):
            try:
                n = await client.get(self.pool, [keys[i] for i in run[j:]],
                                     self._tensor(client, chunk_ids[run[j]], len(run) - j))
            except (KvtierError, OSError) as e:  # e.g. the pool changed under a restart
                self.warn.warning("vllm_tier.read_failed", error=str(e))
                return
            for i in run[j:j + n]:
                ok[i] = True
            j += n + 1

    async def _wait_stored(self, client: Client, keys: list[bytes], deadline: float) -> set[bytes]:
        """The keys kvtier made visible, waiting until all are, the deadline passes, or the daemon
        is lost. Visible here, or in Redis: a daemon with no local room writes a put straight
        there (checked every REDIS_CHECK_S, not at every poll)."""
        pending, stored = list(keys), set()
        next_redis = time.monotonic() + REDIS_CHECK_S
        while True:
            here = [k for k in pending if client.lookup(self.pool, [k]).length]
            stored.update(here)
            pending = [k for k in pending if k not in stored]
            now = time.monotonic()
            if pending and (now >= next_redis or now >= deadline):
                stored.update(k for k, has in zip(pending, await self._present(client, pending)) if has)
                pending = [k for k in pending if k not in stored]
                next_redis = now + REDIS_CHECK_S
            if not pending:
                return stored
            if now >= deadline:
                self.counters.add("timeouts")
                return stored
            self._require(client)
            await asyncio.sleep(STORE_POLL_S)
