"""The configurable placement rules: write-through, the Redis frequency filter, prefetch target."""

from __future__ import annotations

from kvtier.bus.codec import decode, encode
from kvtier.config import load_config
from kvtier.core.events import Cause, Copy, Demote, Envelope, Evict, Failure, Promote, Removed, Stored, Tier
from kvtier.core.knobs import RedisWrite
from kvtier.core.policy import DROP_REASONS
from kvtier.daemon.pools import policy_knobs
from tests.support.placement import NOW, POOL, k, placement, put

THROUGH = RedisWrite.WRITE_THROUGH


def test_policy_choices_are_enums_built_from_config_values() -> None:
    assert RedisWrite("write-through") is THROUGH and RedisWrite("write-back") is RedisWrite.WRITE_BACK
    cfg = load_config(None, {"KVTIER__POLICY__REDIS_WRITE": "write-through", "KVTIER__POLICY__PREFETCH_TO": "gpu",
                             "KVTIER__POLICY__REDIS_ADMIT_AFTER_HITS": "2"})
    assert (cfg.policy.redis_write, cfg.policy.prefetch_to, cfg.policy.redis_admit_after_hits) == (
        "write-through", "gpu", 2)
    knobs = policy_knobs(cfg.policy)  # what the daemon hands the core
    assert (knobs.redis_write, knobs.prefetch_to, knobs.redis_admit_after_hits) == (THROUGH, Tier.GPU, 2)


def test_copy_roundtrips_through_the_codec() -> None:
    env = Envelope(Copy(POOL, k(1), k(0), Tier.CPU, Tier.REDIS), "p", 1, 2)
    assert decode(encode(env)) == env


def test_write_back_never_copies_on_store() -> None:
    p = placement()
    put(p, Tier.GPU, [1])
    assert p.on_fact(Stored(POOL, k(1), None, Tier.GPU, 0, "store")) == []


def test_write_through_copies_a_stored_block_to_redis_once() -> None:
    p = placement(redis_write=THROUGH)
    put(p, Tier.CPU, [1])
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 0, "store")) == [Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    p.tiers[Tier.REDIS].add(k(1), None)  # the copy landed
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 0, "store")) == [], "a duplicate fact copies nothing"
    # Promotions and demotions are not new blocks: nothing to write through.
    assert p.on_fact(Stored(POOL, k(2), None, Tier.GPU, 1, "promote")) == []


def test_write_through_makes_shedding_an_eviction_not_a_write_back() -> None:
    p = placement(gpu=0, cpu=4, redis_write=THROUGH)
    put(p, Tier.CPU, [1, 2, 3, 4])
    for i in (1, 2, 3, 4):
        p.tiers[Tier.REDIS].add(k(i), None)
    cmds = p.pressure(NOW)
    assert cmds and all(isinstance(c, Evict) and c.reason == "clean" for c in cmds)


def test_frequency_filter_drops_unread_blocks_and_writes_back_reused_ones() -> None:
    p = placement(gpu=0, cpu=4, redis_admit_after_hits=2)
    put(p, Tier.CPU, [1, 2, 3, 4])
    p.on_access([k(1), k(1)], NOW)  # k1 reused twice; the others never read
    p.on_access([k(2)], NOW)  # k2 once: not enough
    cmds = {c.key: c for c in p.pressure(NOW)}
    dropped = [c for c in cmds.values() if isinstance(c, Evict)]
    assert dropped and all(c.reason == "unreused" and c.reason in DROP_REASONS for c in dropped)
    assert k(1) not in {c.key for c in dropped}, "a reused block is never dropped by the filter"
    # Shed everything: the reused block goes to Redis by write-back.
    p2 = placement(gpu=0, cpu=1, redis_admit_after_hits=2, low_watermark=0.01, high_watermark=0.5)
    put(p2, Tier.CPU, [7])
    p2.on_access([k(7), k(7)], NOW)
    assert p2.pressure(NOW) == [Demote(POOL, k(7), None, Tier.CPU, Tier.REDIS, 0, 0)]


def test_write_through_with_the_filter_copies_on_the_nth_read() -> None:
    p = placement(redis_write=THROUGH, redis_admit_after_hits=2)
    put(p, Tier.CPU, [1])
    assert p.on_fact(Stored(POOL, k(1), None, Tier.CPU, 0, "store")) == [], "not reused yet"
    assert [c for c in p.on_access([k(1)], NOW) if isinstance(c, Copy)] == []
    assert [c for c in p.on_access([k(1)], NOW) if isinstance(c, Copy)] == [
        Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    assert [c for c in p.on_access([k(1)], NOW) if isinstance(c, Copy)] == [], "once"


def test_prefetch_to_gpu_promotes_there_while_it_has_room() -> None:
    p = placement(gpu=1, cpu=4, prefetch_to=Tier.GPU)
    put(p, Tier.CPU, [5])
    cmds = p.on_prefetch([k(1), k(2)], None, NOW)
    assert cmds == [Promote(POOL, k(1), None, Tier.REDIS, Tier.GPU, -1, 0),
                    Promote(POOL, k(2), k(1), Tier.REDIS, Tier.CPU, -1, 0)], "gpu full after one: cpu"
    q = placement(gpu=2, cpu=4, prefetch_to=Tier.GPU)
    put(q, Tier.CPU, [5])
    assert q.on_prefetch([k(5)], None, NOW) == [Promote(POOL, k(5), None, Tier.CPU, Tier.GPU, 0, 0)]


def test_reverting_a_copy_changes_nothing() -> None:
    p = placement(gpu=1, cpu=1)
    before = (p.room(Tier.GPU), p.room(Tier.CPU))
    p.revert([Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)])
    assert (p.room(Tier.GPU), p.room(Tier.CPU)) == before


def test_a_prefetch_into_a_full_cpu_waits_for_room_instead_of_failing() -> None:
    p = placement(gpu=0, cpu=4, high_watermark=0.9, low_watermark=0.5)
    put(p, Tier.CPU, [10, 11, 12, 13])  # full of four unrelated cold blocks only cpu holds
    assert p.on_prefetch([k(1), k(2)], None, NOW) == [], "no slot: nothing is sent that must fail"
    for i in (10, 11, 12, 13):  # written back to Redis meanwhile: now they may be evicted
        p.tiers[Tier.REDIS].add(k(i), None)
    shed = p.pressure(NOW)  # the waiting blocks count as demand: 4 + 2 shed down to 2 (low watermark)
    assert [type(c) for c in shed] == [Evict] * 4 and {c.key for c in shed} == {k(i) for i in (10, 11, 12, 13)}
    for c in shed[:2]:  # two evictions complete
        p.tiers[Tier.CPU].remove(c.key)
    assert p.pressure(NOW) == [Promote(POOL, k(1), None, Tier.REDIS, Tier.CPU, -1, 0),
                               Promote(POOL, k(2), k(1), Tier.REDIS, Tier.CPU, -1, 0)], "in chain order"
    assert p.pressure(NOW) == [], "each once"
    q = placement(gpu=0, cpu=4)
    put(q, Tier.CPU, [10, 11, 12, 13])
    q.on_prefetch([k(1)], None, NOW)
    q.tiers[Tier.CPU].remove(k(10))
    assert q.pressure(NOW + 10.0) == [], "a wait longer than the prefetch lease is given up"


def test_a_prefetch_into_a_full_cpu_makes_way_with_blocks_redis_holds() -> None:
    """A full cpu tier whose blocks Redis also holds need not wait for shedding: the worker drops
    one of those for each promote. Blocks already on their way in claim their share first."""
    p = placement(gpu=0, cpu=4)
    put(p, Tier.CPU, [10, 11, 12, 13])
    for i in (10, 11, 12, 13):
        p.tiers[Tier.REDIS].add(k(i), None)
    assert p.on_prefetch([k(1), k(2)], None, NOW) == [Promote(POOL, k(1), None, Tier.REDIS, Tier.CPU, -1, 0),
                                                     Promote(POOL, k(2), k(1), Tier.REDIS, Tier.CPU, -1, 0)]
    # Two of the four clean blocks are spoken for by those promotes: two more may come, one waits.
    sent = p.on_prefetch([k(3), k(4), k(5)], None, NOW)
    assert [c.key for c in sent] == [k(3), k(4)]
    assert p.on_prefetch([k(6)], None, NOW) == [], "no clean block left: it waits"


def test_write_through_redoes_a_copy_whose_source_shed_the_block_first() -> None:
    """The gpu tier demoted the block to cpu before the redis worker ran its copy from gpu: the
    copy fails with SOURCE_MISS and is redone from cpu (it used to be lost, a hole in the chain)."""
    p = placement(redis_write=THROUGH)
    put(p, Tier.CPU, [1])
    missed = Removed(POOL, k(1), Tier.REDIS, Cause.COPY, Failure.SOURCE_MISS)
    assert p.on_fact(missed) == [Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    # Not retried: a Redis error (it would fail again at once during an outage; the cpu tier
    # writes the block back when it sheds it), a block no local tier holds, one Redis holds.
    assert p.on_fact(Removed(POOL, k(1), Tier.REDIS, Cause.COPY, Failure.REDIS)) == []
    assert p.on_fact(Removed(POOL, k(2), Tier.REDIS, Cause.COPY, Failure.SOURCE_MISS)) == []
    p.tiers[Tier.REDIS].add(k(1), None)
    assert p.on_fact(missed) == []
    assert placement().on_fact(missed) == [], "write-back: no copies to redo"


def test_a_stored_batch_copies_what_its_spilled_tail_and_write_through_need() -> None:
    """`on_stored`, a put's whole batch as the coordinator hands it: under write-back the stored
    ancestors of a put's spilled tail are copied to Redis once (the chain there has no hole);
    under write-through every stored block Redis lacks is copied, each time it is stored again."""
    def after_puts(**knobs):
        p = placement(gpu=0, cpu=4, **knobs)
        put(p, Tier.CPU, [1, 2], chain=True)
        p.on_put([k(3), k(4), k(5), k(6)], k(2), NOW)  # two fit, k(5) and k(6) spill to Redis
        p.tiers[Tier.CPU].add(k(3), k(2))
        p.tiers[Tier.CPU].add(k(4), k(3))
        return p

    keys, parents = [k(3), k(4), k(9)], [k(2), k(3), None]  # k(9): a fact of a block never put (late)
    heads = [Copy(POOL, k(3), k(2), Tier.CPU, Tier.REDIS), Copy(POOL, k(4), k(3), Tier.CPU, Tier.REDIS)]
    back = after_puts()
    assert {k(3), k(4)} <= set(back._incoming[Tier.CPU])
    assert back.on_stored(Tier.CPU, keys, parents) == heads
    assert not {k(3), k(4)} & set(back._incoming[Tier.CPU]), "no longer in flight"
    assert back.on_stored(Tier.CPU, keys, parents) == [], "write-back copies a spilled tail's head once"
    through = after_puts(redis_write=THROUGH)
    every = [*heads, Copy(POOL, k(9), None, Tier.CPU, Tier.REDIS)]
    assert through.on_stored(Tier.CPU, keys, parents) == every
    through.tiers[Tier.REDIS].add(k(3), k(2))
    assert through.on_stored(Tier.CPU, keys, parents) == every[1:], "not what Redis holds already"
