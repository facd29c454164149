"""The tier workers' eviction rules (kvtier/core/eviction.py): the verdict a worker acts on."""

from __future__ import annotations

from kvtier.core.events import Tier
from kvtier.core.eviction import Verdict, after_local_drop, after_redis_check, evict_verdict
from tests.support.placement import k, placement, put

GPU, CPU, REDIS = Tier.GPU, Tier.CPU, Tier.REDIS


def leaving(p, t: Tier, i: int) -> None:
    assert p.tiers[t].mark_leaving(k(i))


def test_a_block_chosen_to_leave_goes_when_a_lower_tier_holds_it() -> None:
    p = placement()
    put(p, GPU, [1])
    put(p, CPU, [1])
    leaving(p, GPU, 1)
    assert evict_verdict(p, GPU, k(1), "clean") is Verdict.DROP


def test_a_reader_pin_taken_after_the_choice_refuses_the_eviction() -> None:
    p = placement()
    put(p, GPU, [1])
    put(p, CPU, [1])
    leaving(p, GPU, 1)
    assert p.tiers[GPU].pin(k(1))  # a reader, on top of the leaving mark's own pin
    assert evict_verdict(p, GPU, k(1), "clean") is Verdict.BUSY
    p.tiers[GPU].unpin(k(1))
    assert evict_verdict(p, GPU, k(1), "clean") is Verdict.DROP


def test_a_child_arrived_since_the_choice_refuses_the_eviction() -> None:
    p = placement()
    put(p, CPU, [1])
    leaving(p, CPU, 1)
    put(p, REDIS, [1])
    p.tiers[GPU].add(k(2), k(1))  # its extension, in gpu: the cpu parent may not leave the node
    assert evict_verdict(p, CPU, k(1), "clean") is Verdict.BUSY


def test_late_duplicate_and_only_copy_commands() -> None:
    p = placement()
    assert evict_verdict(p, CPU, k(9), "clean") is Verdict.GONE
    put(p, CPU, [1])
    assert evict_verdict(p, CPU, k(1), "clean") is Verdict.STALE  # not chosen (any more)
    leaving(p, CPU, 1)
    assert evict_verdict(p, CPU, k(1), "clean") is Verdict.ONLY_COPY
    assert evict_verdict(p, CPU, k(1), "unreused") is Verdict.DROP  # the documented drop


def test_a_redis_copy_is_confirmed_before_the_last_local_copy_goes() -> None:
    p = placement()
    put(p, CPU, [1])
    put(p, REDIS, [1])
    leaving(p, CPU, 1)
    assert evict_verdict(p, CPU, k(1), "clean") is Verdict.ASK_REDIS
    assert after_redis_check(True, "clean") is Verdict.DROP
    assert after_redis_check(False, "clean") is Verdict.ONLY_COPY
    assert after_redis_check(False, "unreused") is Verdict.DROP


def test_the_redis_record_is_kept_only_while_a_local_copy_exists() -> None:
    p = placement()
    put(p, GPU, [1])
    put(p, CPU, [1])
    put(p, REDIS, [1])
    p.tiers[GPU].remove(k(1))
    after_local_drop(p, k(1))
    assert k(1) in p.tiers[REDIS]  # cpu still holds it
    p.tiers[CPU].remove(k(1))
    after_local_drop(p, k(1))
    assert k(1) not in p.tiers[REDIS]
