"""The tier worker's outcome rules (kvtier/core/outcomes.py): which fact, counter and Redis record
each situation a store, transfer or evict meets comes to."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvtier.core.events import Cause, Copy, Demote, Failure, Promote, Reason, Removed, Store, Stored, Tier
from kvtier.core.eviction import Verdict
from kvtier.core.index import Entry
from kvtier.core.outcomes import (
    MOVED_IN,
    Count,
    Outcome,
    asked_redis,
    evicted,
    failed,
    held,
    kept,
    read,
    sent,
    stored,
    written,
)
from kvtier.tiers.stats import TierCounters
from tests.support.placement import POOL, k, placement

GPU, CPU, REDIS = Tier.GPU, Tier.CPU, Tier.REDIS
STORE = Store(POOL, CPU, k(1), k(0), "seg", 3, 7)
FROM_REDIS = Promote(POOL, k(1), k(0), REDIS, CPU, -1, 0)
UP = Promote(POOL, k(1), k(0), CPU, GPU, 4, 0)
DOWN = Demote(POOL, k(1), k(0), GPU, CPU, 2, 0)
WRITE_BACK = Demote(POOL, k(1), k(0), CPU, REDIS, 5, 0)
COPY = Copy(POOL, k(1), k(0), CPU, REDIS)


# --- a block the tier holds already ----------------------------------------------------------


def test_a_store_of_a_block_already_present_reports_it_stored_and_moves_nothing() -> None:
    p = placement()
    assert p.tiers[CPU].add(k(0), None) is not None
    e = p.tiers[CPU].add(k(1), k(0))
    assert e is not None
    o = held(p, STORE, CPU)
    assert o == Outcome(Stored(POOL, k(1), k(0), CPU, e.slot, Cause.STORE))
    assert o.count is None and o.in_redis is None and not o.dropped  # nothing counted as stored again


def test_a_transfer_of_a_block_already_present_reports_it_stored_with_its_cause() -> None:
    p = placement()
    e = p.tiers[GPU].add(k(1), k(0))
    assert e is not None
    assert held(p, UP, GPU) == Outcome(Stored(POOL, k(1), k(0), GPU, e.slot, Cause.PROMOTE))
    assert held(p, DOWN, CPU) is None  # not in cpu: carried out


def test_into_redis_only_a_store_goes_by_the_record_of_redis() -> None:
    p = placement()
    assert p.tiers[CPU].add(k(1), k(0)) is not None
    assert p.in_redis(k(1), k(0))
    redis_store = Store(POOL, REDIS, k(1), k(0), "seg", 3, 7)
    got = held(p, redis_store, REDIS)
    assert got is not None and got.fact == Stored(POOL, k(1), k(0), REDIS, p.tiers[REDIS].get(k(1)).slot, Cause.STORE)
    # A write-back or copy is written anyway: the record may be stale, the transfer makes it true.
    assert held(p, WRITE_BACK, REDIS) is None and held(p, COPY, REDIS) is None


# --- what a read that did not verify means ---------------------------------------------------


def test_a_verified_read_goes_on() -> None:
    assert read(STORE, CPU, 0xABC) is None
    assert read(UP, GPU, 0) is None  # a checksum of 0 is still a checksum
    assert read(FROM_REDIS, CPU, (b"payload", 5)) is None


def test_a_store_whose_staging_changed_or_could_not_be_read_fails_and_drops_the_put() -> None:
    assert read(STORE, CPU, None) == Outcome(Removed(POOL, k(1), CPU, Cause.STORE, Failure.VERIFY), Count.FAILED,
                                              dropped=True)
    assert read(STORE, CPU, OSError("short read")) == Outcome(
        Removed(POOL, k(1), CPU, Cause.STORE, Failure.BAD_STAGING), Count.FAILED, dropped=True)


def test_a_transfer_whose_source_lost_the_block_fails_and_loses_nothing() -> None:
    for ev, dst in ((UP, GPU), (DOWN, CPU), (WRITE_BACK, REDIS), (COPY, REDIS)):
        o = read(ev, dst, None)
        assert o == Outcome(Removed(POOL, k(1), dst, Cause(ev.TYPE), Failure.SOURCE_MISS), Count.FAILED)
        assert not o.dropped and o.in_redis is None and not o.redis_error  # a local source: no news of Redis


def test_a_promote_that_found_nothing_in_redis_forgets_the_redis_copy() -> None:
    o = read(FROM_REDIS, CPU, None)  # expired, evicted or corrupt there
    assert o is not None and o.fact == Removed(POOL, k(1), CPU, Cause.PROMOTE, Failure.SOURCE_MISS)
    assert o.in_redis is False and not o.dropped and not o.redis_error


def test_a_promote_that_met_a_redis_error_fails_and_keeps_the_record() -> None:
    o = read(FROM_REDIS, CPU, ConnectionError("refused"))
    assert o is not None and o.fact == Removed(POOL, k(1), CPU, Cause.PROMOTE, Failure.REDIS)
    assert o.redis_error and o.in_redis is None, "an outage is no news about what Redis holds"


# --- writes ----------------------------------------------------------------------------------


def test_a_write_with_no_room_fails_with_no_room() -> None:
    assert written(FROM_REDIS, CPU, None) == Outcome(Removed(POOL, k(1), CPU, Cause.PROMOTE, Failure.NO_ROOM),
                                                     Count.FAILED)
    assert written(STORE, CPU, None).dropped, "a store that found no room loses the client's put"


def test_a_completed_write_counts_by_its_cause() -> None:
    e = Entry(k(1), k(0), 6)
    assert written(STORE, CPU, e) == Outcome(Stored(POOL, k(1), k(0), CPU, 6, Cause.STORE), Count.STORED)
    assert written(UP, GPU, e).count is Count.PROMOTED_IN
    assert written(DOWN, CPU, e).count is Count.DEMOTED_IN
    assert sent(COPY, None).count is Count.COPIED_IN
    assert {written(ev, CPU, e).count for ev in (STORE, UP, DOWN)} | {sent(COPY, None).count} == MOVED_IN


def test_a_block_promoted_from_redis_is_recorded_as_held_there() -> None:
    o = written(FROM_REDIS, CPU, Entry(k(1), k(0), 2))
    assert o == Outcome(Stored(POOL, k(1), k(0), CPU, 2, Cause.PROMOTE), Count.PROMOTED_IN, in_redis=True)
    assert written(UP, GPU, Entry(k(1), k(0), 2)).in_redis is None  # from cpu: no news of Redis


def test_a_block_written_to_redis_is_recorded_as_held_there() -> None:
    for ev in (WRITE_BACK, COPY, Store(POOL, REDIS, k(1), k(0), "seg", 3, 7)):
        o = sent(ev, None)
        assert o.fact == Stored(POOL, k(1), k(0), REDIS, -1, Cause(ev.TYPE)) and o.in_redis is True


def test_a_set_that_failed_is_a_redis_failure_and_drops_only_a_store() -> None:
    o = sent(WRITE_BACK, TimeoutError("timed out"))
    assert o == Outcome(Removed(POOL, k(1), REDIS, Cause.DEMOTE, Failure.REDIS), Count.FAILED)
    assert o.redis_error and not o.dropped
    assert sent(Store(POOL, REDIS, k(1), k(0), "seg", 3, 7), TimeoutError("timed out")).dropped


def test_every_failed_store_loses_the_put_and_no_failed_transfer_does() -> None:
    for why in Failure:
        assert failed(STORE, CPU, why).dropped
        assert failed(STORE, CPU, why).redis_error is (why is Failure.REDIS)
        for ev, dst in ((UP, GPU), (DOWN, CPU), (WRITE_BACK, REDIS), (COPY, REDIS), (FROM_REDIS, CPU)):
            assert not failed(ev, dst, why).dropped
    assert not stored(STORE, CPU, 1).dropped


# --- evictions -------------------------------------------------------------------------------


def test_an_eviction_reports_the_block_removed_with_its_reason() -> None:
    assert evicted(POOL, k(1), GPU, Reason.CLEAN) == Outcome(Removed(POOL, k(1), GPU, Cause.EVICT, Reason.CLEAN),
                                                            Count.EVICTED)
    gone = evicted(POOL, k(1), REDIS, Reason.DEMOTED)
    assert gone.in_redis is False, "a block dropped from Redis is no longer believed to be there"


def test_an_evict_that_kept_its_block_reports_nothing() -> None:
    assert kept(Verdict.GONE) == Outcome(None)
    assert kept(Verdict.STALE) == Outcome(None, Count.STALE)
    for v in (Verdict.BUSY, Verdict.ONLY_COPY, Verdict.REUSED):
        assert kept(v) == Outcome(None, Count.REFUSED)
    for v in (Verdict.DROP, Verdict.ASK_REDIS):
        with pytest.raises(ValueError):
            kept(v)


def test_redis_answering_before_the_last_copy_goes() -> None:
    assert asked_redis(True) == (True, None)
    assert asked_redis(False) == (False, False), "gone from Redis: the record is forgotten"
    assert asked_redis(ConnectionError("down")) == (False, None), "an error means no, and is no news"


def test_every_count_is_a_tier_counter() -> None:
    ints = {f.name for f in fields(TierCounters) if f.type == "int"}
    assert {c.value for c in Count} <= ints
    c = TierCounters()
    for what in Count:
        c.add(what)
    assert all(getattr(c, what.value) == 1 for what in Count) and c.hits == 0
