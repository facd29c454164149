"""A consumer-group Consumer over Redis Streams, with at-least-once delivery.

Guarantees (docs/architecture.md, "Bus"; docs/reliability.md):
- ack after the effect: a handled entry is XACKed only once its handler has returned;
- at start, re-read this consumer's own pending history (read from id 0 until empty, the
  documented restart procedure), then XAUTOCLAIM entries that other consumers left idle;
  XAUTOCLAIM runs again every `claim_idle_ms`, which also retries this consumer's failed entries;
- an entry that fails validation, or was delivered more than `max_deliveries` times (not counting
  deliveries that ended in a Redis outage: bus/outages.py), goes to the dead-letter stream with
  its reason and is then acked; a trimmed entry (nil payload) is acked (bus/deadletter.py);
- a lost group (NOGROUP: Redis restarted empty, stream deleted) is re-created with MKSTREAM;
- connection trouble backs off with jitter, capped at about 1 s; it never spins.
Handlers must be idempotent: delivery is at least once, never exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from redis.backoff import EqualJitterBackoff
from redis.exceptions import ResponseError

from kvtier.bus.batch import CANCEL_FLUSH_TIMEOUT_S, Batch, BatchHandler
from kvtier.bus.batch import SUMMARY_S as SUMMARY_S  # re-exported: tests/unit/test_operator_text.py
from kvtier.bus.batch import Delivery as Delivery  # what handlers take: imported from here
from kvtier.bus.batch import _Summary as _Summary
from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.connect import AsyncRedis, is_cluster
from kvtier.bus.deadletter import Entry, Settler
from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.bus.publisher import BusStats
from kvtier.bus.trim import entry_id
from kvtier.failpoints import Failpoints
from kvtier.logs import LogThrottle


class Consumer:
    """One consumer of `group` over `streams`. `run()` until `stop()`; see the module docstring.

    `claim_idle_ms` must exceed the slowest handler: an entry idle that long is assumed abandoned
    and claimed. `block_ms` must stay below the client's socket_timeout, or the blocking read
    itself times out (refused here, with a ValueError).
    """

    def __init__(
        self,
        redis: AsyncRedis,
        streams: Sequence[str],
        group: str,
        consumer: str,
        handler: Callable[[Delivery], Awaitable[None]],
        *,
        dlq: str,
        read_count: int,
        block_ms: int,
        claim_idle_ms: int,
        max_deliveries: int,
        publisher_maxlen: int,
        stats: BusStats,
        log: Any,
        after_batch: Callable[[], Awaitable[None]] | None = None,
        failpoints: Failpoints | None = None,
    ) -> None:
        if not streams or dlq in streams:
            raise ValueError("need at least one stream, and the dlq must not be one of them")
        if min(read_count, block_ms, claim_idle_ms, max_deliveries, publisher_maxlen) < 1:
            raise ValueError(
                "read_count, block_ms, claim_idle_ms, max_deliveries and publisher_maxlen must be positive"
            )
        pool = getattr(redis, "connection_pool", None)
        socket_timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout")
        if socket_timeout is not None and block_ms >= socket_timeout * 1000:
            raise ValueError(f"block_ms={block_ms} must be below the socket timeout ({socket_timeout} s)")
        self._redis = redis
        self._cluster = is_cluster(redis)
        self._streams = tuple(streams)
        self._by_key = {s.encode(): s for s in self._streams}
        self._group = group
        self._consumer = consumer
        self._read_count = read_count
        self._block_ms = block_ms
        self._claim_idle_ms = claim_idle_ms
        self.stats = stats
        self._log = log.bind(group=group, consumer=consumer)
        self._quiet = LogThrottle(self._log)
        # `after_batch` runs once per batch, after the handler has seen every entry and before
        # any is acked: a handler buffers its output (commands, facts) and publishes it at once.
        settler = Settler(redis, group, dlq, publisher_maxlen, stats, self._log)
        self._batches = BatchHandler(redis, group, consumer, handler, after_batch, settler,
                                     max_deliveries=max_deliveries, stats=stats, log=self._log,
                                     failpoints=failpoints or Failpoints())
        self.outages = self._batches.outages
        self._stopping = False
        self._running = False
        self._groups_seen = False
        # drain(): the newest entry id of each stream when the drain began, and the newest read.
        self._drain_to: dict[str, tuple[int, int]] | None = None
        self._read_to: dict[str, tuple[int, int]] = {}

    def stop(self) -> None:
        """Ask `run()` to return once the current batch is handled and acked (within ~block_ms;
        an ack Redis does not take then leaves its entry pending for the next start, logged).

        Final: a stopped Consumer does not run again; build a new one.
        """
        self._stopping = True

    def drain(self) -> None:
        """Ask `run()` to handle what its streams hold now, then return as `stop()` does: it reads
        on, without blocking, until it has read every entry that was there when the drain began
        (entries added later are left for the next start), or a read finds nothing new. A graceful
        stop drains, so that what clients were told is staged is stored before the daemon exits
        (their staging may be gone by the next start)."""
        if self._drain_to is None:
            self._drain_to = {}  # the targets are read by run(), on the loop that owns the client

    async def run(self) -> None:
        if self._running:
            raise RuntimeError("Consumer.run() is already running")
        self._running = True
        backoff = EqualJitterBackoff(cap=1.0, base=0.01)
        failures = 0
        recovered = False
        next_claim = 0.0
        self._log.info("bus.consumer_started", streams=list(self._streams))
        try:
            while not self._stopping:
                raise_if_cancelling()  # a cancel redis-py swallowed (bus/cancel.py) still ends us
                try:
                    if not recovered:
                        await self._ensure_groups()
                        await self._drain_history()
                        await self._autoclaim()
                        recovered = True
                        next_claim = time.monotonic() + self._claim_idle_ms / 1000
                    elif self._drain_to is not None:
                        if await self._drained():
                            break
                    elif time.monotonic() >= next_claim:
                        await self._batches.settle_held()  # first: a claim must not find them pending
                        await self._autoclaim()
                        next_claim = time.monotonic() + self._claim_idle_ms / 1000
                    else:
                        await self._read_new()
                    failures = 0
                    continue
                except REDIS_ERRORS as e:
                    if is_outage(e):  # first: CLUSTERDOWN is also a ResponseError
                        self.stats.redis_errors += 1
                        self._quiet.warning("bus.redis_unavailable", error=str(e), failures=failures + 1)
                        if self._drain_to is not None:
                            # A drain cannot progress without Redis: stop now rather than retry
                            # until the grace period ends; the entries wait for the next start.
                            self._log.warning("bus.drain_abandoned", error=str(e))
                            break
                    elif isinstance(e, ResponseError) and str(e).startswith("NOGROUP"):
                        # The group (and its PEL) is gone; redo the whole start-up procedure.
                        self._log.warning("bus.nogroup", error=str(e))
                        recovered = False
                    else:
                        self.stats.redis_errors += 1
                        self._log.error("bus.redis_error", error=str(e), exc_info=True)
                except Exception as e:  # last: see bus/failures.py (a library's bug must not end the bus)
                    self.stats.redis_errors += 1
                    self._log.error("bus.unexpected_error", error=f"{type(e).__name__}: {e}", exc_info=True)
                failures += 1
                await asyncio.sleep(backoff.compute(failures))
        finally:
            self._running = False
            await self._settle_at_exit()
            self._log.info("bus.consumer_stopped", **self.stats.as_dict())

    async def _settle_at_exit(self) -> None:
        """Ack what the last batch did (its effects are done): bounded by the client's own
        timeouts on a stop, by CANCEL_FLUSH_TIMEOUT_S when cancelled. Acks that do not land
        leave their entries pending for the next start, said in a log line."""
        if not self._batches.holding:
            return
        task = asyncio.current_task()
        bound = CANCEL_FLUSH_TIMEOUT_S if task is not None and task.cancelling() else None
        with contextlib.suppress(Exception):
            await asyncio.shield(asyncio.wait_for(self._batches.settle_held(), bound))
        if left := self._batches.holding:
            self._log.warning("bus.acks_left_pending", entries=left)

    # --- the three ways entries arrive ------------------------------------------------------

    async def _ensure_groups(self) -> None:
        for stream in self._streams:
            try:
                await self._redis.xgroup_create(stream, self._group, id="0", mkstream=True)
            except ResponseError as e:
                if not str(e).startswith("BUSYGROUP"):
                    raise
                continue
            self.stats.groups_created += 1
            if self._groups_seen:
                self._log.warning("bus.group_recreated", stream=stream)
            else:
                self._log.debug("bus.group_created", stream=stream)
        self._groups_seen = True

    async def _drain_history(self) -> None:
        """Re-read this consumer's own pending entries, with a cursor so a failing one is read once."""
        for stream in self._streams:
            cursor = b"0"
            while not self._stopping:
                reply = cast(Batch, await self._redis.xreadgroup(
                    self._group, self._consumer, {stream: cursor}, count=self._read_count
                ))  # fmt: skip
                entries = reply[0][1] if reply else []
                if not entries:
                    break
                cursor = cast(bytes, entries[-1][0])  # ids are never nil in a history read
                self.stats.reclaimed += len(entries)
                await self._batches.handle([(stream, entries)], counted=True)

    async def _autoclaim(self) -> None:
        for stream in self._streams:
            cursor = b"0-0"
            while not self._stopping:
                reply = await self._redis.xautoclaim(
                    stream, self._group, self._consumer, self._claim_idle_ms,
                    start_id=cursor, count=self._read_count,
                )  # fmt: skip
                cursor, entries = cast(bytes, reply[0]), cast(list[Entry], reply[1])
                # Redis >= 7.0 drops ids whose payload is gone from the PEL itself and lists them
                # third, so there is nothing left to ack for them.
                deleted = reply[2] if len(reply) > 2 else []
                if deleted:
                    self.stats.deleted_entries += len(deleted)
                    self._log.info("bus.deleted_entries", stream=stream, count=len(deleted))
                if entries:
                    self.stats.reclaimed += len(entries)
                    self._log.debug("bus.reclaimed", stream=stream, count=len(entries))
                    await self._batches.handle([(stream, entries)], counted=True)
                if cursor in (b"0-0", "0-0"):
                    break

    async def _read_new(self, block: bool = True) -> bool:
        """Read and handle new entries; whether there were any."""
        block_ms = self._block_ms if block else None

        def read(r: Any) -> Any:  # on the client (awaited) or on a pipeline (queued)
            return r.xreadgroup(self._group, self._consumer, {s: ">" for s in self._streams},
                                count=self._read_count, block=block_ms)

        if self._batches.holding and not self._cluster:  # the last batch's acks, then this read: one round trip
            got = await self._batches.ack_then_read(read)
        else:
            await self._batches.settle_held()
            got = await read(self._redis)
        reply = cast(list[tuple[bytes, list[Entry]]], got)
        if not reply:
            return False
        batches = [(self._by_key.get(key, key.decode()), entries) for key, entries in reply]
        for stream, entries in batches:
            if entries and (last := entries[-1][0]) is not None:
                self._read_to[stream] = entry_id(last)
        await self._batches.handle(batches, counted=False, hold_acks=True)
        return True

    async def _drained(self) -> bool:
        """One step of a drain: whether every entry there at its start has been read."""
        assert self._drain_to is not None
        if not self._drain_to:  # the drain's first step: where each stream ends now
            for stream in self._streams:
                newest = await self._redis.xrevrange(stream, count=1)
                self._drain_to[stream] = entry_id(newest[0][0] or b"0-0") if newest else (0, 0)
        if all(self._read_to.get(s, (0, 0)) >= end for s, end in self._drain_to.items()):
            return True
        return not await self._read_new(block=False)
