"""Re-replication: local blocks that Redis has lost, found by a bounded sweep and written again.

Redis can lose a block this node still holds: a restart without persistence, a failover that
lost writes, or its own eviction. A cpu arena re-attached warm may also face a new, empty
Redis. Nothing else writes such a block again (a put of a block the node holds stores nothing),
so other nodes would never see it. Each round the daemon asks Redis about the next `n` local
blocks (round robin over the gpu and cpu tiers) and, by what it answers:
- a block Redis holds is recorded as held there (after a warm restart nothing was);
- a block Redis lacks is no longer believed to be there, so shedding writes it back rather than
  dropping it as clean; under write-through it is copied again at once (the frequency filter,
  `redis_admit_after_hits`, still applies).
A round costs one pipelined EXISTS of `n` keys, so the rate is bounded by `n` per interval.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.core.events import Copy, Tier
from kvtier.core.knobs import RedisWrite
from kvtier.core.policy import Placement
from kvtier.core.residency import NODE
from kvtier.keys import BlockKey


class RedisRecord(Protocol):
    """Where the answers are recorded: the Placement itself, or the daemon's PoolRuntime, which
    also keeps the clients' directory flag in step."""

    def in_redis(self, key: BlockKey, parent: BlockKey | None) -> object: ...
    def not_in_redis(self, key: BlockKey) -> None: ...


class ResyncSweep:
    def __init__(self, placement: Placement, record: RedisRecord | None = None) -> None:
        self._p = placement
        self._record: RedisRecord = placement if record is None else record
        self._next = 0  # where the next round starts, in the order of `_local()`

    def _local(self) -> list[BlockKey]:
        return list(dict.fromkeys(e.key for t in NODE for e in self._p.tiers[t].ready()))

    def next_keys(self, n: int) -> list[BlockKey]:
        """The next `n` local blocks to check (fewer when the node holds fewer)."""
        local = self._local()
        if not local:
            return []
        start = self._next % len(local)
        batch = [local[(start + i) % len(local)] for i in range(min(n, len(local)))]
        self._next = start + len(batch)
        return batch

    def answered(self, held: dict[BlockKey, bool]) -> list[Copy]:
        """Redis's answer for each key checked: record it, and the copies it calls for."""
        p = self._p
        through = p.knobs.redis_write is RedisWrite.WRITE_THROUGH
        out: list[Copy] = []
        for key, there in held.items():
            found = p.ready_in(key)
            if found is None:
                continue  # gone from the node meanwhile: nothing to keep in step
            src, entry = found
            if there:
                self._record.in_redis(key, entry.parent)
                continue
            self._record.not_in_redis(key)
            if through and p.reused(key):  # the frequency filter still applies
                out.append(Copy(p.pool, key, entry.parent, src, Tier.REDIS))
        return out
