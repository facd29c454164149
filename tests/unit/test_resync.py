"""The re-replication rule (core/resync.py): round robin over local blocks, and what Redis's
answer changes."""

from __future__ import annotations

from kvtier.core.events import Copy, Tier
from kvtier.core.index import TierIndex
from kvtier.core.knobs import RedisWrite
from kvtier.core.resync import ResyncSweep
from tests.support.placement import POOL, k, placement, put


def test_rounds_visit_every_local_block_in_turn() -> None:
    p = placement(gpu=2, cpu=4)
    put(p, Tier.GPU, [1, 2])
    put(p, Tier.CPU, [3, 4, 5])
    sweep = ResyncSweep(p)
    seen = sweep.next_keys(2) + sweep.next_keys(2) + sweep.next_keys(2)
    assert set(seen) == {k(i) for i in range(1, 6)}, "five blocks, three rounds of two: all of them"
    assert ResyncSweep(placement()).next_keys(8) == []


def test_a_block_redis_lost_is_forgotten_there_and_copied_again_under_write_through() -> None:
    p = placement(redis_write=RedisWrite.WRITE_THROUGH)
    put(p, Tier.CPU, [1, 2])
    p.in_redis(k(1), None)
    sweep = ResyncSweep(p)
    assert sweep.answered({k(1): False, k(2): True}) == [Copy(POOL, k(1), None, Tier.CPU, Tier.REDIS)]
    assert k(1) not in p.tiers[Tier.REDIS], "no longer believed to be in Redis"
    assert k(2) in p.tiers[Tier.REDIS], "held there: recorded (a warm restart knew nothing)"
    assert sweep.answered({k(9): False}) == [], "a block that left the node meanwhile"


def test_write_back_and_the_frequency_filter_copy_nothing_early() -> None:
    p = placement()  # write-back: the block goes to Redis when cpu sheds it
    put(p, Tier.CPU, [1])
    p.in_redis(k(1), None)
    assert ResyncSweep(p).answered({k(1): False}) == []
    assert k(1) not in p.tiers[Tier.REDIS], "so shedding writes it back instead of dropping it as clean"
    f = placement(redis_write=RedisWrite.WRITE_THROUGH, redis_admit_after_hits=2)
    put(f, Tier.CPU, [1, 2])
    f.on_access([k(2), k(2)], 0.0)
    assert ResyncSweep(f).answered({k(1): False, k(2): False}) == [
        Copy(POOL, k(2), None, Tier.CPU, Tier.REDIS)], "only the block read often enough"


def test_a_round_looks_at_a_bounded_stretch_of_slots_and_the_rounds_cover_them_all() -> None:
    """A round's cost is bounded by the keys it may return (SCAN_PER_KEY slots a key, in all), not
    by the node's size (a walk of every block each round held the daemon's loop for 0.8 s at a
    million blocks); a sparse node is still covered, a stretch a round."""
    from kvtier.core.resync import SCAN_PER_KEY

    p = placement(gpu=2, cpu=4000)
    put(p, Tier.GPU, [1])
    put(p, Tier.CPU, list(range(2, 4000)))
    cpu = p.tiers[Tier.CPU]
    keep = {k(2), k(1500), k(3999)}  # three blocks far apart in the cpu arena
    for key in [e.key for e in cpu.ready()]:
        if key not in keep:
            cpu.remove(key)
    assert {e.key for e in cpu.ready()} == keep
    sweep = ResyncSweep(p)
    scanned = counted_walk(cpu)
    seen: set[bytes] = set()
    rounds = 0
    while seen != keep | {k(1)}:
        scanned.clear()
        got = sweep.next_keys(2)
        assert len(got) <= 2 and len(set(got)) == len(got)
        assert sum(scanned) <= SCAN_PER_KEY * 2, f"a round looked at {sum(scanned)} cpu slots for 2 keys"
        seen.update(got)
        rounds += 1
        assert rounds <= 2 + (2 + 4000) // (SCAN_PER_KEY * 2), "every slot within slots / (SCAN_PER_KEY n) rounds"


def test_a_block_in_two_tiers_is_checked_once_a_round() -> None:
    p = placement(gpu=2, cpu=2)
    put(p, Tier.GPU, [1, 2])
    put(p, Tier.CPU, [1, 3])  # k(1) is in both
    got = ResyncSweep(p).next_keys(8)
    assert sorted(got) == sorted({k(1), k(2), k(3)})


def test_a_full_nodes_round_looks_at_about_as_many_slots_as_keys() -> None:
    """On a full node a round's stretch is no longer than the keys still wanted (at least
    STRETCH): a round of n keys builds the list of about n slots, not of SCAN_PER_KEY x n."""
    from kvtier.core.resync import STRETCH

    p = placement(gpu=0, cpu=4000)
    put(p, Tier.CPU, list(range(4000)))
    cpu = p.tiers[Tier.CPU]
    scanned = counted_walk(cpu)
    sweep = ResyncSweep(p)
    for n in (1000, 10):
        scanned.clear()
        assert len(sweep.next_keys(n)) == n
        assert sum(scanned) <= max(n, STRETCH), (n, scanned)


def counted_walk(tier: TierIndex) -> list[int]:
    """The slots each `ready_in_slots` call of `tier` looks at, appended as the sweep walks it
    (the real walk still answers)."""
    scanned: list[int] = []
    real = tier.ready_in_slots

    def counting(start: int, end: int) -> list[tuple[int, bytes]]:
        scanned.append(end - start)
        return real(start, end)

    tier.ready_in_slots = counting  # type: ignore[method-assign]
    return scanned
