"""Write-through (`redis_write = "write-through"`): the Redis copies that facts and reads call for.

A copy names the local tier it reads from, but that tier may shed the block (gpu demotes it to
cpu) before the redis worker gets to it: the copy then fails with SOURCE_MISS, and without a
retry a block that stays in cpu would never reach Redis, leaving a hole in its chain for every
other node. So a copy that missed its source is redone from the local tier that holds the block
now. Only that failure is retried: a Redis error would fail again at once while Redis is down,
and such a block is written back anyway when the cpu tier sheds it.
"""

from __future__ import annotations

from kvtier.core.events import Cause, Copy, Failure, Removed, Stored, Tier
from kvtier.core.index import Entry
from kvtier.core.knobs import PolicyKnobs, RedisWrite
from kvtier.core.residency import LOCAL, Residency
from kvtier.keys import BlockKey


def copy_for_fact(res: Residency, knobs: PolicyKnobs, pool: str, fact: Stored | Removed) -> Copy | None:
    """The Redis copy `fact` calls for, if any: a block a client just stored locally (unless the
    frequency filter waits for reads), or a copy that found its source gone, from wherever the
    block is now."""
    if knobs.redis_write is not RedisWrite.WRITE_THROUGH or fact.key in res.tiers[Tier.REDIS]:
        return None
    if isinstance(fact, Stored):
        if fact.tier in LOCAL and fact.cause == Cause.STORE and not knobs.redis_admit_after_hits:
            return Copy(pool, fact.key, fact.parent, fact.tier, Tier.REDIS)
        return None
    if fact.tier == Tier.REDIS and fact.cause == Cause.COPY and fact.why == Failure.SOURCE_MISS:
        if (found := res.ready_in(fact.key)) is not None:
            src, e = found
            return Copy(pool, fact.key, e.parent, src, Tier.REDIS)
    return None


def copy_on_read_on(knobs: PolicyKnobs) -> bool:
    """Whether copy_on_read can copy anything with these knobs."""
    return knobs.redis_write is RedisWrite.WRITE_THROUGH and bool(knobs.redis_admit_after_hits)


def copy_on_read(res: Residency, knobs: PolicyKnobs, pool: str, key: BlockKey, gpu: Entry | None,
                 cpu: Entry | None) -> Copy | None:
    """With the frequency filter (`redis_admit_after_hits` = N), a block is copied on its N-th read."""
    e = gpu or cpu
    if (e is None or not copy_on_read_on(knobs) or e.hits != knobs.redis_admit_after_hits
            or key in res.tiers[Tier.REDIS]):
        return None
    return Copy(pool, key, e.parent, Tier.GPU if gpu is not None else Tier.CPU, Tier.REDIS)
