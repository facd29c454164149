"""The kvtier side of the vLLM secondary tier: the store and load jobs vLLM's scheduler submits.

`TierIO` reaches the daemon through the shared engine link (kvtier/integrations/link.py: found
lazily, its pid watched, its pool checked, every failure a miss). Jobs run on the link's client's
own loop thread (`SyncClient.submit`): the scheduler polls their `concurrent.futures.Future`s
(`done()`), it never waits on one. Lookups on this node's shared memory run on the caller's thread.

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
  and a rate-limited log line.
- No vLLM import here: the adapter (secondary_tier.py) maps vLLM's types onto this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.client import Client, DropReason, ManifestEntry, SyncClient
from kvtier.client.discovery import library_logger
from kvtier.errors import KvtierError, RedisUnavailable
from kvtier.integrations.link import WATCH_S, EngineLink
from kvtier.integrations.vllm.tier_chunks import chunk_spec, runs
from kvtier.integrations.vllm.tier_stats import Counters, LogThrottle

POLL_S = 0.001  # residency polls while a load waits for a prefetch
STORE_POLL_S = 0.002  # ... and while a store waits for visibility
REDIS_CHECK_S = 0.05  # ... and how often it asks Redis about the chunks not visible here
GRACE_S = 2.0  # the hard guard past a job's deadline (copies in flight finish first)


class DaemonDown(Exception):
    """The daemon is not reachable right now (raised inside jobs, turned into failed chunks)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: tuple[bool, ...]  # per chunk of the job, in the job's order
    seconds: float
    reason: str = ""  # why some chunk failed ("" when none did)


class TierIO:
    def __init__(self, rows: np.ndarray, runtime_dir: str | None, pool: str, *, staging_chunks: int = 32,
                 connect_timeout_s: float = 5.0, health_interval_s: float = 0.25,
                 counters: Counters | None = None, entry: ManifestEntry | None = None) -> None:
        self._rows: np.ndarray | None = rows
        self.chunk_bytes = int(rows.shape[1])
        self.pool = pool
        self.counters = counters or Counters()
        self.log = library_logger().bind(component="vllm_tier", pool=pool)
        self.warn = LogThrottle(self.log)
        self.link = EngineLink(runtime_dir=runtime_dir, spec=chunk_spec(pool, self.chunk_bytes),
                               counters=self.counters, log=self.log, retry_s=health_interval_s,
                               staging_blocks=staging_chunks, connect_timeout_s=connect_timeout_s,
                               watch_s=min(health_interval_s, WATCH_S), component="vllm_tier",
                               puts=True)  # the tier stores what vLLM offloads
        if entry is not None:
            self.link.register(entry)  # entered in the manifest on the first connection
        self.link.start(first=True)  # PoolMismatch (a ValueError) for a pool that cannot hold the chunks

    # --- for the scheduler thread ------------------------------------------------------------

    @property
    def up(self) -> bool:
        """Whether the daemon is reachable now (the link's thread watches it: this only reads)."""
        return self.link.current is not None

    def local_has(self, key: bytes) -> bool:
        """Whether `key` is resident on this node, from the shared-memory directory as mapped now,
        on the caller's thread (no I/O). Any trouble answers False, and leaves the question to
        `exists`."""
        client = self.link.current
        if client is None:
            return False
        try:
            p = client.mapped(self.pool)
            return p is not None and p.locate(key) is not None
        except Exception:  # noqa: BLE001 - e.g. a restart remapping the pool right now
            return False

    def exists(self, keys: Sequence[bytes], timeout: float) -> list[bool]:
        """Per key: on this node, or in Redis (put there by any node); all False when unknown."""
        def ask(client: SyncClient) -> list[bool]:
            errors = client.stats.event_errors
            found = client.present(self.pool, keys, timeout=timeout)
            if client.stats.event_errors > errors:
                self.counters.add("redis_errors")
            return found

        return self.link.guard("exists", [False] * len(keys), ask)

    def submit(self, kind: str, keys: Sequence[bytes], chunk_ids: Sequence[int],
               deadline: float) -> concurrent.futures.Future[Outcome] | None:
        """Start a job ("store" or "load") on the client's loop; None when the daemon is down."""
        sync = self.link.client()
        if sync is None:
            return None
        return sync.submit(lambda client: self.run_job(sync, client, kind, keys, chunk_ids, deadline))

    def close(self) -> None:
        self.link.close()
        self._rows = None  # vLLM releases the primary memoryview next: hold no buffer export on it

    # --- jobs (the client's loop thread) -------------------------------------------------------

    def _require(self, sync: SyncClient) -> None:
        """The job's client is still the link's (the link dropped it when its daemon died)."""
        if self.link.current is not sync:
            raise DaemonDown("the kvtier daemon is not reachable")

    async def _present(self, client: Client, keys: Sequence[bytes]) -> list[bool]:
        """Client.present, with a Redis that cannot be asked counted (its keys count as absent)."""
        errors = client.stats.event_errors
        found = await client.present(self.pool, keys) if keys else []
        if client.stats.event_errors > errors:
            self.counters.add("redis_errors")
        return found

    async def run_job(self, sync: SyncClient, client: Client, kind: str, keys: Sequence[bytes],
                      chunk_ids: Sequence[int], deadline: float) -> Outcome:
        """`kind` "store" or "load" with a hard guard at deadline + GRACE_S (time.monotonic)."""
        t0 = time.perf_counter()
        ok = [False] * len(keys)
        reason = ""
        try:
            async with asyncio.timeout(max(0.0, deadline + GRACE_S - time.monotonic())):
                fn = self._store if kind == "store" else self._load
                reason = await fn(sync, client, keys, chunk_ids, deadline, ok)
        except TimeoutError:
            reason = "timeout"
            self.counters.add("timeouts")
        except DaemonDown as e:
            reason = "daemon_unavailable"
            self.counters.add("daemon_unavailable")
            self.warn.warning("vllm_tier.daemon_unavailable", job=kind, error=str(e))
        except (KvtierError, OSError) as e:
            reason = type(e).__name__
            self.counters.add("redis_errors" if isinstance(e, RedisUnavailable) else "read_failures")
            self.warn.warning("vllm_tier.job_failed", job=kind, error=str(e))
        except Exception as e:  # a bug: the chunks fail, vLLM must not see it
            reason = repr(e)
            self.log.exception("vllm_tier.job_crashed", job=kind)
        if not all(ok) and not reason:
            reason = "incomplete"
        return Outcome(tuple(ok), time.perf_counter() - t0, reason)

    def _tensor(self, client: Client, first_chunk: int, n: int) -> torch.Tensor:
        if self._rows is None:
            raise DaemonDown("the tier is closed")
        p = client.pool(self.pool)
        rows = torch.from_numpy(self._rows[first_chunk:first_chunk + n])
        return rows.view(p.dtype).reshape(n, *p.shape)

    async def _store(self, sync: SyncClient, client: Client, keys: Sequence[bytes], chunk_ids: Sequence[int],
                     deadline: float, ok: list[bool]) -> str:
        self._require(sync)
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
            res = await client.put(self.pool, run_keys, self._tensor(client, chunk_ids[run[0]], len(run)),
                                   parent=parent, wait_s=max(0.0, deadline - time.monotonic()))
            if res.dropped:
                if res.reason is DropReason.DAEMON_GONE:
                    raise DaemonDown("the kvtier daemon is not running")
                self.counters.add("redis_errors" if res.reason is DropReason.BUS_UNREACHABLE else "timeouts")
                return "put_failed" if res.reason is DropReason.BUS_UNREACHABLE else "staging_full"
            parent = run_keys[-1]
        stored = await self._wait_stored(sync, client, [keys[i] for i in todo], deadline)
        for i in todo:
            ok[i] = keys[i] in stored
        if n := sum(ok[i] for i in todo):
            self.link.stored(n, n * self.chunk_bytes)  # the manifest's counts
        return ""

    async def _load(self, sync: SyncClient, client: Client, keys: Sequence[bytes], chunk_ids: Sequence[int],
                    deadline: float, ok: list[bool]) -> str:
        """Read what is resident here at once; ask the daemon to promote what only Redis holds,
        and read each of those as soon as it lands, until the deadline. A resident chunk evicted
        before its read (the promotes make room) is read through from Redis."""
        self._require(sync)
        local = [client.lookup(self.pool, [k]).length == 1 for k in keys]
        absent = [i for i, here in enumerate(local) if not here]
        readable = [i for i, here in enumerate(local) if here]
        reason = ""
        async with asyncio.TaskGroup() as tg:  # every read finishes before this job does

            def read(idx: list[int]) -> None:
                for run in runs(idx, chunk_ids):
                    tg.create_task(self._read_run(client, keys, chunk_ids, run, ok))

            read(readable)  # before the prefetch below, whose promotes may evict these
            pending: list[int] = []
            if absent:
                pending = [i for i, has in zip(absent, await self._present(client, [keys[i] for i in absent])) if has]
                if len(pending) < len(absent):
                    reason = "not_found"
                if pending:
                    try:
                        await client.prefetch(self.pool, [keys[i] for i in pending])  # Redis -> this node's cpu tier
                        self.counters.add("load_chunks_prefetched", len(pending))
                    except RedisUnavailable as e:
                        self.counters.add("redis_errors")
                        self.warn.warning("vllm_tier.redis_failed", op="prefetch", error=str(e))
                        pending, reason = [], "prefetch_failed"
            while pending:
                await asyncio.sleep(POLL_S)
                landed = [i for i in pending if client.lookup(self.pool, [keys[i]]).length]
                if landed:
                    read(landed)
                    readable += landed
                    gone = set(landed)
                    pending = [i for i in pending if i not in gone]
                live = self.link.current is sync
                if pending and (time.monotonic() >= deadline or not live):
                    self.counters.add("timeouts" if live else "daemon_unavailable")
                    reason = reason or ("prefetch_timeout" if live else "daemon_unavailable")
                    break
        lost = [i for i in readable if not ok[i]]
        if lost:
            self.counters.add("read_failures", len(lost))
            if time.monotonic() < deadline and self.link.current is sync:
                async with asyncio.TaskGroup() as tg:
                    for run in runs(lost, chunk_ids):
                        tg.create_task(self._read_run(client, keys, chunk_ids, run, ok, remote=True))
        if any(not ok[i] for i in lost):
            reason = reason or "read_failed"
        return reason

    async def _read_run(self, client: Client, keys: Sequence[bytes], chunk_ids: Sequence[int], run: list[int],
                        ok: list[bool], *, remote: bool = False) -> None:
        """Copy one run of consecutive chunks (`remote`: what this node lacks, from Redis). `get`
        stops at the first chunk that fails verification (or was evicted meanwhile); carry on
        after it."""
        j = 0
        while j < len(run):
            try:
                n = await client.get(self.pool, [keys[i] for i in run[j:]],
                                     self._tensor(client, chunk_ids[run[j]], len(run) - j), remote=remote)
            except (KvtierError, OSError) as e:  # e.g. the pool changed under a restart
                self.warn.warning("vllm_tier.read_failed", error=str(e))
                return
            for i in run[j:j + n]:
                ok[i] = True
            j += n + 1

    async def _wait_stored(self, sync: SyncClient, client: Client, keys: list[bytes], deadline: float) -> set[bytes]:
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
            self._require(sync)
            await asyncio.sleep(STORE_POLL_S)
