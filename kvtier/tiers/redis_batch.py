"""The Redis I/O of one tier worker's batch: queued while its commands are handled, sent at the end.

SETs (stores and write-backs into Redis) go out in one pipeline per pool, GETs (promotes from
Redis) in another; the worker turns each outcome into the command's fact. A block is queued at
most once per batch: the worker runs the batch so far before a second command for the same
block, so commands for one block still apply in order.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from kvtier.bus.failures import REDIS_ERRORS
from kvtier.core.events import Copy, Demote, Promote, Retain, Store
from kvtier.failpoints import Failpoints
from kvtier.keys import BlockKey
from kvtier.logs import Log
from kvtier.tiers.pool import PoolRuntime

Got = tuple[np.ndarray, int] | None | Exception  # a GET's outcome: (payload, checksum), a miss, an error


@dataclass(slots=True)
class QueuedSet:
    rt: PoolRuntime
    ev: Store | Promote | Demote | Copy
    value: memoryview  # header + payload, ready to SET
    t0: float  # when the command was received


@dataclass(slots=True)
class QueuedGet:
    rt: PoolRuntime
    ev: Promote | Demote | Copy
    t0: float


Wrote = list[tuple[QueuedSet, Exception | None]]  # each SET with its error, or None
Read = list[tuple[QueuedGet, Got]]


class RedisBatch:
    def __init__(self, failpoints: Failpoints) -> None:
        self.failpoints = failpoints
        self._sets: list[QueuedSet] = []
        self._gets: list[QueuedGet] = []
        self._blocks: set[tuple[str, BlockKey]] = set()
        self.nbytes = 0  # payload bytes queued

    def __len__(self) -> int:  # blocks queued in this batch
        return len(self._blocks)

    def __contains__(self, block: tuple[str, BlockKey]) -> bool:
        """Whether (pool, key) is queued in this batch."""
        return block in self._blocks

    def set(self, q: QueuedSet) -> None:
        self._sets.append(q)
        self._blocks.add((q.rt.name, q.ev.key))
        self.nbytes += len(q.value)

    def get(self, q: QueuedGet) -> None:
        self._gets.append(q)
        self._blocks.add((q.rt.name, q.ev.key))
        self.nbytes += q.rt.layout.block_bytes

    def take(self) -> tuple[list[QueuedSet], list[QueuedGet]]:
        """Empty the queue (so that a failed batch leaves nothing behind: its commands are
        redelivered and queue their I/O again); `send` what it held."""
        sets, self._sets = self._sets, []
        gets, self._gets = self._gets, []
        self._blocks.clear()
        self.nbytes = 0
        return sets, gets

    async def send(self, sets: list[QueuedSet], gets: list[QueuedGet]) -> tuple[Wrote, Read]:
        """The SETs, then the GETs, one pipeline per pool each: every operation with its outcome,
        in queue order. A failed SET or GET is its error (on a cluster, a master that is down fails
        only the keys it serves)."""
        wrote: Wrote = []
        for rt, group in _by_pool(sets):
            put = asyncio.ensure_future(rt.redis.put_many([(q.ev.key, q.value) for q in group]))
            if self.failpoints.armed("redis_write"):
                await asyncio.sleep(0)  # let the pipeline start sending, then die mid-write
                self.failpoints.reached("redis_write")
            wrote.extend(zip(group, await put))
        read: Read = []
        for rt, reads in _by_pool(gets):
            read.extend(zip(reads, await rt.redis.get_many([q.ev.key for q in reads])))
        return wrote, read


class _Queued(Protocol):
    @property
    def rt(self) -> PoolRuntime: ...


Q = TypeVar("Q", bound=_Queued)


def _by_pool(items: list[Q]) -> list[tuple[PoolRuntime, list[Q]]]:
    """Group queued operations by pool, keeping their order within each pool."""
    groups: dict[str, tuple[PoolRuntime, list[Q]]] = {}
    for item in items:
        groups.setdefault(item.rt.name, (item.rt, []))[1].append(item)
    return list(groups.values())


async def retain(rt: PoolRuntime, ev: Retain, log: Log) -> None:
    """A session pin's Redis side: lengthen the copies' time to live (never shorten it). A
    failure is counted and logged: the pin still holds on the node, the Redis copy may expire."""
    if ev.ttl_s <= 0 or not ev.keys:
        return
    try:
        errors = [e for e in await rt.redis.retain(ev.keys, ev.ttl_s) if e is not None]
    except REDIS_ERRORS as e:  # the whole ask failed (Redis down): every key of it
        errors = [e] * len(ev.keys)
    rt.counters.pins_retained += len(ev.keys) - len(errors)
    if errors:
        rt.counters.pin_retain_errors += len(errors)
        log.warning("redis.retain_failed", pool=rt.name, keys=len(ev.keys), failed=len(errors),
                    error=f"{type(errors[0]).__name__}: {errors[0]}")
