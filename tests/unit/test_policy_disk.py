"""The disk tier in the placement policy (issue 30): cpu sheds into disk what admission lets in,
disk sheds into Redis, blocks come back up from disk before Redis, and no block leaves the node
before its extensions. A pool without a disk tier behaves as before (tests/unit/test_policy.py
and the state machine run with an empty one)."""

from __future__ import annotations

from kvtier.core.events import Cause, Demote, Evict, Promote, Reason, Stored, Tier
from kvtier.core.eviction import Verdict, evict_verdict, room_victim
from tests.support.placement import NOW, POOL, k, placement, put


def _read(p, tier: Tier, i: int, times: int) -> None:
    for _ in range(times):
        p.tiers[tier].touch(k(i))


def test_cpu_sheds_reused_blocks_to_disk_and_cold_ones_on_to_redis() -> None:
    p = placement(gpu=0, cpu=4, disk=8, disk_admit_after=1)
    put(p, Tier.CPU, [1, 2, 3, 4])
    _read(p, Tier.CPU, 1, 1)  # k(1) read once: admitted; k(2) never read: on to Redis
    for i in (3, 4):
        _read(p, Tier.CPU, i, 2)  # hotter: they stay
    slot = {i: p.tiers[Tier.CPU].get(k(i)).slot for i in (1, 2)}
    # staying 4 > 0.9 * 4: down to int(0.75 * 4) = 3 -> one block; the coldest is k(2)... then k(1)
    cmds = p.pressure(NOW)
    assert cmds == [Demote(POOL, k(2), None, Tier.CPU, Tier.REDIS, slot[2], 0)]
    assert p.disk_admissions.snapshot()["cold"] == 1
    q = placement(gpu=0, cpu=4, disk=8, disk_admit_after=1)
    put(q, Tier.CPU, [1, 2, 3, 4])
    _read(q, Tier.CPU, 1, 1)
    for i in (2, 3, 4):
        _read(q, Tier.CPU, i, 2)
    assert q.pressure(NOW) == [Demote(POOL, k(1), None, Tier.CPU, Tier.DISK, slot[1], 0)]
    assert q.disk_admissions.snapshot()["reused"] == 1
    assert q.incoming(Tier.DISK) == 1  # counted against the disk tier's room until its fact


def test_a_hot_prefix_admits_its_unread_tail_and_zero_admits_everything() -> None:
    p = placement(gpu=0, cpu=2, disk=8, disk_admit_after=2)
    put(p, Tier.CPU, [1, 2], chain=True)
    _read(p, Tier.CPU, 1, 2)
    slot = p.tiers[Tier.CPU].get(k(2)).slot
    assert p.pressure(NOW) == [Demote(POOL, k(2), k(1), Tier.CPU, Tier.DISK, slot, 0)]
    assert p.disk_admissions.snapshot()["hot_prefix"] == 1
    every = placement(gpu=0, cpu=2, disk=8, disk_admit_after=0)
    put(every, Tier.CPU, [1, 2])
    assert [c.dst for c in every.pressure(NOW)] == [Tier.DISK]
    assert every.disk_admissions.snapshot()["all"] == 1


def test_a_full_disk_is_skipped_and_a_block_on_disk_is_evicted_clean() -> None:
    p = placement(gpu=0, cpu=2, disk=1, disk_admit_after=0)
    put(p, Tier.DISK, [50])  # disk full (its own shedding makes room; cpu does not wait for it)
    put(p, Tier.CPU, [1, 2])
    cmds = p.pressure(NOW)
    assert [(type(c), getattr(c, "dst", None)) for c in cmds if getattr(c, "key", None) == k(1)] == \
        [(Demote, Tier.REDIS)]
    q = placement(gpu=0, cpu=2, disk=8)
    put(q, Tier.CPU, [1, 2])
    put(q, Tier.DISK, [1])
    assert q.pressure(NOW) == [Evict(POOL, k(1), Tier.CPU, Reason.CLEAN)]


def test_disk_sheds_into_redis_and_finishes_the_write_back_on_the_fact() -> None:
    p = placement(gpu=0, cpu=4, disk=4)
    put(p, Tier.DISK, [1, 2, 3, 4])
    put(p, Tier.REDIS, [1])
    cmds = p.pressure(NOW)
    assert cmds == [Evict(POOL, k(1), Tier.DISK, Reason.CLEAN)]
    q = placement(gpu=0, cpu=4, disk=4)
    put(q, Tier.DISK, [1, 2, 3, 4])
    slot = q.tiers[Tier.DISK].get(k(1)).slot
    assert q.pressure(NOW) == [Demote(POOL, k(1), None, Tier.DISK, Tier.REDIS, slot, 0)]
    q.in_redis(k(1), None)
    assert q.on_fact(Stored(POOL, k(1), None, Tier.REDIS, -1, Cause.DEMOTE)) == \
        [Evict(POOL, k(1), Tier.DISK, Reason.DEMOTED)]
    assert evict_verdict(q, Tier.DISK, k(1), Reason.DEMOTED) is Verdict.ASK_REDIS  # the node's last copy


def test_a_cpu_copy_with_a_disk_copy_drops_without_asking_redis() -> None:
    p = placement(gpu=0, cpu=2, disk=8)
    put(p, Tier.CPU, [1])
    put(p, Tier.DISK, [1])
    p.tiers[Tier.CPU].mark_leaving(k(1))
    assert evict_verdict(p, Tier.CPU, k(1), Reason.CLEAN) is Verdict.DROP
    full = placement(gpu=0, cpu=1, disk=8)
    put(full, Tier.CPU, [1])
    put(full, Tier.DISK, [1])
    assert room_victim(full, Tier.CPU) == (k(1), Verdict.DROP)
    put(full, Tier.REDIS, [7])
    put(full, Tier.DISK, [7])
    assert room_victim(full, Tier.DISK) == (k(7), Verdict.ASK_REDIS)


def test_no_block_leaves_the_node_before_its_extensions_on_disk() -> None:
    p = placement(gpu=0, cpu=4, disk=2, disk_admit_after=5)  # disk nearly full: cpu sheds to Redis
    put(p, Tier.CPU, [1, 2, 3, 4])  # unchained leaves; k(1) is the parent of a block on disk
    p.tiers[Tier.DISK].add(k(10), k(1))
    put(p, Tier.DISK, [11])
    cmds = p.pressure(NOW)
    assert cmds and all(c.key != k(1) for c in cmds)  # k(1) would strand k(10) on disk
    # Going down into disk keeps a block on the node: its gpu children do not hold it in cpu.
    q = placement(gpu=4, cpu=2, disk=8, disk_admit_after=0)
    put(q, Tier.CPU, [1, 2])
    q.tiers[Tier.GPU].add(k(20), k(1))
    assert not q.strands_children(Tier.CPU, k(1), Tier.DISK)
    assert q.strands_children(Tier.CPU, k(1), Tier.REDIS)


def test_reads_bring_disk_blocks_back_into_cpu_before_redis() -> None:
    p = placement(gpu=0, cpu=4, disk=8, promote_after_hits=2)
    put(p, Tier.DISK, [1])
    slot = p.tiers[Tier.DISK].get(k(1)).slot
    assert p.on_access([k(1)], NOW) == []
    assert p.on_access([k(1)], NOW) == [Promote(POOL, k(1), None, Tier.DISK, Tier.CPU, slot, 0)]
    q = placement(gpu=0, cpu=4, disk=8)
    put(q, Tier.DISK, [1])
    dslot = q.tiers[Tier.DISK].get(k(1)).slot
    got = q.on_prefetch([k(1), k(2)], None, NOW)
    assert got == [Promote(POOL, k(1), None, Tier.DISK, Tier.CPU, dslot, 0),
                   Promote(POOL, k(2), k(1), Tier.REDIS, Tier.CPU, -1, 0)]


def test_the_redis_record_lasts_while_the_disk_holds_the_block() -> None:
    p = placement(gpu=0, cpu=2, disk=2)
    put(p, Tier.CPU, [1])
    put(p, Tier.DISK, [1])
    assert p.in_redis(k(1), None)
    p.dropped(Tier.CPU, k(1))
    assert k(1) in p.tiers[Tier.REDIS]  # the disk copy still relies on it
    p.dropped(Tier.DISK, k(1))
    assert k(1) not in p.tiers[Tier.REDIS]
    assert p.where(k(1)) is None


def test_a_gpu_block_on_disk_is_evicted_clean_when_cpu_is_full() -> None:
    """Found by the state machine: gpu shed a block straight to Redis (cpu full) while disk held
    it, and disk shed the same block to Redis in the same pass; one fact settled only one of the
    two write-backs and gpu kept a stale leaving mark. A copy further down on the node makes it
    clean, and one write-back of a block into a tier runs at a time."""
    p = placement(gpu=2, cpu=1, disk=4)
    put(p, Tier.CPU, [9])  # cpu full
    put(p, Tier.DISK, [1])
    put(p, Tier.GPU, [1, 2])
    cmds = p.pressure(NOW)
    assert Evict(POOL, k(1), Tier.GPU, Reason.CLEAN) in cmds
    assert not any(isinstance(c, Demote) and c.key == k(1) for c in cmds)


def test_a_retired_disk_forgets_its_blocks_takes_nothing_and_cpu_sheds_past_it() -> None:
    """An I/O error turns the disk tier off (kvtier/tiers/disk.py): the core forgets what it held,
    never hands out a slot again, and cpu sheds into Redis as if the pool had no disk tier."""
    p = placement(gpu=0, cpu=4, disk=8, disk_admit_after=0)
    put(p, Tier.DISK, [10, 11])
    p.on_fact(Stored(POOL, k(11), None, Tier.REDIS, -1, Cause.COPY))
    p.in_redis(k(11), None)
    assert p.tiers[Tier.REDIS].get(k(11)) is not None
    gone = p.retired(Tier.DISK)
    assert sorted(e.key for e in gone) == [k(10), k(11)]
    assert p.tiers[Tier.DISK].capacity == 0 and len(p.tiers[Tier.DISK]) == 0
    assert p.tiers[Tier.REDIS].get(k(11)) is None, "no copy left on the node: the Redis record is dropped too"
    assert p.tiers[Tier.DISK].reserve(k(12), None) is None and p.tiers[Tier.DISK].reserve(k(12), None, 3) is None
    assert p.bring_into_service(Tier.DISK, range(8)) == 0, "an adoption still running brings nothing back"
    assert p.below(Tier.CPU) == Tier.REDIS
    put(p, Tier.CPU, [1, 2, 3, 4])
    assert {c.dst for c in p.pressure(NOW) if isinstance(c, Demote)} == {Tier.REDIS}


def test_a_parent_whose_dropped_child_stays_on_disk_is_no_spare_for_a_put() -> None:
    """A full cpu tier holding a chain P -> C, C also on disk and P also in Redis: dropping C
    (clean) leaves C on the node, so P, held only off the node, may not go after it (it would
    strand C). A put counted it as room anyway, and the worker then found nothing to drop: the
    flood test's dropped puts. Only C is a spare."""
    p = placement(gpu=0, cpu=2, disk=8)
    put(p, Tier.CPU, [1, 2], chain=True)
    put(p, Tier.DISK, [2])
    assert p.in_redis(k(1), None)
    assert p.admit([k(10), k(11)], NOW) == [Tier.CPU, Tier.REDIS]
    q = placement(gpu=0, cpu=2, disk=8)  # both held on disk: both are spares
    put(q, Tier.CPU, [1, 2], chain=True)
    put(q, Tier.DISK, [1, 2], chain=True)
    assert q.admit([k(10), k(11)], NOW) == [Tier.CPU, Tier.CPU]


def test_a_parent_whose_child_is_on_its_way_to_disk_is_no_spare_either() -> None:
    """As above, with the child's write-back to disk still in flight when the put is admitted:
    the parent strands a child on its way into disk, so it is not clean to begin with."""
    p = placement(gpu=0, cpu=2, disk=8, disk_admit_after=0)
    put(p, Tier.CPU, [1, 2], chain=True)
    for i in (1, 2):
        assert p.in_redis(k(i), None)  # both clean through Redis (a spilled put's copies)
    slot = p.tiers[Tier.CPU].get(k(2)).slot
    assert p.pressure(NOW) == [Demote(POOL, k(2), k(1), Tier.CPU, Tier.DISK, slot, 0)]  # on its way to disk
    assert p.admit([k(10), k(11)], NOW) == [Tier.CPU, Tier.REDIS]


def test_with_a_disk_tier_a_parent_held_only_in_redis_is_never_a_follow_on_spare() -> None:
    """The child a put's room is made from may still be written back to disk before the worker
    drops it (shedding decides after the put is admitted, in the same batch): then its parent,
    held only in Redis, may not go. With a disk tier such a parent is not counted; without one,
    the rule is as before."""
    for disk, want in ((8, [Tier.CPU, Tier.REDIS]), (0, [Tier.CPU, Tier.CPU])):
        p = placement(gpu=0, cpu=2, disk=disk)
        put(p, Tier.CPU, [1, 2], chain=True)
        for i in (1, 2):
            assert p.in_redis(k(i), None)
        assert p.admit([k(10), k(11)], NOW) == want, disk
