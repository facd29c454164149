"""The tier workers' eviction rules, pure: what may leave a tier now, and what to remember after.

The policy chooses what to shed (`Placement.pressure`); a worker carries the choice out a moment
later, when things may have changed. These functions decide at that moment, from the indices
alone, and return a verdict the worker acts on. The tier worker and the Hypothesis state machine
(tests/unit/test_policy_state.py) call the same functions, so the machine checks the rules that
production runs. No I/O: where the answer depends on Redis, the verdict says "ask Redis" and
`after_redis_check` finishes it.
"""

from __future__ import annotations

import enum

from kvtier.core.events import Tier
from kvtier.core.policy import DROP_REASONS, Placement


class Verdict(enum.Enum):
    GONE = "gone"  # not in this tier: a duplicate command
    STALE = "stale"  # no longer leaving (it stayed, or came back): a late command, not ours to act on
    BUSY = "busy"  # a child arrived or a reader pins it: refused, tail first and pins honoured now
    DROP = "drop"  # safe: a lower tier holds it, or the reason is a documented drop
    ASK_REDIS = "ask_redis"  # safe only if Redis still holds it (it may have expired it since)
    ONLY_COPY = "only_copy"  # no lower tier holds it: refused rather than lost


REFUSED = frozenset({Verdict.BUSY, Verdict.ONLY_COPY})


def evict_verdict(p: Placement, t: Tier, key: bytes, reason: str) -> Verdict:
    """Whether the worker of local tier `t` may drop `key` now, for an `evict` with `reason`."""
    idx = p.tiers[t]
    entry = idx.get(key)
    if entry is None:
        return Verdict.GONE
    if not entry.leaving:
        return Verdict.STALE
    # The leaving mark holds one pin; any more is a reader's.
    if idx.children(key) or entry.pins > 1 or (t == Tier.CPU and p.tiers[Tier.GPU].children(key)):
        return Verdict.BUSY
    if t == Tier.GPU and key in p.tiers[Tier.CPU]:
        return Verdict.DROP
    if key in p.tiers[Tier.REDIS]:
        return Verdict.ASK_REDIS
    return Verdict.DROP if reason in DROP_REASONS else Verdict.ONLY_COPY


def after_redis_check(present: bool, reason: str) -> Verdict:
    """ASK_REDIS finished: Redis has it (drop), or not (only a documented drop may go on)."""
    return Verdict.DROP if present or reason in DROP_REASONS else Verdict.ONLY_COPY


def forget_redis_copy(p: Placement, key: bytes) -> None:
    """Redis no longer holds `key` (expired, evicted): stop believing it does."""
    p.tiers[Tier.REDIS].remove(key)


def after_local_drop(p: Placement, key: bytes) -> None:
    """Call once a local copy is dropped. When no local tier holds the block any more, stop
    tracking its Redis copy too: the daemon needs to know about Redis only for blocks it might
    drop locally, which keeps that record bounded by local capacity."""
    if all(p.tiers[t].get(key) is None for t in (Tier.GPU, Tier.CPU)):
        p.tiers[Tier.REDIS].remove(key)
