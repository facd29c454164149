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

from kvtier.core.events import Copy, Tier
from kvtier.core.index import State
from kvtier.core.knobs import PolicyKnobs, RedisWrite
from kvtier.core.residency import LOCAL, Residency
from kvtier.keys import BlockKey


class ResyncSweep:
    def __init__(self, res: Residency, knobs: PolicyKnobs, pool: str) -> None:
        self._res = res
        self._knobs = knobs
        self._pool = pool
        self._next = 0  # where the next round starts, in the order of `_local()`

    def _local(self) -> list[BlockKey]:
        seen = dict.fromkeys(e.key for t in LOCAL for e in self._res.tiers[t].ready())
        return list(seen)

    def next_keys(self, n: int) -> list[BlockKey]:
        """The next `n` local blocks to check (fewer when the node holds fewer)."""
        local = self._local()
        if not local:
            return []
        start = self._next % len(local)
        batch = (local[start:] + local[:start])[:n]
        self._next = start + len(batch)
        return batch

    def answered(self, held: dict[BlockKey, bool]) -> list[Copy]:
        """Redis's answer for each key checked: record it, and the copies it calls for."""
        res, knobs = self._res, self._knobs
        out: list[Copy] = []
        for key, there in held.items():
            src = next((t for t in LOCAL if (e := res.tiers[t].get(key)) is not None and e.state is State.READY),
                       None)
            if src is None:
                continue  # gone from the node meanwhile: nothing to keep in step
            entry = res.tiers[src].get(key)
            assert entry is not None
            if there:
                res.in_redis(key, entry.parent)
                continue
            res.not_in_redis(key)
            n = knobs.redis_admit_after_hits
            reused = not n or any((e := res.tiers[t].get(key)) is not None and e.hits >= n for t in LOCAL)
            if knobs.redis_write is RedisWrite.WRITE_THROUGH and reused:
                out.append(Copy(self._pool, key, entry.parent, src, Tier.REDIS))
        return out
