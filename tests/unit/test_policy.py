"""Placement policy (kvtier/core/policy.py): a pure function of the tier indices -> commands."""

from __future__ import annotations

from kvtier.core.events import Cause, Copy, Demote, Evict, Failure, Promote, Reason, Removed, Store, Stored, Tier
from kvtier.core.knobs import RedisWrite
from kvtier.core.room import InFlight
from tests.support.placement import NOW, POOL, TIMEOUT, k, placement, put

# --- admit ---------------------------------------------------------------------------------------
# With no local room a put goes straight to Redis (policy.py docstring); kept in one place.
OVERFLOW = Tier.REDIS


def test_admit_fills_gpu_then_cpu_counting_the_batch() -> None:
    p = placement(gpu=2, cpu=3)
    put(p, Tier.GPU, [100])
    got = p.admit([k(1), k(2), k(3), k(4), k(5), k(6)], NOW)
    assert got == [Tier.GPU, Tier.CPU, Tier.CPU, Tier.CPU, OVERFLOW, OVERFLOW]
    assert p.tiers[Tier.GPU].used == 1 and p.tiers[Tier.CPU].used == 0  # admit decides, indices unchanged
    assert placement(gpu=0, cpu=1).admit([k(1), k(2)], NOW) == [Tier.CPU, OVERFLOW]  # no gpu at all


def test_admit_counts_blocks_in_flight_across_calls_until_their_fact() -> None:
    p = placement(gpu=1, cpu=1)
    assert p.admit([k(1)], NOW) == [Tier.GPU]
    assert p.admit([k(2)], NOW) == [Tier.CPU]  # the gpu slot is spoken for, though not yet reserved
    assert p.admit([k(3)], NOW) == [OVERFLOW]
    assert p.room(Tier.GPU) == p.room(Tier.CPU) == 0
    assert p.on_fact(Removed(POOL, k(1), Tier.GPU, Cause.STORE, Failure.VERIFY)) == []
    assert p.room(Tier.GPU) == 1
    assert p.incoming(Tier.GPU) == 0 and p.incoming(Tier.CPU) == 1
    assert p.on_fact(Removed(POOL, k(99), Tier.CPU, Cause.EVICT, Reason.CLEAN)) == []  # another key's fact
    assert p.room(Tier.CPU) == 0 and p.incoming(Tier.CPU) == 1
    p.tiers[Tier.CPU].add(k(2), None)
    assert p.on_fact(Stored(POOL, k(2), None, Tier.CPU, 0, Cause.STORE)) == []
    assert p.room(Tier.CPU) == 0 and p.incoming(Tier.CPU) == 0  # now the slot itself is used
    assert p.admit([k(4), k(5)], NOW) == [Tier.GPU, OVERFLOW]


def test_admit_duplicates_are_none_but_redis_only_blocks_are_admitted() -> None:
    p = placement(gpu=1, cpu=4)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [2])
    p.tiers[Tier.CPU].reserve(k(3), None)  # PENDING counts as here too
    put(p, Tier.REDIS, [4])
    assert p.admit([k(1), k(2), k(3), k(4), k(5)], NOW) == [None, None, None, Tier.CPU, Tier.CPU]


def test_granted_blocks_go_to_cpu_whatever_the_room_and_the_rest_is_admitted_after_them() -> None:
    """A put's leading blocks written into granted cpu slots (kvtier/tiers/grants.py) go to the
    cpu tier, where their bytes are, even with gpu room and with no free cpu slot (the grants
    hold their slots); duplicates are None (the slot is handed back); the rest of the chain is
    admitted as any put, and a granted block does not take its room."""
    p = placement(gpu=2, cpu=3)
    slots = p.grant(Tier.CPU, 3)
    assert len(slots) == 3 and p.room(Tier.CPU) == 0 and p.tiers[Tier.CPU].used == 0
    put(p, Tier.GPU, [2])
    got = p.admit([k(1), k(2), k(3), k(4), k(5)], NOW, granted=3)
    assert got == [Tier.CPU, None, Tier.CPU, Tier.GPU, OVERFLOW]
    assert p.incoming(Tier.CPU) == 2  # in flight until their facts, like any admitted block
    assert p.admit([k(1), k(6)], NOW, granted=1) == [None, OVERFLOW]  # on its way already
    e = p.claim(Tier.CPU, slots[0], k(1), None)
    assert e is not None and e.slot == slots[0] and p.claim(Tier.CPU, slots[0], k(9), None) is None
    assert p.ungrant(Tier.CPU, slots[1]) and not p.ungrant(Tier.CPU, slots[1]) and p.tiers[Tier.CPU].free == 1


def test_a_chain_that_does_not_fit_keeps_its_head_by_dropping_colder_clean_tails() -> None:
    """Issue 25: the head of a new chain stays local; room for it comes from colder chains' tail
    blocks that Redis holds (the worker drops them: room_victim), and only the tail spills."""
    p = placement(gpu=0, cpu=6)
    put(p, Tier.CPU, [1, 2, 3], chain=True)  # a cold chain, all of it also in Redis
    put(p, Tier.REDIS, [1, 2, 3])
    put(p, Tier.CPU, [10, 11])  # warm blocks only this node holds
    new = [k(20 + i) for i in range(5)]
    # One free slot, then the cold chain's three clean blocks (tail first), then Redis.
    assert p.admit(new, NOW) == [Tier.CPU] * 4 + [OVERFLOW]
    victims = []
    for _ in range(3):  # the worker, taking room as it stores the spare-admitted blocks
        victims.append(p.clean_victim(Tier.CPU))
        p.dropped(Tier.CPU, victims[-1])
    assert victims == [k(3), k(2), k(1)], "a chain gives way tail first"
    assert k(10) in p.tiers[Tier.CPU] and k(11) in p.tiers[Tier.CPU], "dirty blocks are never spares"


def test_a_put_that_spills_copies_its_local_head_and_ancestors_to_redis_under_write_back() -> None:
    """Redis must not hold a spilled tail without its head: another node's read starts at block 0."""
    p = placement(gpu=0, cpu=5)
    put(p, Tier.CPU, [1, 2], chain=True)  # the chain so far, only on this node
    put(p, Tier.CPU, [50])
    chain = [k(3), k(4), k(5)]
    tiers, now = p.on_put([k(2)] + chain, k(1), NOW)
    assert tiers == [None, Tier.CPU, Tier.CPU, OVERFLOW]
    # k(2) (already here) and its ancestor k(1) go now; the new head once it is stored.
    assert now == [Copy(POOL, k(2), k(1), Tier.CPU, Tier.REDIS), Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    assert k(1) in p.tiers[Tier.CPU] and k(2) in p.tiers[Tier.CPU]  # copies, not moves
    p.tiers[Tier.CPU].add(k(3), k(2))
    stored = Stored(POOL, k(3), k(2), Tier.CPU, 0, Cause.STORE)
    assert p.on_fact(stored) == [Copy(POOL, k(3), k(2), Tier.CPU, Tier.REDIS)]
    assert p.on_fact(stored) == [], "one copy, not one per delivery"
    assert p.on_fact(Removed(POOL, k(4), Tier.CPU, Cause.STORE, Failure.VERIFY)) == []  # its store failed
    p.tiers[Tier.CPU].add(k(4), k(3))
    assert p.on_fact(Stored(POOL, k(4), k(3), Tier.CPU, 1, Cause.STORE)) == [], "forgotten with its failure"


def test_a_spill_copy_that_missed_its_source_is_redone_from_where_the_block_is_now() -> None:
    """The copy named gpu, which demoted the block to cpu before the redis worker got to it."""
    p = placement(gpu=1, cpu=4)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [50, 51, 52])
    _, cmds = p.on_put([k(2), k(3)], k(1), NOW)  # one cpu slot: k(2) local, k(3) spills
    assert cmds == [Copy(POOL, k(1), None, Tier.GPU, Tier.REDIS)]
    p.tiers[Tier.GPU].remove(k(1))
    p.tiers[Tier.CPU].add(k(1), None)  # demoted meanwhile
    missed = Removed(POOL, k(1), Tier.REDIS, Cause.COPY, Failure.SOURCE_MISS)
    assert p.on_fact(missed) == [Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    assert p.on_fact(Removed(POOL, k(1), Tier.REDIS, Cause.COPY, Failure.REDIS)) == [], "a Redis error: not redone"
    other = Removed(POOL, k(51), Tier.REDIS, Cause.COPY, Failure.SOURCE_MISS)
    assert p.on_fact(other) == [], "not a spill copy"


def test_a_put_that_fits_or_a_write_through_or_filtered_pool_makes_no_spill_copies() -> None:
    fits = placement(gpu=0, cpu=5)
    assert fits.on_put([k(1), k(2)], None, NOW) == ([Tier.CPU, Tier.CPU], [])
    for knobs in ({"redis_write": RedisWrite.WRITE_THROUGH}, {"redis_admit_after_hits": 2}):
        p = placement(gpu=0, cpu=1, **knobs)
        put(p, Tier.CPU, [9])
        tiers, cmds = p.on_put([k(1), k(2), k(3)], k(9), NOW)
        assert tiers == [Tier.CPU, OVERFLOW, OVERFLOW] or tiers == [OVERFLOW] * 3
        assert cmds == []
        p.tiers[Tier.CPU].add(k(1), k(9))
        assert not [c for c in p.on_fact(Stored(POOL, k(1), k(9), Tier.CPU, 0, Cause.STORE))
                    if isinstance(c, Copy) and c.key == k(1) and "admit_after" in str(knobs)]


def test_a_spilled_puts_ancestor_walk_stops_at_redis_and_at_the_node_edge() -> None:
    p = placement(gpu=0, cpu=4)
    put(p, Tier.CPU, [1, 2, 3], chain=True)
    put(p, Tier.REDIS, [1])
    _, cmds = p.on_put([k(4), k(5)], k(3), NOW)
    assert [c.key for c in cmds] == [k(3), k(2)], "k(1) is in Redis already"


def test_where_prefers_the_highest_tier() -> None:
    p = placement()
    put(p, Tier.REDIS, [1, 2, 3])
    put(p, Tier.CPU, [2, 3])
    put(p, Tier.GPU, [3])
    p.tiers[Tier.GPU].reserve(k(2), None)  # pending: not visible yet
    assert [p.where(k(i)) for i in (1, 2, 3, 4)] == [Tier.REDIS, Tier.CPU, Tier.GPU, None]


# --- pressure ------------------------------------------------------------------------------------
def test_pressure_demotes_or_evicts_coldest_down_to_low_watermark() -> None:
    calm = placement(gpu=10, cpu=10)
    put(calm, Tier.GPU, range(9))
    put(calm, Tier.CPU, range(100, 109))
    assert calm.pressure(NOW) == []  # at the high watermark: nothing to shed
    p = placement(gpu=10, cpu=100)
    put(p, Tier.GPU, range(10))
    put(p, Tier.CPU, [1])  # k(1) already has a cpu copy
    p.tiers[Tier.GPU].touch(k(0))  # k(0) becomes the hottest
    cmds = p.pressure(NOW)
    # staying 10 > 9 -> shed down to int(0.75 * 10) = 7: three blocks, coldest first.
    assert cmds == [
        Evict(POOL, k(1), Tier.GPU, Reason.CLEAN),
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
    assert p.pressure(NOW) == [Evict(POOL, k(4), Tier.CPU, Reason.CLEAN)]
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
    # cpu has room for two; the third gpu victim goes straight to redis rather than wait for it.
    assert [(c.key, c.dst) for c in gpu_cmds] == [(k(0), Tier.CPU), (k(1), Tier.CPU), (k(2), Tier.REDIS)]
    # cpu: 8 used + 2 incoming = 10 > 9 -> shed to 7: three blocks go to redis.
    assert [(c.key, c.dst) for c in cpu_cmds] == [(k(i), Tier.REDIS) for i in range(100, 103)]
    assert len(cmds) == 6


def test_gpu_never_sends_a_block_off_the_node_ahead_of_its_children_in_cpu() -> None:
    """Issue 25: a put's head in gpu, its tail in cpu, cpu full. The head's last gpu block is a
    gpu leaf, but Redis is no place for it: reads of the chain would stop there. It waits for cpu
    room; a gpu leaf whose children are nowhere local may still go straight to Redis."""
    p = placement(gpu=4, cpu=4, high_watermark=0.5, low_watermark=0.25)
    put(p, Tier.GPU, [1, 2], chain=True)
    p.tiers[Tier.CPU].add(k(3), k(2))  # the rest of that chain, in cpu
    put(p, Tier.CPU, [30, 31, 32])  # cpu full
    put(p, Tier.GPU, [40])  # a gpu leaf with no children anywhere
    gpu_cmds = [c for c in p.pressure(NOW) if getattr(c, "src", getattr(c, "tier", None)) == Tier.GPU]
    assert [(c.key, c.dst) for c in gpu_cmds] == [(k(40), Tier.REDIS)]
    assert not p.tiers[Tier.GPU].get(k(2)).leaving
    # A child that reached cpu after the choice: the write-back completes, but the gpu copy stays.
    q = placement(gpu=2, cpu=1, high_watermark=0.5, low_watermark=0.5)
    put(q, Tier.CPU, [30])
    put(q, Tier.GPU, [1, 2])
    [d] = [c for c in q.pressure(NOW) if isinstance(c, Demote) and c.src == Tier.GPU]
    assert (d.key, d.dst) == (k(1), Tier.REDIS)
    q.tiers[Tier.CPU].remove(k(30))
    q.tiers[Tier.CPU].add(k(5), k(1))  # k(1)'s child arrives in cpu
    assert q.in_redis(k(1), None)
    assert q.on_fact(Stored(POOL, k(1), None, Tier.REDIS, -1, Cause.DEMOTE)) == []
    assert k(1) in q.tiers[Tier.GPU] and not q.tiers[Tier.GPU].get(k(1)).leaving


def test_a_parent_stays_while_its_children_are_still_on_their_way_in() -> None:
    """A put's head lands in gpu, its tail in cpu; the cpu stores are slower. Before the tail is
    visible, gpu pressure must not send the head off the node, nor shed a block whose children
    are on their way into its own tier (an index counts only visible children)."""
    p = placement(gpu=3, cpu=4, high_watermark=0.5, low_watermark=0.1)
    put(p, Tier.CPU, [30, 31])  # cpu will be full once the tail arrives
    chain = [k(i) for i in range(1, 6)]
    assert p.admit(chain, NOW) == [Tier.GPU] * 3 + [Tier.CPU] * 2
    for key, parent in zip(chain[:3], [None, *chain[:2]]):
        p.tiers[Tier.GPU].add(key, parent)  # the gpu stores are done; the cpu ones still running
    gpu_cmds = [c for c in p.pressure(NOW) if getattr(c, "src", getattr(c, "tier", None)) == Tier.GPU]
    assert gpu_cmds == [], "k(3)'s child k(4) is on its way into cpu"
    assert p.children(Tier.CPU, k(3)) == 1 and p.tiers[Tier.CPU].children(k(3)) == 0
    p.on_fact(Removed(POOL, k(4), Tier.CPU, Cause.STORE, Failure.VERIFY))  # that store failed after all
    assert p.children(Tier.CPU, k(3)) == 0
    assert [c.key for c in p.pressure(NOW) if getattr(c, "src", None) == Tier.GPU] == [k(3)]


# --- facts ---------------------------------------------------------------------------------------
def test_stored_by_demote_evicts_the_upper_copy() -> None:
    p = placement(gpu=2, cpu=2, high_watermark=0.4, low_watermark=0.4)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [5])
    cpu_fact = Stored(POOL, k(1), None, Tier.CPU, 3, Cause.DEMOTE)
    assert p.on_fact(cpu_fact) == [], "not chosen to leave: a stray or late fact evicts nothing"
    p.tiers[Tier.GPU].mark_leaving(k(1))
    assert p.on_fact(cpu_fact) == [], "leaving, but by no demote: the mark is another command's"
    p.tiers[Tier.GPU].clear_leaving(k(1))
    assert [(type(c), c.key, c.dst) for c in p.pressure(NOW)] == [(Demote, k(1), Tier.CPU), (Demote, k(5), Tier.REDIS)]
    assert p.on_fact(cpu_fact) == [Evict(POOL, k(1), Tier.GPU, Reason.DEMOTED)]
    redis_fact = Stored(POOL, k(5), None, Tier.REDIS, -1, Cause.DEMOTE)
    assert p.on_fact(redis_fact) == [Evict(POOL, k(5), Tier.CPU, Reason.DEMOTED)]
    assert p.on_fact(Stored(POOL, k(9), None, Tier.CPU, 3, Cause.DEMOTE)) == []  # no upper copy
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 3, Cause.STORE)) == []
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 3, Cause.PROMOTE)) == []
    assert p.on_fact(Stored(POOL, k(1), None, Tier.GPU, 0, Cause.DEMOTE)) == []


def test_failed_demote_clears_leaving_so_the_block_can_be_chosen_again() -> None:
    p = placement(gpu=10, high_watermark=0.75, low_watermark=0.7)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    assert [c.key for c in p.pressure(NOW)] == [k(0), k(1), k(2)]  # 10 -> 7
    assert p.on_fact(Removed(POOL, k(0), Tier.CPU, Cause.EVICT, Reason.CLEAN)) == []
    assert gpu.get(k(0)).leaving  # an unrelated removal changes nothing
    assert p.on_fact(Removed(POOL, k(0), Tier.GPU, Cause.DEMOTE, Failure.NO_ROOM)) == []
    assert gpu.get(k(0)).leaving  # a gpu fact has no upper tier to clear
    assert p.on_fact(Removed(POOL, k(0), Tier.CPU, Cause.DEMOTE, Failure.NO_ROOM)) == []
    e = gpu.get(k(0))
    assert not e.leaving and e.pins == 0 and gpu.leaving == 2
    assert [c.key for c in p.pressure(NOW)] == [k(0)]  # 8 staying > 7.5: chosen again, and only it


# --- access and prefetch -------------------------------------------------------------------------
def test_access_promotes_cpu_only_block_after_enough_hits() -> None:
    p = placement(gpu=4, promote_after_hits=2)
    put(p, Tier.CPU, [1, 2], chain=True)
    assert p.on_access([k(1), k(2)], NOW) == []
    cpu = p.tiers[Tier.CPU]
    assert p.on_access([k(2)], NOW) == [Promote(POOL, k(2), k(1), Tier.CPU, Tier.GPU, cpu.get(k(2)).slot, 0)]
    assert cpu.get(k(2)).hits == 2


def test_access_does_not_promote_what_gpu_has_nor_past_its_room() -> None:
    p = placement(gpu=2, promote_after_hits=1)
    put(p, Tier.CPU, [1, 2, 3, 9])
    put(p, Tier.GPU, [9])
    assert p.on_access([k(9)], NOW) == []  # already in gpu
    assert p.tiers[Tier.GPU].get(k(9)).hits == 1
    cmds = p.on_access([k(1), k(2), k(3), k(77)], NOW)
    assert [(c.key, c.src, c.dst) for c in cmds] == [(k(1), Tier.CPU, Tier.GPU)]
    assert p.on_access([k(2)], NOW) == []  # the last gpu slot is promised to k(1)
    p.on_fact(Removed(POOL, k(1), Tier.GPU, Cause.PROMOTE, Failure.SOURCE_MISS))
    assert [c.key for c in p.on_access([k(2)], NOW)] == [k(2)]


def test_a_read_report_finds_each_block_where_where_finds_it() -> None:
    """Residency.on_node (the coordinator's tally of a read report) against `where`, key by key:
    the highest tier on the node with a visible copy; Redis alone, a block still being written
    and an unknown key are not on the node."""
    p = placement(gpu=4, cpu=8, disk=4)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, [1, 2])
    put(p, Tier.DISK, [2, 3])
    put(p, Tier.REDIS, [3, 4])
    assert p.reserve(Tier.CPU, k(5), None) is not None  # PENDING: not visible yet
    keys = [k(i) for i in (1, 2, 3, 4, 5, 6, 2)]
    want = [(key, t) for key in keys if (t := p.where(key)) is not None and t is not Tier.REDIS]
    assert list(p.on_node(keys)) == want == [(k(1), Tier.GPU), (k(2), Tier.CPU), (k(3), Tier.DISK),
                                             (k(2), Tier.CPU)]
    assert list(placement().on_node(keys)) == []  # every tier empty: nothing asked, nothing found


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
    for head in (None, k(50)):  # the first key's parent is the chain's head_parent
        cmds = placement().on_prefetch([k(7), k(8)], head_parent=head, now=NOW)
        assert cmds == [Promote(POOL, k(7), head, Tier.REDIS, Tier.CPU, -1, 0),
                        Promote(POOL, k(8), k(7), Tier.REDIS, Tier.CPU, -1, 0)]


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
    p.on_access([k(0)], NOW + 1)  # read: k(0)'s lease has served its purpose
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


# --- in flight: duplicates, give-up deadlines, revert, refusal ----------------------------------
def test_a_key_in_flight_is_not_admitted_or_promoted_again_until_it_settles() -> None:
    p = placement(gpu=2, cpu=2, promote_after_hits=1)
    put(p, Tier.CPU, [5])
    promote = Promote(POOL, k(5), None, Tier.CPU, Tier.GPU, p.tiers[Tier.CPU].get(k(5)).slot, 0)
    assert p.on_access([k(5), k(5)], NOW) == [promote]  # once within a call
    assert p.on_access([k(5)], NOW + 1) == []  # and once across calls, though gpu has room
    assert p.admit([k(1), k(1)], NOW) == [Tier.GPU, None]
    assert p.admit([k(1)], NOW + 1) == [None]  # still on its way in
    (fetch,) = p.on_prefetch([k(3)], None, NOW)
    assert p.admit([k(3)], NOW + 1) == [None] and p.on_prefetch([k(3)], None, NOW + 1) == []
    assert p.incoming(Tier.GPU) == 2 and p.incoming(Tier.CPU) == 1
    p.on_fact(Removed(POOL, k(1), Tier.GPU, Cause.STORE, Failure.VERIFY))
    p.on_fact(Removed(POOL, k(5), Tier.GPU, Cause.PROMOTE, Failure.SOURCE_MISS))
    assert p.on_access([k(5)], NOW + 2) == [promote]  # settled: decided afresh
    assert p.admit([k(1)], NOW + 2) == [Tier.GPU] and p.room(Tier.GPU) == 0


def test_in_flight_marks_expire_after_transfer_timeout() -> None:
    q = placement(gpu=1, cpu=1)
    assert q.admit([k(1), k(2)], NOW) == [Tier.GPU, Tier.CPU]
    assert q.admit([k(3)], NOW + TIMEOUT - 0.1) == [OVERFLOW]  # still counted just before
    assert q.admit([k(1), k(4)], NOW + TIMEOUT) == [Tier.GPU, Tier.CPU]  # given up: room is back
    assert q.incoming(Tier.GPU) == q.incoming(Tier.CPU) == 1  # only the new ones
    r = placement(gpu=1, cpu=0, transfer_timeout_s=2.0)  # the knob sets the deadline
    got = [r.admit([k(i)], NOW + t)[0] for i, t in ((1, 0), (2, 1.9), (3, 2))]
    assert got == [Tier.GPU, OVERFLOW, Tier.GPU]
    # A stuck demote gives back its cpu room, and its gpu block becomes a candidate again.
    p = placement(gpu=10, cpu=10)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    first = p.pressure(NOW)
    assert [(type(c), c.key) for c in first] == [(Demote, k(0)), (Demote, k(1)), (Demote, k(2))]
    assert p.incoming(Tier.CPU) == 3 and p.room(Tier.CPU) == 7
    assert p.pressure(NOW + TIMEOUT - 0.1) == [] and gpu.leaving == 3
    assert p.admit([], NOW + TIMEOUT) == []  # time passes; no fact ever came back
    assert p.incoming(Tier.CPU) == 0 and p.room(Tier.CPU) == 10
    assert gpu.leaving == 0 and all(gpu.get(k(i)).pins == 0 for i in range(3))
    assert p.pressure(NOW + TIMEOUT) == first  # the same three are chosen again
    assert p.pressure(NOW + 2 * TIMEOUT - 0.1) == [] and gpu.leaving == 3  # under a fresh deadline


def test_in_flight_expiry_goes_by_each_blocks_latest_deadline_and_stays_bounded() -> None:
    f = InFlight()
    f.add(k(1), None, 5.0)
    f.add(k(2), k(1), 3.0)
    f.add(k(1), None, 10.0)  # sent again: the later deadline holds, not the first
    f.add(k(3), None, 4.0)
    f.pop(k(3))  # its fact came back
    assert f.expire(6.0) == [k(2)] and k(1) in f and f.kids(k(1)) == 0
    assert f.expire(9.9) == [] and f.expire(10.0) == [k(1)] and len(f) == 0
    f.add(k(4), None, 1.0)
    f.add(k(5), None, 0.5)  # an earlier deadline added later still goes first
    assert f.expire(0.7) == [k(5)] and f.expire(1.0) == [k(4)]
    # Blocks settled long before their deadline leave entries behind in the expiry order;
    # they are dropped in bulk, so a steady stream of puts does not grow it without bound.
    for i in range(200_000):
        f.add(k(i), None, 1e9)
        f.pop(k(i))
    assert len(f) == 0 and len(f._due) <= 65_536 + 1


def test_revert_undoes_the_marks_of_commands_never_published() -> None:
    p = placement(gpu=10, cpu=10)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    put(p, Tier.CPU, [0, 50])  # k(0) has a cpu copy: evicted, not demoted
    shed = p.pressure(NOW)
    assert [(type(c), c.key) for c in shed] == [(Evict, k(0)), (Demote, k(1)), (Demote, k(2))]
    assert gpu.leaving == 3 and p.room(Tier.CPU) == 6
    p.revert(shed)
    assert gpu.leaving == 0 and all(gpu.get(k(i)).pins == 0 for i in range(3))
    assert p.incoming(Tier.CPU) == 0 and p.room(Tier.CPU) == 8
    assert p.pressure(NOW) == shed  # the replay chooses the same blocks again
    q = placement(gpu=2, cpu=2, promote_after_hits=1)
    put(q, Tier.CPU, [50])
    (promote,) = q.on_access([k(50)], NOW)
    assert q.admit([k(1)], NOW) == [Tier.GPU]
    (fetch,) = q.on_prefetch([k(2)], None, NOW)
    assert q.room(Tier.GPU) == q.room(Tier.CPU) == 0
    q.revert([promote, Store(POOL, Tier.GPU, k(1), None, "seg", 0, 0), fetch,
              Store(POOL, Tier.REDIS, k(9), None, "seg", 1, 0)])  # a redis store marked nothing
    assert q.incoming(Tier.GPU) == q.incoming(Tier.CPU) == 0
    assert q.room(Tier.GPU) == 2 and q.room(Tier.CPU) == 1
    assert q.on_access([k(50)], NOW) == [promote] and q.on_prefetch([k(2)], None, NOW) == [fetch]
    assert q.admit([k(1)], NOW) == [Tier.GPU]  # not a duplicate any more


def test_refused_or_expired_evicts_clear_leaving_and_an_eviction_fact_settles_it() -> None:
    p = placement(gpu=10, high_watermark=0.75, low_watermark=0.7)
    gpu = p.tiers[Tier.GPU]
    put(p, Tier.GPU, range(10))
    put(p, Tier.CPU, [0])
    assert [(type(c), c.key) for c in p.pressure(NOW)] == [(Evict, k(0)), (Demote, k(1)), (Demote, k(2))]
    p.refused(Tier.GPU, k(0))  # the worker found it was the only copy after all
    assert not gpu.get(k(0)).leaving and gpu.get(k(0)).pins == 0 and gpu.leaving == 2
    assert p.pressure(NOW + 1) == [Evict(POOL, k(0), Tier.GPU, Reason.CLEAN)]  # 8 > 7.5: chosen again
    assert [c.key for c in p.pressure(NOW + TIMEOUT)] == [k(1), k(2)]  # the demotes gave up
    assert p.pressure(NOW + 1 + TIMEOUT) == [Evict(POOL, k(0), Tier.GPU, Reason.CLEAN)]  # so did the evict
    gpu.remove(k(0))  # this time the worker evicts it, then reports
    assert p.on_fact(Removed(POOL, k(0), Tier.GPU, Cause.EVICT, Reason.CLEAN)) == []
    assert (Tier.GPU, k(0)) not in p._leaving and gpu.leaving == 2  # no record left to expire


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
    q = placement()
    put(q, Tier.GPU, [1, 2], chain=True)
    put(q, Tier.CPU, [1])
    assert q.clean_victim(Tier.GPU) is None  # k(1) is in cpu but k(2) still hangs off it


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


# --- reads straight from Redis (read-through) ----------------------------------------------------
def test_blocks_read_straight_from_redis_are_brought_up_into_cpu_when_there_is_room() -> None:
    p = placement(gpu=4, cpu=4)
    put(p, Tier.CPU, [1])
    cmds = p.on_remote_read([k(2), k(3)], head_parent=k(1), now=NOW)
    assert cmds == [Promote(POOL, k(2), k(1), Tier.REDIS, Tier.CPU, -1, 0),
                    Promote(POOL, k(3), k(2), Tier.REDIS, Tier.CPU, -1, 0)]
    assert p.incoming(Tier.CPU) == 2
    assert p.on_remote_read([k(2), k(3)], head_parent=k(1), now=NOW) == [], "already on their way"


def test_remote_reads_promote_after_the_configured_count_and_not_at_all_with_zero() -> None:
    p = placement(promote_remote_after_reads=2)
    assert p.on_remote_read([k(5)], None, NOW) == []
    assert p.on_remote_read([k(5)], None, NOW) == [Promote(POOL, k(5), None, Tier.REDIS, Tier.CPU, -1, 0)]
    never = placement(promote_remote_after_reads=0)
    assert all(never.on_remote_read([k(6)], None, NOW) == [] for _ in range(5))


def test_remote_reads_never_wait_for_room_but_use_clean_blocks_and_count_while_waiting() -> None:
    p = placement(gpu=0, cpu=2)
    put(p, Tier.CPU, [1, 2])  # full, and nothing clean: no promote, nothing left waiting
    assert p.on_remote_read([k(3)], None, NOW) == [] and p.incoming(Tier.CPU) == 0
    put(p, Tier.REDIS, [1])  # now block 1 is clean: the worker can drop it for one promote
    assert p.on_remote_read([k(3), k(4)], None, NOW) == [Promote(POOL, k(3), None, Tier.REDIS, Tier.CPU, -1, 0)]


def test_remote_read_counts_are_bounded_by_the_local_capacity() -> None:
    p = placement(gpu=1, cpu=2, promote_remote_after_reads=3)
    for i in range(100, 150):
        p.on_remote_read([k(i)], None, NOW)
    assert len(p._remote_reads) == 3  # gpu + cpu slots
    assert list(p._remote_reads) == [k(147), k(148), k(149)], "the oldest counts go first"
