"""The tier workers' eviction rules, pure: what may leave a tier now.

The policy chooses what to shed (`Placement.pressure`); a worker carries the choice out a moment
later, when things may have changed. These functions decide at that moment, from the indices
alone, and return a verdict the worker acts on; what the worker then did goes back through the
Placement (`dropped`, `refused`, `not_in_redis`), and what it reports and counts is the verdict's
outcome (kvtier/core/outcomes.py `evicted`, `kept`). The tier worker and the Hypothesis state
machine (tests/unit/test_policy_state.py) call the same functions, so the machine checks the
rules that production runs. No I/O: where the answer depends on Redis, the verdict says "ask
Redis" and `after_redis_check` finishes it.
"""

from __future__ import annotations

import enum

from kvtier.core.events import Reason, Tier
from kvtier.core.policy import DROP_REASONS, Placement
from kvtier.core.residency import NODE
from kvtier.keys import BlockKey

# How many victims a full tier tries before giving up making room: each one Redis turns out
# not to hold any more is forgotten, so a stale record costs one more try, not a loop.
ROOM_TRIES = 4


class Verdict(enum.Enum):
    GONE = "gone"  # not in this tier: a duplicate command
    STALE = "stale"  # no longer leaving (it stayed, or came back): a late command, not ours to act on
    BUSY = "busy"  # a child arrived, a reader or a session pins it: refused, tail first and pins honoured now
    DROP = "drop"  # safe: a lower tier holds it, or the reason is a documented drop
    ASK_REDIS = "ask_redis"  # safe only if Redis still holds it (it may have expired it since)
    ONLY_COPY = "only_copy"  # no lower tier holds it: refused rather than lost
    REUSED = "reused"  # a frequency-filter drop of a block read often enough since: refused


REFUSED = frozenset({Verdict.BUSY, Verdict.ONLY_COPY, Verdict.REUSED})


def evict_verdict(p: Placement, t: Tier, key: BlockKey, reason: Reason) -> Verdict:
    """Whether the worker of local tier `t` may drop `key` now, for an `evict` with `reason`."""
    idx = p.tiers[t]
    entry = idx.get(key)
    if entry is None:
        return Verdict.GONE
    if not entry.leaving:
        return Verdict.STALE
    # The leaving mark holds one pin; any more is a reader's.
    # A session pin since it was chosen keeps its last copy on the node (kept_on_node).
    if idx.children(key) or entry.pins > 1 or p.kept_on_node(t, key):
        return Verdict.BUSY
    if any(key in p.tiers[u] for u in NODE if u > t):  # a copy stays on the node (gpu: cpu or disk; cpu: disk)
        return Verdict.DROP
    if reason in DROP_REASONS and p.reused(key):
        # Read `redis_admit_after_hits` times since it was chosen (or the evict is a late one,
        # for an earlier mark): the filter's drop no longer applies. Refused outright, not asked
        # of Redis (a miss there would let the reason drop it); chosen again, it is written back.
        return Verdict.REUSED
    if key in p.tiers[Tier.REDIS]:
        return Verdict.ASK_REDIS
    return Verdict.DROP if reason in DROP_REASONS else Verdict.ONLY_COPY


def after_redis_check(present: bool, reason: Reason) -> Verdict:
    """ASK_REDIS finished: Redis has it (drop), or not (only a documented drop may go on)."""
    return Verdict.DROP if present or reason in DROP_REASONS else Verdict.ONLY_COPY


def room_victim(p: Placement, t: Tier) -> tuple[BlockKey, Verdict] | None:
    """What full local tier `t` drops to make room for a new block (reason MAKE_ROOM): a block
    a tier below holds, with DROP (a tier below on the node holds it) or ASK_REDIS (only Redis is
    believed to hold it, so confirm before the node's last copy goes). None when there is no such
    block."""
    key = p.clean_victim(t)
    if key is None:
        return None
    return key, Verdict.DROP if p.held_below(t, key) in NODE else Verdict.ASK_REDIS
