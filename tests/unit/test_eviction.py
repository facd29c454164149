"""The tier workers' eviction rules (kvtier/core/eviction.py): the verdict a worker acts on; and
what the workers report back to the Placement that owns the indices (kvtier/core/residency.py)."""

from __future__ import annotations

from kvtier.core.events import Reason, Tier
from kvtier.core.eviction import Verdict, after_redis_check, evict_verdict, room_victim
from tests.support.placement import k, placement, put

GPU, CPU, REDIS = Tier.GPU, Tier.CPU, Tier.REDIS
CLEAN, UNREUSED, MAKE_ROOM = Reason.CLEAN, Reason.UNREUSED, Reason.MAKE_ROOM


def leaving(p, t: Tier, i: int) -> None:
    assert p.tiers[t].mark_leaving(k(i))


def test_a_block_chosen_to_leave_goes_when_a_lower_tier_holds_it() -> None:
    p = placement()
    put(p, GPU, [1])
    put(p, CPU, [1])
    leaving(p, GPU, 1)
    assert evict_verdict(p, GPU, k(1), CLEAN) is Verdict.DROP


def test_a_reader_pin_taken_after_the_choice_refuses_the_eviction() -> None:
    p = placement()
    put(p, GPU, [1])
    put(p, CPU, [1])
    leaving(p, GPU, 1)
    assert p.tiers[GPU].pin(k(1))  # a reader, on top of the leaving mark's own pin
    assert evict_verdict(p, GPU, k(1), CLEAN) is Verdict.BUSY
    p.tiers[GPU].unpin(k(1))
    assert evict_verdict(p, GPU, k(1), CLEAN) is Verdict.DROP


def test_a_child_arrived_since_the_choice_refuses_the_eviction() -> None:
    p = placement()
    put(p, CPU, [1])
    leaving(p, CPU, 1)
    put(p, REDIS, [1])
    p.tiers[GPU].add(k(2), k(1))  # its extension, in gpu: the cpu parent may not leave the node
    assert evict_verdict(p, CPU, k(1), CLEAN) is Verdict.BUSY


def test_late_duplicate_and_only_copy_commands() -> None:
    p = placement(redis_admit_after_hits=2)
    assert evict_verdict(p, CPU, k(9), CLEAN) is Verdict.GONE
    put(p, CPU, [1])
    assert evict_verdict(p, CPU, k(1), CLEAN) is Verdict.STALE  # not chosen (any more)
    leaving(p, CPU, 1)
    assert evict_verdict(p, CPU, k(1), CLEAN) is Verdict.ONLY_COPY
    assert evict_verdict(p, CPU, k(1), UNREUSED) is Verdict.DROP  # the documented drop
    p.tiers[CPU].touch(k(1))
    p.tiers[CPU].touch(k(1))
    assert evict_verdict(p, CPU, k(1), UNREUSED) is Verdict.REUSED  # but not once read twice


def test_a_redis_copy_is_confirmed_before_the_last_local_copy_goes() -> None:
    p = placement()
    put(p, CPU, [1])
    put(p, REDIS, [1])
    leaving(p, CPU, 1)
    assert evict_verdict(p, CPU, k(1), CLEAN) is Verdict.ASK_REDIS
    assert after_redis_check(True, CLEAN) is Verdict.DROP
    assert after_redis_check(False, CLEAN) is Verdict.ONLY_COPY
    assert after_redis_check(False, UNREUSED) is Verdict.DROP


def test_the_redis_record_is_kept_only_while_a_local_copy_exists() -> None:
    p = placement()
    assert not p.in_redis(k(1), None) and k(1) not in p.tiers[REDIS]  # no local copy: not recorded
    put(p, GPU, [1])
    put(p, CPU, [1])
    assert p.in_redis(k(1), None) and k(1) in p.tiers[REDIS]
    p.dropped(GPU, k(1))
    assert k(1) not in p.tiers[GPU] and k(1) in p.tiers[REDIS]  # cpu still holds it
    p.dropped(CPU, k(1))
    assert k(1) not in p.tiers[CPU] and k(1) not in p.tiers[REDIS]


def test_a_failed_write_frees_its_slot_and_a_gone_redis_copy_is_forgotten() -> None:
    p = placement(cpu=1)
    e = p.reserve(CPU, k(1), None)
    assert e is not None and k(1) not in p.tiers[CPU]  # reserved: counted, not visible
    assert p.reserve(CPU, k(2), None) is None  # full
    p.unreserve(CPU, k(1))
    assert p.tiers[CPU].free == 1 and p.tiers[CPU].get(k(1)) is None
    assert p.reserve(CPU, k(2), None) is not None and p.commit(CPU, k(2)) is not None
    assert p.where(k(2)) is CPU and p.in_redis(k(2), None) and p.where(k(2)) is CPU
    p.not_in_redis(k(2))
    assert k(2) not in p.tiers[REDIS]


def test_making_room_drops_only_what_the_next_tier_holds() -> None:
    p = placement()
    put(p, GPU, [1, 2])
    put(p, CPU, [3])
    assert room_victim(p, GPU) is None  # cpu holds neither gpu block
    assert room_victim(p, CPU) is None  # Redis is not known to hold the cpu block
    put(p, CPU, [2])
    assert room_victim(p, GPU) == (k(2), Verdict.DROP)
    put(p, REDIS, [3])
    assert room_victim(p, CPU) == (k(3), Verdict.ASK_REDIS)  # confirmed with Redis first
    assert after_redis_check(True, MAKE_ROOM) is Verdict.DROP
    assert after_redis_check(False, MAKE_ROOM) is Verdict.ONLY_COPY  # try another, or give up
    assert room_victim(p, REDIS) is None


def test_making_room_spares_read_parents_and_extended_blocks() -> None:
    p = placement()
    put(p, GPU, [1, 2], chain=True)  # 1 <- 2 in gpu
    put(p, CPU, [1, 2])
    assert room_victim(p, GPU) == (k(2), Verdict.DROP)  # the tail, not its parent
    assert p.tiers[GPU].pin(k(2))  # a reader
    assert room_victim(p, GPU) is None
    p.tiers[GPU].unpin(k(2))
    assert p.tiers[GPU].mark_leaving(k(2))  # chosen to leave already: its pin is the mark's
    assert room_victim(p, GPU) == (k(2), Verdict.DROP)
    put(p, REDIS, [1])
    assert room_victim(p, CPU) is None  # its child sits in gpu: it stays on the node
    p.dropped(GPU, k(2))
    assert room_victim(p, CPU) == (k(1), Verdict.ASK_REDIS)


def test_a_room_victim_is_checked_again_after_redis_answered() -> None:
    """A worker asks Redis before dropping the node's last copy; meanwhile the coordinator may
    adopt a child of the block (a granted put), a reader may pin it, or another evictor may drop
    it. `still_clean` is what the worker checks before it drops."""
    p = placement()
    put(p, CPU, [3])
    put(p, REDIS, [3])
    assert room_victim(p, CPU) == (k(3), Verdict.ASK_REDIS) and p.still_clean(CPU, k(3))
    e = p.reserve(CPU, k(4), k(3))  # a child on its way in: not visible yet, so no child yet
    assert e is not None and p.still_clean(CPU, k(3))
    p.commit(CPU, k(4))  # ... now visible under it: the tail goes first
    assert not p.still_clean(CPU, k(3))
    p.dropped(CPU, k(4))
    assert p.still_clean(CPU, k(3))
    assert p.tiers[CPU].pin(k(3)) and not p.still_clean(CPU, k(3)), "a reader's pin"
    p.tiers[CPU].unpin(k(3))
    p.dropped(CPU, k(3))  # another evictor took it meanwhile
    assert not p.still_clean(CPU, k(3))
