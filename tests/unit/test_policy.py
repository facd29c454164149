"""Placement policy (kvtier/tiers/policy.py): a pure function of the tier indices -> commands."""

from __future__ import annotations

import pytest

from kvtier.bus.events import Demote, Evict, Promote, Removed, Stored, Tier
from kvtier.tiers.index import TierIndex
from kvtier.tiers.policy import Placement, PolicyKnobs

POOL = "llama-8b"
NOW = 1000.0  # the policy never reads the clock; tests pass time in


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def placement(gpu: int = 10, cpu: int = 10, **knobs) -> Placement:
    tiers = {Tier.GPU: TierIndex(gpu), Tier.CPU: TierIndex(cpu), Tier.REDIS: TierIndex(None)}
    return Placement(POOL, tiers, PolicyKnobs(**knobs))


def put(p: Placement, tier: Tier, ids, chain: bool = False) -> None:
    """Add READY blocks to `tier`, oldest first; as one chain when `chain`."""
    parent = None
    for i in ids:
        assert p.tiers[tier].add(k(i), parent if chain else None) is not None
        parent = k(i)


# --- admit ---------------------------------------------------------------------------------------


# With no local room a put goes straight to Redis (policy.py docstring); kept in one place.
OVERFLOW = Tier.REDIS


def test_admit_fills_gpu_then_cpu_counting_the_batch() -> None:
    p = placement(gpu=2, cpu=3)
    put(p, Tier.GPU, [100])
    got = p.admit([k(1), k(2), k(3), k(4), k(5), k(6)])
    assert got == [Tier.GPU, Tier.CPU, Tier.CPU, Tier.CPU, OVERFLOW, OVERFLOW]
    assert p.tiers[Tier.GPU].used == 1 and p.tiers[Tier.CPU].used == 0  # admit decides, indices unchanged


def test_admit_counts_blocks_in_flight_across_calls_until_their_fact() -> None:
    p = placement(gpu=1, cpu=1)
    assert p.admit([k(1)]) == [Tier.GPU]
    assert p.admit([k(2)]) == [Tier.CPU]  # the gpu slot is spoken for, though not yet reserved
    assert p.admit([k(3)]) == [OVERFLOW]
    assert p.room(Tier.GPU) == p.room(Tier.CPU) == 0
    assert p.on_fact(Removed(POOL, k(1), Tier.GPU, "store_failed:verify")) == []
    assert p.room(Tier.GPU) == 1
    assert p.on_fact(Removed(POOL, k(2), Tier.CPU, "evict:clean")) == []  # not an arrival
    assert p.room(Tier.CPU) == 0
    p.tiers[Tier.CPU].add(k(2), None)
    assert p.on_fact(Stored(POOL, k(2), None, Tier.CPU, 0, "store")) == []
    assert p.room(Tier.CPU) == 0  # now the slot itself is used
    assert p.admit([k(4), k(5)]) == [Tier.GPU, OVERFLOW]


def test_admit_duplicates_are_none_but_redis_only_blocks_are_admitted() -> None:
    p = placement(gpu=1, cpu=4)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [2])
    p.tiers[Tier.CPU].reserve(k(3), None)  # PENDING counts as here too
    put(p, Tier.REDIS, [4])
    assert p.admit([k(1), k(2), k(3), k(4), k(5)]) == [None, None, None, Tier.CPU, Tier.CPU]


def test_admit_with_no_gpu_capacity() -> None:
    p = placement(gpu=0, cpu=1)
    assert p.admit([k(1), k(2)]) == [Tier.CPU, OVERFLOW]


def test_where_prefers_the_highest_tier() -> None:
    p = placement()
    put(p, Tier.REDIS, [1, 2, 3])
    put(p, Tier.CPU, [2, 3])
    put(p, Tier.GPU, [3])
    p.tiers[Tier.GPU].reserve(k(2), None)  # pending: not visible yet
    assert [p.where(k(i)) for i in (1, 2, 3, 4)] == [Tier.REDIS, Tier.CPU, Tier.GPU, None]


# --- pressure ------------------------------------------------------------------------------------


def test_no_pressure_at_or_below_high_watermark() -> None:
    p = placement(gpu=10, cpu=10)
    put(p, Tier.GPU, range(9))
    put(p, Tier.CPU, range(100, 109))
    assert p.pressure(NOW) == []


def test_pressure_demotes_or_evicts_coldest_down_to_low_watermark() -> None:
    p = placement(gpu=10, cpu=100)
    put(p, Tier.GPU, range(10))
    put(p, Tier.CPU, [1])  # k(1) already has a cpu copy
    p.tiers[Tier.GPU].touch(k(0))  # k(0) becomes the hottest
    cmds = p.pressure(NOW)
    # staying 10 > 9 -> shed down to int(0.75 * 10) = 7: three blocks, coldest first.
    assert cmds == [
        Evict(POOL, k(1), Tier.GPU, "clean"),
        Demote(POOL, k(2), None, Tier.GPU, Tier.CPU, p.tiers[Tier.GPU].get(k(2)).slot, 0),
        Demote(POOL, k(3), None, Tier.GPU, Tier.CPU, p.tiers[Tier.GPU].get(k(3)).slot, 0),
    ]
    gpu = p.tiers[Tier.GPU]
    assert gpu.leaving == 3 and all(gpu.get(k(i)).leaving for i in (1, 2, 3))
    assert all(k(i) in gpu for i in (1, 2, 3))  # still readable while leaving
    assert p.pressure(NOW) == []  # 10 - 3 leaving = 7 staying


def test_demote_carries_parent_and_cpu_sheds_to_redis() -> None:
    p = placement(gpu=10, cpu=4)
    put(p, Tier.CPU, [1, 2, 3, 4], chain=True)
    put(p, Tier.REDIS, [4])
    assert p.pressure(NOW) == [Evict(POOL, k(4), Tier.CPU, "clean")]
    p2 = placement(gpu=10, cpu=4)
    put(p2, Tier.CPU, [1, 2, 3, 4], chain=True)
    slot = p2.tiers[Tier.CPU].get(k(4)).slot
    assert p2.pressure(NOW) == [Demote(POOL, k(4), k(3), Tier.CPU, Tier.REDIS, slot, 0)]


def test_pressure_never_chooses_pinned_or_non_leaf_blocks() -> None:
    p = placement(gpu=10)
    put(p, Tier.GPU, range(10), chain=True)
    cmds = p.pressure(NOW)
    assert [c.key for c in cmds] == [k(9)]  # only the chain's tail may leave
    assert p.pressure(NOW) == []  # k(8) still has a resident (leaving) child; nothing else qualifies
    q = placement(gpu=10)
    put(q, Tier.GPU, range(10))
    for i in range(9):
        q.tiers[Tier.GPU].pin(k(i))
    assert [c.key for c in q.pressure(NOW)] == [k(9)]


def test_second_call_does_not_rechoose_leaving_blocks() -> None:
    p = placement(gpu=10, high_watermark=0.5, low_watermark=0.4)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    for i in range(3, 10):
        gpu.pin(k(i))
    first = p.pressure(NOW)
    assert [c.key for c in first] == [k(0), k(1), k(2)]  # wanted 6, only 3 were eligible
    for i in range(3, 10):
        gpu.unpin(k(i))
    second = p.pressure(NOW)
    # staying 7 > 5 -> shed to 4: three more, none of the first three.
    assert [c.key for c in second] == [k(3), k(4), k(5)]
    assert gpu.leaving == 6
    assert p.pressure(NOW) == []


def test_demotes_on_their_way_down_count_toward_the_next_tier_pressure() -> None:
    p = placement(gpu=10, cpu=10)
    put(p, Tier.GPU, range(10))
    put(p, Tier.CPU, range(100, 108))  # 8 of 10: below the high watermark on its own
    cmds = p.pressure(NOW)
    gpu_cmds = [c for c in cmds if isinstance(c, Demote) and c.src == Tier.GPU]
    cpu_cmds = [c for c in cmds if isinstance(c, Demote) and c.src == Tier.CPU]
    assert len(cmds) == 7 and [c.key for c in gpu_cmds] == [k(0), k(1), k(2)]
    # cpu: 8 used + 3 incoming = 11 > 9 -> shed to 7: four blocks go to redis.
    assert [(c.key, c.dst) for c in cpu_cmds] == [(k(i), Tier.REDIS) for i in range(100, 104)]


# --- facts ---------------------------------------------------------------------------------------


def test_stored_by_demote_evicts_the_upper_copy() -> None:
    p = placement()
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [5])
    cpu_fact = Stored(POOL, k(1), None, Tier.CPU, 3, "demote")
    assert p.on_fact(cpu_fact) == [Evict(POOL, k(1), Tier.GPU, "demoted")]
    redis_fact = Stored(POOL, k(5), None, Tier.REDIS, -1, "demote")
    assert p.on_fact(redis_fact) == [Evict(POOL, k(5), Tier.CPU, "demoted")]
    assert p.on_fact(Stored(POOL, k(9), None, Tier.CPU, 3, "demote")) == []  # no upper copy
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 3, "store")) == []
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 3, "promote")) == []
    assert p.on_fact(Stored(POOL, k(1), None, Tier.GPU, 0, "demote")) == []


def test_failed_demote_clears_leaving_so_the_block_can_be_chosen_again() -> None:
    p = placement(gpu=10, high_watermark=0.75, low_watermark=0.7)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    assert [c.key for c in p.pressure(NOW)] == [k(0), k(1), k(2)]  # 10 -> 7
    assert p.on_fact(Removed(POOL, k(0), Tier.CPU, "evict:clean")) == []
    assert gpu.get(k(0)).leaving  # an unrelated removal changes nothing
    assert p.on_fact(Removed(POOL, k(0), Tier.GPU, "demote_failed:no_room")) == []
    assert gpu.get(k(0)).leaving  # a gpu fact has no upper tier to clear
    assert p.on_fact(Removed(POOL, k(0), Tier.CPU, "demote_failed:no_room")) == []
    e = gpu.get(k(0))
    assert not e.leaving and e.pins == 0 and gpu.leaving == 2
    assert [c.key for c in p.pressure(NOW)] == [k(0)]  # 8 staying > 7.5: chosen again, and only it


# --- access and prefetch -------------------------------------------------------------------------


def test_access_promotes_cpu_only_block_after_enough_hits() -> None:
    p = placement(gpu=4, promote_after_hits=2)
    put(p, Tier.CPU, [1, 2], chain=True)
    assert p.on_access([k(1), k(2)]) == []
    cpu = p.tiers[Tier.CPU]
    assert p.on_access([k(2)]) == [Promote(POOL, k(2), k(1), Tier.CPU, Tier.GPU, cpu.get(k(2)).slot, 0)]
    assert cpu.get(k(2)).hits == 2


def test_access_does_not_promote_when_gpu_has_it_or_is_full() -> None:
    p = placement(gpu=1, promote_after_hits=1)
    put(p, Tier.CPU, [1, 2, 3])
    put(p, Tier.GPU, [1])
    assert p.on_access([k(1)]) == []  # already in gpu
    assert p.tiers[Tier.GPU].get(k(1)).hits == 1
    full = placement(gpu=1, promote_after_hits=1)
    put(full, Tier.CPU, [1])
    put(full, Tier.GPU, [9])
    assert full.on_access([k(1)]) == []


def test_access_promotions_respect_gpu_room_within_one_call() -> None:
    p = placement(gpu=2, promote_after_hits=1)
    put(p, Tier.CPU, [1, 2, 3])
    put(p, Tier.GPU, [9])
    cmds = p.on_access([k(1), k(2), k(3), k(77)])
    assert [(c.key, c.src, c.dst) for c in cmds] == [(k(1), Tier.CPU, Tier.GPU)]
    assert p.on_access([k(2)]) == []  # the last gpu slot is promised to k(1)
    p.on_fact(Removed(POOL, k(1), Tier.GPU, "promote_failed:source_miss"))
    assert [c.key for c in p.on_access([k(2)])] == [k(2)]


def test_prefetch_promotes_only_non_local_keys_from_redis_with_chain_parents() -> None:
    p = placement()
    put(p, Tier.CPU, [1])
    put(p, Tier.GPU, [2])
    put(p, Tier.REDIS, [3, 4])
    cmds = p.on_prefetch([k(1), k(2), k(3), k(4), k(5)], head_parent=k(0), now=NOW)
    assert cmds == [
        Promote(POOL, k(3), k(2), Tier.REDIS, Tier.CPU, -1, 0),
        Promote(POOL, k(4), k(3), Tier.REDIS, Tier.CPU, -1, 0),
        Promote(POOL, k(5), k(4), Tier.REDIS, Tier.CPU, -1, 0),
    ]
    assert p.tiers[Tier.CPU].get(k(1)).hits == 1


@pytest.mark.parametrize("head_parent", [None, k(50)])
def test_prefetch_first_key_gets_head_parent(head_parent: bytes | None) -> None:
    p = placement()
    cmds = p.on_prefetch([k(7), k(8)], head_parent=head_parent, now=NOW)
    assert [(c.key, c.parent) for c in cmds] == [(k(7), head_parent), (k(8), k(7))]
    assert all(isinstance(c, Promote) and c.src == Tier.REDIS and c.dst == Tier.CPU for c in cmds)


def test_prefetch_leases_keep_blocks_from_being_shed_until_read_or_expired() -> None:
    p = placement(cpu=10, prefetch_lease_s=5.0)
    cpu = p.tiers[Tier.CPU]
    put(p, Tier.CPU, range(10))
    put(p, Tier.REDIS, range(10))
    assert p.on_prefetch([k(0), k(1)], head_parent=None, now=NOW) == []  # both local already
    # 10 > 9 -> shed 3, coldest first, skipping the leased k(0), k(1) (touched to MRU anyway).
    assert [c.key for c in p.pressure(NOW + 1)] == [k(2), k(3), k(4)]
    for i in (2, 3, 4):
        cpu.remove(k(i))
    put(p, Tier.CPU, [20, 21, 22])
    p.on_access([k(0)])  # read: k(0)'s lease has served its purpose
    assert [c.key for c in p.pressure(NOW + 2)] == [k(5), k(6), k(7)]
    for i in (5, 6, 7):
        cpu.remove(k(i))
    put(p, Tier.CPU, [23, 24, 25])
    # LRU is now 8, 9, 1, 20, ...: k(1) is still leased and skipped.
    assert [c.key for c in p.pressure(NOW + 3)] == [k(8), k(9), k(20)]
    for i in (8, 9, 20):
        cpu.remove(k(i))
    put(p, Tier.CPU, [26, 27, 28])
    assert [c.key for c in p.pressure(NOW + 5)] == [k(1), k(21), k(22)]  # the lease ran out


# --- clean_victim --------------------------------------------------------------------------------


def test_clean_victim_is_the_coldest_evictable_block_the_next_tier_holds() -> None:
    p = placement()
    put(p, Tier.GPU, [1, 2, 3, 4])
    put(p, Tier.CPU, [3, 4])
    assert p.clean_victim(Tier.GPU) == k(3)
    p.tiers[Tier.GPU].pin(k(3))
    assert p.clean_victim(Tier.GPU) == k(4)
    p.tiers[Tier.GPU].pin(k(4))
    assert p.clean_victim(Tier.GPU) is None
    assert p.clean_victim(Tier.CPU) is None  # nothing in redis yet
    put(p, Tier.REDIS, [4])
    assert p.clean_victim(Tier.CPU) == k(4)
    assert p.clean_victim(Tier.REDIS) is None


def test_clean_victim_may_be_a_block_already_leaving_but_not_a_read_pinned_one() -> None:
    p = placement()
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, [1, 2])
    put(p, Tier.CPU, [1])
    assert gpu.mark_leaving(k(1))
    assert p.clean_victim(Tier.GPU) == k(1)  # the leaving pin is the policy's own
    gpu.pin(k(1))  # a reader holds it too
    assert p.clean_victim(Tier.GPU) is None


def test_clean_victim_skips_leased_blocks() -> None:
    p = placement(prefetch_lease_s=5.0)
    put(p, Tier.CPU, [1, 2])
    put(p, Tier.REDIS, [1, 2])
    p.on_prefetch([k(1)], head_parent=None, now=NOW)
    p.tiers[Tier.CPU].touch(k(2))  # LRU: k(1), k(2)
    assert p.clean_victim(Tier.CPU) == k(2)
    p.pressure(NOW + 5)  # expires the lease (nothing to shed)
    assert p.clean_victim(Tier.CPU) == k(1)


def test_clean_victim_skips_parents_of_resident_children() -> None:
    p = placement()
    put(p, Tier.GPU, [1, 2], chain=True)
    put(p, Tier.CPU, [1])
    assert p.clean_victim(Tier.GPU) is None
