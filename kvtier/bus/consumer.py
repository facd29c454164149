"""A consumer-group Consumer over Redis Streams, with at-least-once delivery.

Guarantees (DESIGN.md "Bus", reliability.md §1):
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
from dataclasses import dataclass
from typing import Any, cast

from redis.backoff import EqualJitterBackoff
from redis.exceptions import ResponseError

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.connect import AsyncRedis
from kvtier.bus.deadletter import DeadLetter, Entry, Rejected, Settler, triage
from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.bus.outages import OutageLedger
from kvtier.bus.publisher import FIELD, BusStats
from kvtier.core.events import Envelope
from kvtier.errors import MalformedEvent
from kvtier.failpoints import Failpoints
from kvtier.logs import LogThrottle

CANCEL_FLUSH_TIMEOUT_S = 1.0  # bounded: a cancelled consumer must not hang on a dead Redis
SUMMARY_S = 60.0  # one `bus.summary` line (info) per consumer per this many seconds of work

Batch = list[tuple[str, list[Entry]]]  # (stream, entries) pairs, as read


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: bytes
    envelope: Envelope


class Consumer:
    """One consumer of `group` over `streams`. `run()` until `stop()`; see the module docstring.

    `claim_idle_ms` must exceed the slowest handler: an entry idle that long is assumed abandoned
    and claimed. `block_ms` must stay below the client's socket_timeout, or the blocking read
    itself times out (reliability.md §0.5).
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
        self._streams = tuple(streams)
        self._by_key = {s.encode(): s for s in self._streams}
        self._group = group
        self._consumer = consumer
        self._handler = handler
        # Called once per batch, after the handler has seen every entry and before any is acked:
        # lets a handler buffer its own output (commands, facts) and publish it in one round trip.
        self._after_batch = after_batch
        self._failpoints = failpoints or Failpoints()
        self._read_count = read_count
        self._block_ms = block_ms
        self._claim_idle_ms = claim_idle_ms
        self._max_deliveries = max_deliveries
        self.stats = stats
        self._log = log.bind(group=group, consumer=consumer)
        self._quiet = LogThrottle(self._log)
        self._summary = _Summary(time.monotonic())
        self._settler = Settler(redis, group, dlq, publisher_maxlen, stats, self._log)
        self.outages = OutageLedger()
        self._stopping = False
        self._running = False
        self._groups_seen = False
        # drain(): the newest entry id of each stream when the drain began, and the newest read.
        self._drain_to: dict[str, tuple[int, int]] | None = None
        self._read_to: dict[str, tuple[int, int]] = {}

    def stop(self) -> None:
        """Ask `run()` to return once the current batch is handled and acked (within ~block_ms).

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
            self._log.info("bus.consumer_stopped", **self.stats.as_dict())

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
                await self._handle([(stream, entries)], counted=True)

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
                    await self._handle([(stream, entries)], counted=True)
                if cursor in (b"0-0", "0-0"):
                    break

    async def _read_new(self, block: bool = True) -> bool:
        """Read and handle new entries; whether there were any."""
        reply = cast(list[tuple[bytes, list[Entry]]], await self._redis.xreadgroup(
            self._group, self._consumer, {s: ">" for s in self._streams}, count=self._read_count,
            block=self._block_ms if block else None,
        ))  # fmt: skip
        if not reply:
            return False
        batches = [(self._by_key.get(key, key.decode()), entries) for key, entries in reply]
        for stream, entries in batches:
            if entries and (last := entries[-1][0]) is not None:
                self._read_to[stream] = _entry_id(last)
        await self._handle(batches, counted=False)
        return True

    async def _drained(self) -> bool:
        """One step of a drain: whether every entry there at its start has been read."""
        assert self._drain_to is not None
        if not self._drain_to:  # the drain's first step: where each stream ends now
            for stream in self._streams:
                newest = await self._redis.xrevrange(stream, count=1)
                self._drain_to[stream] = _entry_id(newest[0][0] or b"0-0") if newest else (0, 0)
        if all(self._read_to.get(s, (0, 0)) >= end for s, end in self._drain_to.items()):
            return True
        return not await self._read_new(block=False)

    # --- one batch --------------------------------------------------------------------------

    async def _handle(self, batches: Batch, *, counted: bool) -> None:
        """Run the handler over a batch, then dead-letter and ack in as few round trips as possible.

        `counted`: entries were delivered before (history, claim), so look up their delivery
        counts; a fresh '>' read is delivery number 1.
        """
        t0 = time.monotonic()
        acks: dict[str, list[bytes]] = {}
        dead: list[DeadLetter] = []
        lost: set[tuple[str, bytes]] = set()  # deliveries that ended in an outage (bus/outages.py)
        effects_done = self._after_batch is None  # with a hook, effects exist only once it ran
        failed: Exception | None = None
        try:
            try:
                for stream, entries in batches:
                    done = acks.setdefault(stream, [])
                    counts = await self._delivery_counts(stream, entries) if counted else None
                    for entry_id, fields in entries:
                        await self._handle_one(stream, entry_id, fields, counts, done, dead, lost)
            except REDIS_ERRORS as e:
                if is_outage(e):  # the whole batch comes back: not its entries' fault
                    self.outages.record(lost | self._ids(batches), {}, [])
                raise
            if self._after_batch is not None:
                try:
                    await self._after_batch()
                    effects_done = True
                except Exception as e:
                    # The batch's effects are not complete: ack nothing it handled, so every
                    # entry comes back (handlers are idempotent). Dead letters stand.
                    self.stats.handler_errors += 1
                    self._log.error("bus.after_batch_error", exc_info=True)
                    acks = {}
                    if isinstance(e, REDIS_ERRORS):
                        failed = e
        except asyncio.CancelledError:
            # Ack (shielded, bounded) only what has really taken effect, then keep cancelling.
            # Without the batch hook having run, handled entries stay pending and come back.
            if not effects_done:
                acks = {}
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wait_for(self._settler.flush(acks, dead), CANCEL_FLUSH_TIMEOUT_S))
            raise
        handled, dead_count = sum(map(len, acks.values())), len(dead)
        if handled:
            self._failpoints.reached("after_xadd")
        if is_outage(failed):
            lost.update(self._ids(batches))
        try:
            await self._settler.flush(acks, dead)
        except REDIS_ERRORS as e:
            if is_outage(e):  # nothing was settled
                self.outages.record(lost | self._ids(batches), {}, [])
            raise
        self.outages.record(lost, acks, dead)  # once per delivery; acked and dead-lettered ones are settled
        if failed is not None:
            # Redis refused the batch's outcomes (down, OOM, read-only): let run() back off
            # before reading more, rather than fail every new batch the same way at once.
            raise failed
        # The canonical line for one unit of work (debug: hundreds a second under load), and a
        # summary of them at info once a minute.
        ms = round((time.monotonic() - t0) * 1000, 2)
        self._log.debug("bus.batch", streams=[b[0] for b in batches], handled=handled, dead=dead_count,
                        reclaimed=counted, ms=ms)
        if (line := self._summary.add(handled, dead_count, counted, ms, time.monotonic())) is not None:
            self._log.info("bus.summary", **line)

    async def _handle_one(
        self, stream: str, entry_id: bytes | None, fields: dict[bytes, bytes] | None,
        counts: dict[bytes, int] | None, done: list[bytes], dead: list[DeadLetter], lost: set[tuple[str, bytes]],
    ) -> None:  # fmt: skip
        if entry_id is None:  # Redis 6.2 XAUTOCLAIM reports a deleted entry as nil, id and all
            self.stats.deleted_entries += 1
            return
        if not fields:  # nil payload: trimmed (MAXLEN) or XDELed while pending
            self.stats.deleted_entries += 1
            self._log.debug("bus.deleted_entry", stream=stream, id=entry_id)
            done.append(entry_id)
            return
        delivered = None
        if counts is not None:
            delivered = counts.get(entry_id)
            if delivered is None:  # acked or claimed by someone else meanwhile: no longer ours
                return
        if delivered is not None:
            delivered = self.outages.counted(stream, entry_id, delivered)
        verdict = triage(fields, delivered, self._max_deliveries)
        if isinstance(verdict, Rejected):
            dead.append((stream, entry_id, verdict.reason, verdict.raw))
            return
        self.stats.delivered += 1
        self._log.debug("bus.deliver", stream=stream, id=entry_id, type=verdict.event.TYPE)
        try:
            await self._handler(Delivery(stream=stream, entry_id=entry_id, envelope=verdict))
        except MalformedEvent as e:
            # Well-formed on the wire but meaningless here (an unknown pool, say): retrying
            # cannot help, so dead-letter it now with the handler's reason.
            dead.append((stream, entry_id, e.reason, fields.get(FIELD)))
            return
        except Exception as e:
            # Left pending: XAUTOCLAIM hands it back after claim_idle_ms, up to max_deliveries.
            if is_outage(e):
                lost.add((stream, entry_id))
            self.stats.handler_errors += 1
            self._log.error("bus.handler_error", stream=stream, id=entry_id, exc_info=True)
            return
        done.append(entry_id)

    @staticmethod
    def _ids(batches: Batch) -> set[tuple[str, bytes]]:
        return {(stream, i) for stream, entries in batches for i, _f in entries if i is not None}

    async def _delivery_counts(self, stream: str, entries: list[Entry]) -> dict[bytes, int]:
        """Delivery counts of this consumer's pending `entries`, one XPENDING per id, pipelined."""
        ids = [entry_id for entry_id, fields in entries if entry_id is not None and fields]
        if not ids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xpending_range(
                    stream, self._group, min=entry_id, max=entry_id, count=1, consumername=self._consumer
                )
            replies = cast(list[list[dict[str, Any]]], await pipe.execute())
        return {r[0]["message_id"]: int(r[0]["times_delivered"]) for r in replies if r}


def _entry_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a pair that orders as Redis orders ids."""
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


@dataclass(slots=True)
class _Summary:
    """What a consumer's batches did since the last `bus.summary` line."""

    since: float
    batches: int = 0
    handled: int = 0
    dead: int = 0
    reclaimed: int = 0
    max_ms: float = 0.0

    def add(self, handled: int, dead: int, reclaimed: bool, ms: float, now: float) -> dict[str, Any] | None:
        """Count one batch; the summary line's fields once SUMMARY_S have passed (then reset)."""
        self.batches += 1
        self.handled += handled
        self.dead += dead
        self.reclaimed += reclaimed
        self.max_ms = max(self.max_ms, ms)
        if now - self.since < SUMMARY_S:
            return None
        line = {"seconds": round(now - self.since, 1), "batches": self.batches, "handled": self.handled,
                "dead": self.dead, "reclaimed": self.reclaimed, "max_ms": self.max_ms}
        self.since, self.batches, self.handled, self.dead, self.reclaimed, self.max_ms = now, 0, 0, 0, 0, 0.0
        return line
