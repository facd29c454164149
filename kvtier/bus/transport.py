"""Redis Streams transport: a Publisher, and a consumer-group Consumer with at-least-once delivery.

Wire form: each stream entry has one field, b"e", holding `codec.encode(Envelope)`.

Consumer guarantees (DESIGN.md "Bus", reliability.md §1):
- ack after the effect: a handled entry is XACKed only once its handler has returned;
- at start, re-read this consumer's own pending history (read from id 0 until empty, the
  documented restart procedure), then XAUTOCLAIM entries that other consumers left idle;
  XAUTOCLAIM runs again every `claim_idle_ms`, which also retries this consumer's failed entries;
- an entry that fails validation, or was delivered more than `max_deliveries` times, goes to the
  dead-letter stream with its reason and is then acked; a trimmed entry (nil payload) is acked;
- a lost group (NOGROUP: Redis restarted empty, stream deleted) is re-created with MKSTREAM;
- connection trouble backs off with jitter, capped at about 1 s; it never spins.
Handlers must be idempotent: delivery is at least once, never exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.backoff import EqualJitterBackoff
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError

from kvtier.bus.codec import NAME_RE, decode, encode
from kvtier.core.events import Envelope, Event
from kvtier.errors import MalformedEvent
from kvtier.failpoints import Failpoints

FIELD = b"e"
REASON_MAX_DELIVERIES = "max deliveries exceeded"
REASON_MISSING_FIELD = "missing field 'e'"
REASON_EXTRA_FIELDS = "entry has fields besides the payload"
CANCEL_FLUSH_TIMEOUT_S = 1.0  # bounded: a cancelled consumer must not hang on a dead Redis


@dataclass(slots=True)
class BusStats:
    """Counters of one Publisher/Consumer (or several sharing it). Mutated in place, one loop."""

    published: int = 0  # entries XADDed by a Publisher
    delivered: int = 0  # handler invocations
    acked: int = 0  # ids XACKed: handled, dead-lettered and nil entries
    dead_lettered: int = 0
    handler_errors: int = 0
    reclaimed: int = 0  # pending entries re-delivered by the history re-read or XAUTOCLAIM
    deleted_entries: int = 0  # pending ids whose payload was trimmed or deleted
    redis_errors: int = 0
    groups_created: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class Publisher:
    """Appends events to streams. Every envelope gets the next `seq` of this Publisher.

    A seq is used up even when its XADD fails (the entry may have landed anyway), so seqs are
    strictly increasing per (producer, epoch) but may have gaps. Errors reach the caller.
    """

    def __init__(
        self, redis: redis.asyncio.Redis, producer: str, epoch: int, maxlen: int, stats: BusStats | None = None
    ) -> None:
        if not NAME_RE.fullmatch(producer) or epoch < 0 or maxlen < 1:
            # Caught here, not by every consumer dead-lettering every event this producer sends.
            raise ValueError(f"bad producer {producer!r} (must match {NAME_RE.pattern}), epoch or maxlen")
        self._redis = redis
        self._producer = producer
        self._epoch = epoch
        self._maxlen = maxlen
        self._seq = 0
        self.stats = stats if stats is not None else BusStats()

    @property
    def last_seq(self) -> int:
        """The seq of the latest envelope built; 0 before the first."""
        return self._seq

    def _payload(self, event: Event) -> bytes:
        self._seq += 1
        return encode(Envelope(event=event, producer=self._producer, epoch=self._epoch, seq=self._seq))

    async def publish(self, stream: str, event: Event) -> bytes:
        fields = {FIELD: self._payload(event)}
        entry_id = await self._redis.xadd(stream, fields, maxlen=self._maxlen, approximate=True)
        self.stats.published += 1
        return entry_id

    async def publish_many(self, items: Sequence[tuple[str, Event]]) -> list[bytes]:
        """All items in one round trip (a pipeline, not a transaction), in order."""
        if not items:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, event in items:
                pipe.xadd(stream, {FIELD: self._payload(event)}, maxlen=self._maxlen, approximate=True)
            ids = await pipe.execute()
        self.stats.published += len(ids)
        return ids


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: bytes
    envelope: Envelope


Entry = tuple[bytes | None, dict[bytes, bytes] | None]
DeadLetter = tuple[str, bytes, str, bytes | None]  # stream, entry id, reason, raw payload


class Consumer:
    """One consumer of `group` over `streams`. `run()` until `stop()`; see the module docstring.

    `claim_idle_ms` must exceed the slowest handler: an entry idle that long is assumed abandoned
    and claimed. `block_ms` must stay below the client's socket_timeout, or the blocking read
    itself times out (reliability.md §0.5).
    """

    def __init__(
        self,
        redis: redis.asyncio.Redis,
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
        self._dlq = dlq
        self._read_count = read_count
        self._block_ms = block_ms
        self._claim_idle_ms = claim_idle_ms
        self._max_deliveries = max_deliveries
        self._dlq_maxlen = publisher_maxlen
        self.stats = stats
        self._log = log.bind(group=group, consumer=consumer)
        self._stopping = False
        self._running = False
        self._groups_seen = False

    def stop(self) -> None:
        """Ask `run()` to return once the current batch is handled and acked (within ~block_ms).

        Final: a stopped Consumer does not run again; build a new one.
        """
        self._stopping = True

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
                try:
                    if not recovered:
                        await self._ensure_groups()
                        await self._drain_history()
                        await self._autoclaim()
                        recovered = True
                        next_claim = time.monotonic() + self._claim_idle_ms / 1000
                    elif time.monotonic() >= next_claim:
                        await self._autoclaim()
                        next_claim = time.monotonic() + self._claim_idle_ms / 1000
                    else:
                        await self._read_new()
                    failures = 0
                    continue
                except ResponseError as e:
                    if not str(e).startswith("NOGROUP"):
                        self.stats.redis_errors += 1
                        self._log.error("bus.redis_error", error=str(e), exc_info=True)
                    else:
                        # The group (and its PEL) is gone; redo the whole start-up procedure.
                        self._log.warning("bus.nogroup", error=str(e))
                        recovered = False
                except (ConnectionError, TimeoutError) as e:
                    self.stats.redis_errors += 1
                    self._log.warning("bus.redis_unavailable", error=str(e), failures=failures + 1)
                except RedisError as e:
                    self.stats.redis_errors += 1
                    self._log.error("bus.redis_error", error=str(e), exc_info=True)
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
                reply = await self._redis.xreadgroup(
                    self._group, self._consumer, {stream: cursor}, count=self._read_count
                )
                entries = reply[0][1] if reply else []
                if not entries:
                    break
                cursor = entries[-1][0]
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
                cursor, entries = reply[0], reply[1]
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

    async def _read_new(self) -> None:
        reply = await self._redis.xreadgroup(
            self._group,
            self._consumer,
            {s: ">" for s in self._streams},
            count=self._read_count,
            block=self._block_ms,
        )
        if reply:
            batches = [(self._by_key.get(key, key.decode()), entries) for key, entries in reply]
            await self._handle(batches, counted=False)

    # --- one batch --------------------------------------------------------------------------

    async def _handle(self, batches: list[tuple[str, list[Entry]]], *, counted: bool) -> None:
        """Run the handler over a batch, then dead-letter and ack in as few round trips as possible.

        `counted`: entries were delivered before (history, claim), so look up their delivery
        counts; a fresh '>' read is delivery number 1.
        """
        t0 = time.monotonic()
        acks: dict[str, list[bytes]] = {}
        dead: list[DeadLetter] = []
        effects_done = self._after_batch is None  # with a hook, effects exist only once it ran
        failed: RedisError | None = None
        try:
            for stream, entries in batches:
                done = acks.setdefault(stream, [])
                counts = await self._delivery_counts(stream, entries) if counted else None
                for entry_id, fields in entries:
                    await self._handle_one(stream, entry_id, fields, counts, done, dead)
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
                    if isinstance(e, RedisError):
                        failed = e
        except asyncio.CancelledError:
            # Ack (shielded, bounded) only what has really taken effect, then keep cancelling.
            # Without the batch hook having run, handled entries stay pending and come back.
            if not effects_done:
                acks = {}
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.wait_for(self._flush(acks, dead), CANCEL_FLUSH_TIMEOUT_S))
            raise
        handled, dead_count = sum(map(len, acks.values())), len(dead)
        if handled:
            self._failpoints.reached("after_xadd")
        await self._flush(acks, dead)
        if failed is not None:
            # Redis refused the batch's outcomes (down, OOM, read-only): let run() back off
            # before reading more, rather than fail every new batch the same way at once.
            raise failed
        # The canonical line for one unit of work: a batch, with what it did and how long it took.
        self._log.info("bus.batch", streams=[b[0] for b in batches], handled=handled, dead=dead_count,
                       reclaimed=counted, ms=round((time.monotonic() - t0) * 1000, 2))

    async def _handle_one(
        self, stream: str, entry_id: bytes | None, fields: dict[bytes, bytes] | None,
        counts: dict[bytes, int] | None, done: list[bytes], dead: list[DeadLetter],
    ) -> None:  # fmt: skip
        if entry_id is None:  # Redis 6.2 XAUTOCLAIM reports a deleted entry as nil, id and all
            self.stats.deleted_entries += 1
            return
        if not fields:  # nil payload: trimmed (MAXLEN) or XDELed while pending
            self.stats.deleted_entries += 1
            self._log.debug("bus.deleted_entry", stream=stream, id=entry_id)
            done.append(entry_id)
            return
        raw = fields.get(FIELD)
        if counts is not None:
            n = counts.get(entry_id)
            if n is None:  # acked or claimed by someone else meanwhile: no longer ours
                return
            if n > self._max_deliveries:
                dead.append((stream, entry_id, REASON_MAX_DELIVERIES, raw))
                return
        if raw is None:
            dead.append((stream, entry_id, REASON_MISSING_FIELD, None))
            return
        if len(fields) != 1:  # kvtier writes exactly one field: anything else is not ours
            dead.append((stream, entry_id, REASON_EXTRA_FIELDS, raw))
            return
        try:
            envelope = decode(raw)
        except MalformedEvent as e:
            dead.append((stream, entry_id, e.reason, raw))
            return
        self.stats.delivered += 1
        self._log.debug("bus.deliver", stream=stream, id=entry_id, type=envelope.event.TYPE)
        try:
            await self._handler(Delivery(stream=stream, entry_id=entry_id, envelope=envelope))
        except MalformedEvent as e:
            # Well-formed on the wire but meaningless here (an unknown pool, say): retrying
            # cannot help, so dead-letter it now with the handler's reason.
            dead.append((stream, entry_id, e.reason, raw))
            return
        except Exception:
            # Left pending: XAUTOCLAIM hands it back after claim_idle_ms, up to max_deliveries.
            self.stats.handler_errors += 1
            self._log.error("bus.handler_error", stream=stream, id=entry_id, exc_info=True)
            return
        done.append(entry_id)

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
            replies = await pipe.execute()
        return {r[0]["message_id"]: int(r[0]["times_delivered"]) for r in replies if r}

    async def _flush(self, acks: dict[str, list[bytes]], dead: list[DeadLetter]) -> None:
        if dead:
            try:
                await self._dead_letter(dead, acks)
            except Exception:
                await self._ack(acks)  # handled entries need not wait for the dlq to recover
                raise
        await self._ack(acks)

    async def _dead_letter(self, dead: list[DeadLetter], acks: dict[str, list[bytes]]) -> None:
        # Written before, and apart from, the XACKs: a pipeline runs every command even when one
        # fails, so a failed dlq XADD followed by its XACK would lose the entry.
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, entry_id, reason, raw in dead:
                fields = {b"stream": stream, b"id": entry_id, b"reason": reason}
                if raw is not None:
                    fields[FIELD] = raw
                pipe.xadd(self._dlq, fields, maxlen=self._dlq_maxlen, approximate=True)
            await pipe.execute()
        for stream, entry_id, reason, _ in dead:
            self._log.warning("bus.dead_letter", stream=stream, id=entry_id, reason=reason)
            acks.setdefault(stream, []).append(entry_id)
        self.stats.dead_lettered += len(dead)

    async def _ack(self, acks: dict[str, list[bytes]]) -> None:
        todo = {stream: ids for stream, ids in acks.items() if ids}
        if not todo:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, ids in todo.items():
                pipe.xack(stream, self._group, *ids)
            await pipe.execute()
        self.stats.acked += sum(map(len, todo.values()))
