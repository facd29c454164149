"""One batch a Consumer read (bus/consumer.py): its entries triaged and handed to the handler,
the batch hook run, then dead letters and acks written in as few round trips as possible.

An entry is acked only once its effect is done: with an `after_batch` hook, once the hook has
published what the batch produced. Deliveries that ended in a Redis outage are remembered
(bus/outages.py) so that they do not count towards `max_deliveries`. A cancelled batch acks,
shielded and bounded, only what has really taken effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from redis.exceptions import ResponseError

from kvtier.bus.connect import AsyncRedis
from kvtier.bus.deadletter import DeadLetter, Entry, Rejected, Settler, triage
from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.bus.outages import OutageLedger
from kvtier.bus.publisher import FIELD, BusStats
from kvtier.core.events import Envelope
from kvtier.errors import MalformedEvent
from kvtier.failpoints import Failpoints

CANCEL_FLUSH_TIMEOUT_S = 1.0  # bounded: a cancelled consumer must not hang on a dead Redis
SUMMARY_S = 60.0  # one `bus.summary` line (info) per consumer per this many seconds of work

Batch = list[tuple[str, list[Entry]]]  # (stream, entries) pairs, as read


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: bytes
    envelope: Envelope


class BatchHandler:
    """A Consumer's handling of the batches it reads; `outages` is its ledger of lost deliveries."""

    def __init__(
        self,
        redis: AsyncRedis,
        group: str,
        consumer: str,
        handler: Callable[[Delivery], Awaitable[None]],
        after_batch: Callable[[], Awaitable[None]] | None,
        settler: Settler,
        *,
        max_deliveries: int,
        stats: BusStats,
        log: Any,
        failpoints: Failpoints,
    ) -> None:
        self._redis = redis
        self._group = group
        self._consumer = consumer
        self._handler = handler
        # Called once per batch, after the handler has seen every entry and before any is acked:
        # lets a handler buffer its own output (commands, facts) and publish it in one round trip.
        self._after_batch = after_batch
        self._settler = settler
        self._max_deliveries = max_deliveries
        self.stats = stats
        self._log = log
        self._failpoints = failpoints
        self._summary = _Summary(time.monotonic())
        self.outages = OutageLedger()
        # Acks held back to go out with the consumer's next read (`ack_then_read`): one round
        # trip a batch, not two. Sent on their own before anything else (`settle_held`).
        self._held: dict[str, list[bytes]] = {}
        self._credited: set[tuple[str, bytes]] = set()  # held ones the outage ledger has credited

    async def handle(self, batches: Batch, *, counted: bool, hold_acks: bool = False) -> None:
        """Run the handler over a batch, then dead-letter and ack in as few round trips as possible.

        `counted`: entries were delivered before (history, claim), so look up their delivery
        counts; a fresh '>' read is delivery number 1. `hold_acks`: a batch with no dead letter
        keeps its acks (its effects done) for the caller's next read, `ack_then_read`.
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
        held = hold_acks and not dead  # dead letters go first, then their acks: not held
        if held:
            self._hold(acks)
        else:
            try:
                await self._settler.flush(acks, dead)
            except REDIS_ERRORS as e:
                if is_outage(e):  # nothing was settled
                    self.outages.record(lost | self._ids(batches), {}, [])
                raise
        # Once per delivery; acked and dead-lettered ones are settled (held ones when their ack lands).
        self.outages.record(lost, {} if held else acks, dead)
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

    async def ack_then_read(self, read: Callable[[Any], Any]) -> Any:
        """The held acks and then `read` (it queues one command on the pipeline it is given) in
        one round trip; the read's reply. Redis runs the XACKs first, as if sent on their own.
        Acks that may not have landed are held again (an XACK is idempotent); one Redis refused
        is logged and left pending, for a claim. Not for a cluster client: there the acks go on
        their own (`settle_held`), as its pipelines hand a read's connection errors back as
        replies, past the client's own reconnects and slot-map reloads."""
        acks, self._held = self._held, {}
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for stream, ids in acks.items():
                    pipe.xack(stream, self._group, *ids)
                read(pipe)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as e:
            self._not_settled(acks, e)
            raise
        landed = {}
        for (stream, ids), reply in zip(acks.items(), replies):
            if isinstance(reply, Exception):
                self._not_settled({stream: ids}, reply, raised=False)
            else:
                landed[stream] = ids
        self._settled(landed)
        if isinstance(replies[-1], Exception):
            raise replies[-1]
        return replies[-1]

    async def settle_held(self) -> None:
        """Send the held acks on their own: before a periodic claim, when the consumer stops,
        and before each read on a cluster client."""
        if not self._held:
            return
        acks, self._held = self._held, {}
        try:
            await self._settler.flush(acks, [])
        except BaseException as e:
            self._not_settled(acks, e)
            raise
        self._settled(acks, counted=True)  # Settler._ack counted them

    @property
    def holding(self) -> int:
        """How many acks are held."""
        return sum(map(len, self._held.values()))

    def _hold(self, acks: dict[str, list[bytes]]) -> None:
        for stream, ids in acks.items():
            if ids:
                self._held.setdefault(stream, []).extend(ids)

    def _settled(self, acks: dict[str, list[bytes]], counted: bool = False) -> None:
        if not counted:
            self.stats.acked += sum(map(len, acks.values()))
        self.outages.record(set(), acks, [])
        self._credited.difference_update((s, i) for s, ids in acks.items() for i in ids)

    def _not_settled(self, acks: dict[str, list[bytes]], e: BaseException, raised: bool = True) -> None:
        """Acks that failed. Held again unless Redis refused them (a ResponseError: their entries
        stay pending, for a claim, as a failed XACK always left them): whatever else failed, they
        may not have landed. An outage's deliveries are credited in the outage ledger, once per
        delivery however often the held acks fail. A raised error is the caller's to count."""
        ids = {(s, i) for s, batch in acks.items() for i in batch}
        if isinstance(e, ResponseError):
            self._credited.difference_update(ids)
            if not raised:
                self.stats.redis_errors += 1
            self._log.error("bus.ack_refused", error=str(e), entries=len(ids))
            return
        self._hold(acks)
        if is_outage(e):
            self.outages.record(ids - self._credited, {}, [])
            self._credited.update(ids)

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
        meaningless: str | None = None
        failed = False
        for i, envelope in enumerate(verdict):
            self.stats.delivered += 1
            self._log.debug("bus.deliver", stream=stream, id=entry_id, type=envelope.event.TYPE)
            try:
                await self._handler(Delivery(stream=stream, entry_id=entry_id, envelope=envelope))
            except MalformedEvent as e:
                # Well-formed on the wire but meaningless here (an unknown pool, say): retrying
                # cannot help, so dead-letter it now with the handler's reason. The rest of a
                # packed entry is still handled: its producer sent them together, not as one.
                meaningless = meaningless or (e.reason if len(verdict) == 1 else f"packed event {i}: {e.reason}")
            except Exception as e:
                # Left pending: XAUTOCLAIM hands it back after claim_idle_ms, up to max_deliveries.
                # The events of a packed entry handled already are skipped then (bus/dedup.py).
                if is_outage(e):
                    lost.add((stream, entry_id))
                self.stats.handler_errors += 1
                self._log.error("bus.handler_error", stream=stream, id=entry_id, exc_info=True)
                failed = True
        if failed:
            return
        if meaningless is not None:
            dead.append((stream, entry_id, meaningless, fields.get(FIELD)))
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
