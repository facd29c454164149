"""Appending events to Redis Streams, and the counters the bus keeps.

Wire form: each stream entry has one field, b"e", holding `codec.encode(Envelope)`, or, for
the events `publish_many` sends to one stream, `codec.encode_packed` of them: a batch of a
hundred commands or facts is one entry, not a hundred (one XADD, one decode, one XACK).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from redis.typing import EncodableT, FieldT

from kvtier.bus.codec import MAX_ENTRY_BYTES, MAX_PACKED, NAME_RE, encode, encode_packed
from kvtier.bus.connect import AsyncRedis
from kvtier.core.events import Envelope, Event

FIELD = b"e"
PACK_EVENTS = MAX_PACKED
PACK_BYTES = MAX_ENTRY_BYTES // 4  # well inside what a consumer accepts


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
        self, redis: AsyncRedis, producer: str, epoch: int, maxlen: int, stats: BusStats | None = None
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

    def stamp(self) -> tuple[int, int]:
        """A fresh (epoch, seq) that no entry will carry: for work applied in-process, so that a
        command fence (kvtier/core/fence.py) orders it after every entry published before."""
        self._seq += 1
        return self._epoch, self._seq

    async def publish(self, stream: str, event: Event) -> bytes:
        return await self.publish_prepared(stream, self.prepare(event))

    def prepare(self, event: Event) -> dict[FieldT, EncodableT]:
        """`event` encoded now, under its seq, for `publish_prepared` (a put encodes its event
        while its blocks are copied). A seq prepared and never published is a gap, as a failed
        XADD's is."""
        self._seq += 1
        return {FIELD: encode(Envelope(event=event, producer=self._producer, epoch=self._epoch, seq=self._seq))}

    async def publish_prepared(self, stream: str, fields: dict[FieldT, EncodableT]) -> bytes:
        entry_id = await self._redis.xadd(stream, fields, maxlen=self._maxlen, approximate=True)
        self.stats.published += 1
        return cast(bytes, entry_id)  # replies stay bytes: decode_responses=False (bus/connect.py)

    async def publish_many(self, items: Sequence[tuple[str, Event]]) -> None:
        """All items in one round trip (a pipeline, not a transaction). The events for one stream
        go in packed entries, in order (PACK_EVENTS, PACK_BYTES a piece); streams are written in
        the order they first appear."""
        if not items:
            return
        by_stream: dict[str, list[Envelope]] = {}
        for stream, event in items:
            self._seq += 1
            by_stream.setdefault(stream, []).append(
                Envelope(event=event, producer=self._producer, epoch=self._epoch, seq=self._seq))
        entries = 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, envs in by_stream.items():
                for payload in _packs(envs):
                    pipe.xadd(stream, {FIELD: payload}, maxlen=self._maxlen, approximate=True)
                    entries += 1
            await pipe.execute()
        self.stats.published += entries


def _packs(envs: list[Envelope]) -> list[bytes]:
    """One stream's envelopes as entry payloads: a lone event as a plain entry, more as packed
    entries of at most PACK_EVENTS events and about PACK_BYTES each."""
    if len(envs) == 1:
        return [encode(envs[0])]
    out: list[bytes] = []
    i = 0
    while i < len(envs):
        n = min(PACK_EVENTS, len(envs) - i)
        payload = encode_packed(envs[i:i + n])
        while len(payload) > PACK_BYTES and n > 1:  # rare: events that carry token ids
            n //= 2
            payload = encode_packed(envs[i:i + n])
        out.append(payload)
        i += n
    return out
