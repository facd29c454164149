"""What becomes of a consumed stream entry besides its handler: triage, dead letters, acks.

An entry that fails validation, or was delivered more than `max_deliveries` times, goes to the
dead-letter stream with its reason and is then acked; a trimmed entry (nil payload) is acked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.typing import EncodableT, FieldT

from kvtier.bus.codec import decode_entry
from kvtier.bus.connect import AsyncRedis
from kvtier.bus.publisher import FIELD, BusStats
from kvtier.core.events import Envelope
from kvtier.errors import MalformedEvent

REASON_MAX_DELIVERIES = "max deliveries exceeded"
REASON_MISSING_FIELD = "missing field 'e'"
REASON_EXTRA_FIELDS = "entry has fields besides the payload"

Entry = tuple[bytes | None, dict[bytes, bytes] | None]  # (id, fields) as XREADGROUP/XAUTOCLAIM give it
DeadLetter = tuple[str, bytes, str, bytes | None]  # stream, entry id, reason, raw payload


@dataclass(frozen=True, slots=True)
class Rejected:
    """An entry that goes to the dead-letter stream rather than to the handler."""

    reason: str
    raw: bytes | None


def triage(fields: dict[bytes, bytes], delivered: int | None, max_deliveries: int) -> list[Envelope] | Rejected:
    """The envelopes to hand to the handler (one, or a packed entry's), or why the entry is
    dead-lettered instead.

    `delivered`: the entry's delivery count when it was delivered before (None: a fresh read).
    """
    raw = fields.get(FIELD)
    if delivered is not None and delivered > max_deliveries:
        return Rejected(REASON_MAX_DELIVERIES, raw)
    if raw is None:
        return Rejected(REASON_MISSING_FIELD, None)
    if len(fields) != 1:  # kvtier writes exactly one field: anything else is not ours
        return Rejected(REASON_EXTRA_FIELDS, raw)
    try:
        return decode_entry(raw)
    except MalformedEvent as e:
        return Rejected(e.reason, raw)


class Settler:
    """Writes one consumer's batch outcomes: dead letters first, then the XACKs."""

    def __init__(self, redis: AsyncRedis, group: str, dlq: str, dlq_maxlen: int, stats: BusStats,
                 log: Any) -> None:
        self._redis = redis
        self._group = group
        self._dlq = dlq
        self._dlq_maxlen = dlq_maxlen
        self._stats = stats
        self._log = log

    async def flush(self, acks: dict[str, list[bytes]], dead: list[DeadLetter]) -> None:
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
                fields: dict[FieldT, EncodableT] = {b"stream": stream, b"id": entry_id, b"reason": reason}
                if raw is not None:
                    fields[FIELD] = raw
                pipe.xadd(self._dlq, fields, maxlen=self._dlq_maxlen, approximate=True)
            await pipe.execute()
        for stream, entry_id, reason, _ in dead:
            self._log.warning("bus.dead_letter", stream=stream, id=entry_id, reason=reason)
            acks.setdefault(stream, []).append(entry_id)
        self._stats.dead_lettered += len(dead)

    async def _ack(self, acks: dict[str, list[bytes]]) -> None:
        todo = {stream: ids for stream, ids in acks.items() if ids}
        if not todo:
            return
        if len(todo) == 1:  # most batches; one XACK cost 111-128 us of CPU here, a pipeline of one 154
            ((stream, ids),) = todo.items()
            await self._redis.xack(stream, self._group, *ids)
        else:
            async with self._redis.pipeline(transaction=False) as pipe:
                for stream, ids in todo.items():
                    pipe.xack(stream, self._group, *ids)
                await pipe.execute()
        self._stats.acked += sum(map(len, todo.values()))
