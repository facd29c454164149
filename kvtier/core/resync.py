"""Re-replication: local blocks that Redis has lost, found by a bounded sweep and written again.

Redis can lose a block this node still holds: a restart without persistence, a failover that
lost writes, or its own eviction. A cpu arena re-attached warm may also face a new, empty
Redis. Nothing else writes such a block again (a put of a block the node holds stores nothing),
so other nodes would never see it. Each round the daemon asks Redis about the next `n` local
blocks (round robin over the slots of the gpu, cpu and disk tiers) and, by what it answers:
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


# A round of n keys looks at no more than this many slots a key (SCAN_PER_KEY x n in all): its
# cost bounded by n, and a sparse node still covered in (its slots / (SCAN_PER_KEY x n)) rounds.
SCAN_PER_KEY = 64
STRETCH = 256  # the fewest slots one look takes: a round needing few more keys still moves on in strides


class ResyncSweep:
    """Round robin over the node's local slots (the gpu, cpu and disk tiers' laid end to end),
    from where the last round stopped. A round of `n` keys looks at no more than SCAN_PER_KEY x n
    slots, so its cost is bounded by `n`, never by the node's size: a walk of every block each
    round held the daemon's loop for 0.8 s at a million blocks (docs/performance.md, "Sixteenth
    stop"). A pass covers a full node in (its blocks / n) rounds, a sparse one in (its slots /
    (SCAN_PER_KEY x n)); a block held in two tiers is checked once a round, and once for each
    tier a pass."""

    def __init__(self, placement: Placement, record: RedisRecord | None = None) -> None:
        self._p = placement
        self._record: RedisRecord = placement if record is None else record
        self._next = 0  # the slot the next round starts at, counted across the local tiers

    def next_keys(self, n: int) -> list[BlockKey]:
        """The next `n` local blocks to check: fewer when the node holds fewer, or when the
        slots a round may look at hold fewer (a sparse node: the next round goes on from there)."""
        tiers = [self._p.tiers[t] for t in NODE]
        total = sum(idx.slots or 0 for idx in tiers)
        if n <= 0 or not total:
            return []
        out: dict[BlockKey, None] = {}  # a block in two tiers is checked once
        pos = self._next % total
        left = min(total, SCAN_PER_KEY * n)  # slots this round may still look at
        while left > 0 and len(out) < n:
            base = 0
            for idx in tiers:  # the tier holding slot `pos` (of the concatenation)
                size = idx.slots or 0
                if pos < base + size:
                    break
                base += size
            # A stretch of no more slots than keys still wanted: a full node's round looks at n
            # slots, not at all it may (the list of a stretch is built whole).
            end = min(base + size, pos + left, pos + max(n - len(out), STRETCH))
            for slot, key in idx.ready_in_slots(pos - base, end - base):
                out[key] = None
                if len(out) == n:
                    end = base + slot + 1
                    break
            left -= end - pos
            pos = end % total
        self._next = pos
        return list(out)

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
