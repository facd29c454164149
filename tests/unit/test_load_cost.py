"""The load-or-recompute rule (kvtier/core/load_cost.py)."""

from __future__ import annotations

import pytest

from kvtier.core.load_cost import LoadCosts, MovingRate

MIB = 1 << 20


def costs(**kw) -> LoadCosts:
    return LoadCosts(block_bytes=MIB, block_tokens=32, **kw)


def test_before_anything_is_measured_every_block_loads_with_the_ceiling_as_deadline():
    p = costs(ceiling_s=5.0).plan(10, 6)
    assert (p.local, p.remote, p.not_worth, p.deadline_s) == (10, 6, 0, 5.0)


def test_redis_blocks_slower_than_their_recompute_are_left_out():
    c = costs()
    c.observe_prefill(3200, 1.0)  # 100 blocks/s: 10 ms a block
    c.observe_load(100, 0, 0.01)  # shm: 0.1 ms a block
    c.observe_load(0, 10, 0.2)  # Redis: 20 ms a block, twice the recompute
    p = c.plan(8, 4)
    assert (p.local, p.remote, p.not_worth) == (8, 0, 4)
    assert p.deadline_s == pytest.approx(8 * 0.01)  # what recomputing the 8 blocks would take


def test_a_fast_redis_is_loaded_and_given_until_recomputing_would_be_done():
    c = costs(floor_s=0.001)
    c.observe_prefill(320, 1.0)  # 100 ms a block
    c.observe_load(10, 0, 0.01)  # 1 ms a block from shm
    c.observe_load(10, 10, 0.01 + 0.1)  # the Redis share: 0.1 s for 10 blocks
    assert c.redis.value == pytest.approx(10 * MIB / 0.1)
    p = c.plan(4, 6)
    assert (p.local, p.remote, p.not_worth) == (4, 6, 0)
    assert p.deadline_s == pytest.approx(10 * 0.1)  # recomputing 10 blocks; 3 x the estimate is less


def test_on_a_busy_machine_slack_over_the_estimate_can_outlast_the_recompute_figure():
    c = costs(floor_s=0.001, margin=1.0, slack=3.0)
    c.observe_prefill(3200, 1.0)  # 10 ms a block
    c.observe_load(10, 0, 0.08)  # 8 ms a block: it pays, barely
    assert c.plan(5, 0).deadline_s == pytest.approx(3 * 5 * 0.008)


def test_the_deadline_has_a_floor_and_a_ceiling():
    c = costs(ceiling_s=0.5)
    c.observe_prefill(32_000, 1.0)  # 1 ms a block
    assert c.plan(4, 0).deadline_s == pytest.approx(c.floor_s)  # recomputing 4 ms: the floor
    assert c.plan(1000, 0).deadline_s == 0.5  # recomputing 1 s: the ceiling
    assert costs(ceiling_s=0.5).plan(4, 0).deadline_s == 0.5  # no prefill figure yet: the ceiling


def test_when_shared_memory_does_not_pay_nothing_after_it_loads():
    c = costs()
    c.observe_prefill(32_000, 1.0)  # 1 ms a block
    c.observe_load(1, 0, 0.01)  # 10 ms a block from shm
    p = c.plan(3, 5)
    assert (p.local, p.remote, p.not_worth) == (0, 0, 8)


def test_the_moving_rate_follows_new_figures_and_ignores_empty_ones():
    r = MovingRate(weight=0.5)
    r.observe(0, 1.0)
    r.observe(10, 0)
    assert r.value is None
    r.observe(100, 1.0)
    r.observe(200, 1.0)
    assert r.value == pytest.approx(150)
