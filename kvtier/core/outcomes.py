"""What a tier worker reports for a command it carried out, pure: the rules, not the I/O.

The worker (kvtier/tiers/worker.py) reads a block (from client staging, a local slot or Redis),
writes it (into a slot, or as a SET), or drops one, and hands what it found to these functions.
They decide the `Outcome`: the fact it publishes, the counter it adds one to, whether a client's
put is lost, and what the pool now knows about Redis's copy. The worker then applies it
(kvtier/tiers/facts.py); the Hypothesis state machine (tests/unit/test_policy_state.py) applies
the same outcomes to its model, so it checks the rules production runs.

The rules:
- A store or transfer of a block its tier holds already reports it stored and moves nothing (a
  duplicate delivery, or the block came another way first): `held`.
- A read that did not verify fails the command: a store whose staging slot could not be read
  (BAD_STAGING) or whose bytes changed or failed their checksum (VERIFY); a transfer whose source
  no longer holds a valid copy (SOURCE_MISS); a read from Redis that met an error (REDIS): `read`.
- A local write with no room fails (NO_ROOM); a SET that met an error fails (REDIS): `written`,
  `sent`.
- Every failed store loses the client's put (`dropped`); a failed transfer loses nothing, since
  its source keeps its copy.
- A block written to Redis, or read back from there, is held there: the pool records it, so a
  local tier may later drop it without writing it back. A block Redis turned out not to hold
  (a promote found nothing) or that was dropped from Redis is no longer believed to be there.
- An evict that dropped its block reports it removed with its reason; one that found the block
  gone reports nothing, one for a block no longer leaving counts as stale, a refusal counts as
  refused (kvtier/core/eviction.py gives the verdicts): `evicted`, `kept`. Before the last
  local copy goes, Redis is asked whether it still holds the block: an error means no, and a no
  ends the pool's belief that it does (`asked_redis`).
No I/O, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType

from kvtier.core.events import Cause, Copy, Demote, Failure, Promote, Reason, Removed, Store, Stored, Tier
from kvtier.core.eviction import REFUSED, Verdict
from kvtier.core.index import Entry
from kvtier.core.residency import Residency
from kvtier.keys import BlockKey

Received = Store | Promote | Demote | Copy  # a command that brings a block into a tier
Fact = Stored | Removed


class Count(enum.StrEnum):
    """The per-tier counter an outcome adds one to (a field of kvtier/tiers/stats.py TierCounters)."""

    STORED = "stored"  # a client's block admitted
    PROMOTED_IN = "promoted_in"
    DEMOTED_IN = "demoted_in"
    COPIED_IN = "copied_in"
    FAILED = "failed"  # a store or transfer into the tier that did not complete
    EVICTED = "evicted"
    REFUSED = "refused"  # an eviction refused
    STALE = "stale"  # an eviction no longer chosen: a late command


MOVED_IN = frozenset({Count.STORED, Count.PROMOTED_IN, Count.DEMOTED_IN, Count.COPIED_IN})  # a block's bytes came in
_CAUSE_OF = MappingProxyType({c.value: c for c in Cause})  # a command's TYPE -> its Cause (Cause(...) is slow)
_MOVED_BY = {Cause.STORE: Count.STORED, Cause.PROMOTE: Count.PROMOTED_IN, Cause.DEMOTE: Count.DEMOTED_IN,
             Cause.COPY: Count.COPIED_IN}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one command comes to; the tier worker applies it (kvtier/tiers/facts.py `settle`)."""

    fact: Fact | None  # what the worker publishes; None: nothing to report
    count: Count | None = None  # the tier's counter it adds one to
    in_redis: bool | None = None  # Redis holds the block now (True: record it; False: forget it); None: no news
    dropped: bool = False  # a client's put is lost with it

    @property
    def redis_error(self) -> bool:
        """Whether Redis failed the command (counted as a Redis error too)."""
        return isinstance(self.fact, Removed) and self.fact.why is Failure.REDIS


def stored(ev: Received, tier: Tier, slot: int) -> Outcome:
    """`ev` completed: its block is in `tier` at `slot` (-1 in Redis). Written to Redis, or read
    back from there, the block is held in Redis."""
    cause = _CAUSE_OF[ev.TYPE]
    in_redis = tier is Tier.REDIS or (not isinstance(ev, Store) and ev.src is Tier.REDIS)
    return Outcome(Stored(ev.pool, ev.key, ev.parent, tier, slot, cause), _MOVED_BY[cause], in_redis or None)


def failed(ev: Received, tier: Tier, why: Failure) -> Outcome:
    """`ev` did not complete, for `why`. A store's failure loses the client's put; a promote that
    found no valid copy in Redis means Redis no longer holds the block."""
    gone = not isinstance(ev, Store) and ev.src is Tier.REDIS and why is Failure.SOURCE_MISS
    return Outcome(Removed(ev.pool, ev.key, tier, _CAUSE_OF[ev.TYPE], why), Count.FAILED, False if gone else None,
                   dropped=isinstance(ev, Store))


def held(res: Residency, ev: Received, tier: Tier) -> Outcome | None:
    """`tier` holds `ev`'s block already: reported stored, at the slot it has there, and nothing
    moved (a duplicate delivery, another client's put, or a promote racing a put). For a store
    into Redis the pool's record of Redis counts; a transfer into Redis is written anyway (the
    record may be stale, and the transfer is what makes it true). None when the block is not there."""
    if tier is Tier.REDIS and not isinstance(ev, Store):
        return None
    e = res.tiers[tier].get(ev.key)
    if e is None:
        return None
    return Outcome(Stored(ev.pool, ev.key, ev.parent, tier, e.slot, _CAUSE_OF[ev.TYPE]))


def read(ev: Received, tier: Tier, got: object) -> Outcome | None:
    """The block `ev` reads, as the worker got it: its verified checksum (or payload), None (not
    there, changed or corrupt) or the error the read met. None when it verified: go on and write
    it; else the failure it means, by where it was read from."""
    if got is not None and not isinstance(got, Exception):
        return None
    if isinstance(ev, Store):  # client staging: unreadable, or changed under the read
        why = Failure.VERIFY if got is None else Failure.BAD_STAGING
    elif ev.src is Tier.REDIS and got is not None:  # Redis (or the master serving the key) unreachable
        why = Failure.REDIS
    else:  # the source tier no longer holds a valid copy (Redis: expired, evicted or corrupt)
        why = Failure.SOURCE_MISS
    return failed(ev, tier, why)


def written(ev: Received, tier: Tier, entry: Entry | None) -> Outcome:
    """A write into local tier `tier`: stored in `entry`'s slot, or None when the tier had no
    room, even after making some."""
    return failed(ev, tier, Failure.NO_ROOM) if entry is None else stored(ev, tier, entry.slot)


def sent(ev: Received, error: Exception | None) -> Outcome:
    """A SET of `ev`'s block into Redis: stored there, or the error Redis gave."""
    return failed(ev, Tier.REDIS, Failure.REDIS) if error is not None else stored(ev, Tier.REDIS, -1)


def evicted(pool: str, key: BlockKey, tier: Tier, reason: Reason) -> Outcome:
    """`key` was dropped from `tier` (by an evict, or to make room): removed, for `reason`.
    Dropped from Redis, it is no longer believed to be there."""
    return Outcome(Removed(pool, key, tier, Cause.EVICT, reason), Count.EVICTED,
                   False if tier is Tier.REDIS else None)


def asked_redis(got: bool | Exception) -> tuple[bool, bool | None]:
    """Redis's answer to whether it still holds a block, asked before the last local copy goes:
    whether it does, and the news for the pool's record of it (False: it does not, stop
    believing it). An error means no, and is no news."""
    if isinstance(got, Exception):
        return False, None
    return got, None if got else False


def kept(verdict: Verdict) -> Outcome:
    """An evict that did not drop its block reports nothing: gone already (a duplicate), no longer
    leaving (a late command: stale), or refused (the policy may choose it again)."""
    if verdict is Verdict.STALE:
        return Outcome(None, Count.STALE)
    if verdict in REFUSED:
        return Outcome(None, Count.REFUSED)
    if verdict is Verdict.GONE:
        return Outcome(None)
    raise ValueError(f"{verdict} drops the block")
