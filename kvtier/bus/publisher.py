"""Appending events to Redis Streams, and the counters the bus keeps.

Wire form: each stream entry has one field, b"e", holding `codec.encode(Envelope)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from redis.typing import EncodableT, FieldT

from kvtier.bus.codec import NAME_RE, encode
from kvtier.bus.connect import AsyncRedis
from kvtier.core.events import Envelope, Event

FIELD = b"e"


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

    def _fields(self, event: Event) -> dict[FieldT, EncodableT]:
        self._seq += 1
        return {FIELD: encode(Envelope(event=event, producer=self._producer, epoch=self._epoch, seq=self._seq))}

    async def publish(self, stream: str, event: Event) -> bytes:
        entry_id = await self._redis.xadd(stream, self._fields(event), maxlen=self._maxlen, approximate=True)
        self.stats.published += 1
        return cast(bytes, entry_id)  # replies stay bytes: decode_responses=False (bus/connect.py)

    async def publish_many(self, items: Sequence[tuple[str, Event]]) -> list[bytes]:
        """All items in one round trip (a pipeline, not a transaction), in order."""
        if not items:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream, event in items:
                pipe.xadd(stream, self._fields(event), maxlen=self._maxlen, approximate=True)
            ids = cast(list[bytes], await pipe.execute())
        self.stats.published += len(ids)
        return ids
