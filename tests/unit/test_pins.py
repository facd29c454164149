"""Session pins in the pure core (kvtier/core/pins.py) and what the policy does with them.

A Hypothesis state machine holds `Pins` to a plain model of the rules (budgets per tenant, the
node's share, extension, release, expiry); small cases show the policy keeping a pinned block on
the node (shedding, the make-room rule, the worker's evict verdict, a move decided before the
pin) and the wire form of a pin. The whole policy under pins is in tests/unit/test_policy_state.py."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.bus.codec import decode, encode
from kvtier.core.events import Demote, Envelope, Evict, Pin, Reason, Retain, Tier
from kvtier.core.eviction import Verdict, evict_verdict, room_victim
from kvtier.core.pins import PinRules, Pins
from kvtier.errors import MalformedEvent
from tests.support.placement import NOW, k, placement, put

BB = 100  # bytes per block in these tests
RULES = PinRules(budget_bytes=3 * BB, budgets={"big": 5 * BB, "none": 0}, max_ttl_s=50, node_share=0.5)
SLOTS = 12  # the node's slots: pins hold at most 6


class PinsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pins = Pins(RULES, BB, lambda: SLOTS)
        self.now = 0.0
        self.model: dict[bytes, tuple[float, str]] = {}  # key -> (until, tenant charged)

    @rule(first=st.integers(0, 9), n=st.integers(1, 6), tenant=st.sampled_from(["", "a", "big", "none"]),
          ttl=st.sampled_from([0, 1, 5, 20, 1000]))
    def pin(self, first, n, tenant, ttl) -> None:
        keys = [k(i) for i in range(first, first + n)]
        self.pins.expire(self.now)  # as the policy does before every decision
        self.model = {key: v for key, v in self.model.items() if v[0] > self.now}
        verdict = self.pins.pin(keys, tenant, ttl, self.now)
        if ttl == 0:  # let go of this tenant's own pins
            self.model = {key: v for key, v in self.model.items() if not (key in keys and v[1] == tenant)}
            assert verdict.pinned == () and verdict.refused == 0
            return
        until = self.now + min(ttl, RULES.max_ttl_s)
        done, reason = [], ""
        for key in keys:
            if key in self.model:
                self.model[key] = (max(until, self.model[key][0]), self.model[key][1])
            elif sum(t == tenant for _, t in self.model.values()) >= RULES.budget(tenant) // BB:
                reason = "budget"
                break
            elif len(self.model) >= RULES.node_share * SLOTS:
                reason = "node"
                break
            else:
                self.model[key] = (until, tenant)
            done.append(key)
        assert verdict.pinned == tuple(done) and verdict.reason == reason
        assert verdict.refused == len(keys) - len(done) and verdict.ttl_s == min(ttl, RULES.max_ttl_s)

    @rule(dt=st.sampled_from([0.5, 1.0, 5.0, 30.0]))
    def advance(self, dt) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        gone = set(self.pins.expire(self.now))
        assert gone == {key for key, (until, _) in self.model.items() if until <= self.now}
        self.model = {key: v for key, v in self.model.items() if key not in gone}

    @invariant()
    def same_as_the_model(self) -> None:
        live = {key: v for key, v in self.model.items()}
        assert {key: self.pins.until(key) for key in live} == {key: v[0] for key, v in live.items()}
        assert len(self.pins) == len(live)
        held: dict[str, int] = {}
        for _, tenant in live.values():
            held[tenant] = held.get(tenant, 0) + 1
        assert self.pins.held() == held
        assert all(n * BB <= RULES.budget(t) for t, n in held.items()) and len(live) <= SLOTS // 2


TestPins = PinsMachine.TestCase
TestPins.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_counts_say_what_happened() -> None:
    pins = Pins(RULES, BB, lambda: SLOTS)
    v = pins.pin([k(1), k(2), k(3), k(4)], "a", 10, NOW)  # budget 3: the tail refused
    assert (len(v.pinned), v.refused, v.reason) == (3, 1, "budget")
    pins.pin([k(1)], "b", 20, NOW)  # another tenant's pin extends it, charged to nobody new
    assert pins.until(k(1)) == NOW + 20 and pins.held() == {"a": 3}
    assert pins.release([k(1), k(2)], "b") == 0 and pins.release([k(1), k(2)], "a") == 2
    assert pins.expire(NOW + 10) == [k(3)]
    c = pins.counts
    assert (c.pinned, c.extended, c.refused_budget, c.released, c.expired) == (3, 1, 1, 2, 1)
    assert pins.pin([k(9)], "none", 10, NOW).reason == "budget"  # a budget of 0: no pins at all


def test_the_heap_of_extensions_stays_bounded() -> None:
    pins = Pins(RULES, BB, lambda: SLOTS)
    for i in range(1000):
        pins.pin([k(1)], "a", 10, NOW + i)
        pins.expire(NOW + i)
    assert len(pins._heap) <= 2 * len(pins) + 65 and pins.until(k(1)) == NOW + 999 + 10


# --- the policy keeps pinned blocks on the node -------------------------------------------------


def test_shedding_passes_over_a_pinned_block_and_takes_the_next() -> None:
    p = placement(gpu=0, cpu=4, high_watermark=0.5, low_watermark=0.5)
    put(p, Tier.CPU, [1, 2, 3, 4])
    verdict, retain = p.on_pin([k(1)], "a", 60, NOW)
    assert verdict.pinned == (k(1),) and retain == Retain(p.pool, (k(1),), 60)
    shed = p.pressure(NOW)
    assert {c.key for c in shed} == {k(2), k(3)} and all(isinstance(c, Demote) for c in shed)
    later = p.pressure(NOW + 61)  # the pin and the marks ended: k(1) is the coldest again
    assert k(1) not in p.pins and k(1) in {c.key for c in later}


def test_the_make_room_rule_takes_a_pinned_block_only_where_the_node_keeps_a_copy() -> None:
    p = placement(gpu=0, cpu=2, disk=2)
    put(p, Tier.CPU, [1, 2])
    for i in (1, 2):
        assert p.in_redis(k(i), None)
    p.on_pin([k(1)], "a", 60, NOW)
    assert room_victim(p, Tier.CPU) == (k(2), Verdict.ASK_REDIS)
    p.on_pin([k(2)], "a", 60, NOW)
    assert room_victim(p, Tier.CPU) is None, "both pinned, held only in Redis: no victim"
    put(p, Tier.DISK, [1])
    assert room_victim(p, Tier.CPU) == (k(1), Verdict.DROP), "a copy on disk stays on the node"


def test_a_pin_calls_off_a_move_off_the_node_and_the_worker_refuses_a_late_one() -> None:
    p = placement(gpu=0, cpu=2, high_watermark=0.5, low_watermark=0.5)
    put(p, Tier.CPU, [1, 2])
    assert p.in_redis(k(1), None)
    (evict,) = p.pressure(NOW)
    assert evict == Evict(p.pool, k(1), Tier.CPU, Reason.CLEAN)
    p.on_pin([k(1)], "a", 60, NOW)
    assert not p.tiers[Tier.CPU].get(k(1)).leaving
    assert evict_verdict(p, Tier.CPU, k(1), Reason.CLEAN) is Verdict.STALE
    # Marked leaving, then pinned without the policy hearing of it (the rule the worker applies):
    q = placement(gpu=0, cpu=2, high_watermark=0.5, low_watermark=0.5)
    put(q, Tier.CPU, [1, 2])
    assert q.in_redis(k(1), None) and q.pressure(NOW)
    q.pins.pin([k(1)], "a", 60, NOW)
    assert evict_verdict(q, Tier.CPU, k(1), Reason.CLEAN) is Verdict.BUSY


def test_a_pin_names_its_tenant_and_time_on_the_wire() -> None:
    ev = Pin("t", (k(1), k(2)), 120, "agent-7")
    assert decode(encode(Envelope(ev, "c", 1, 1))).event == ev
    assert decode(encode(Envelope(Pin("t", (k(1),), 5, ""), "c", 1, 2))).event.tenant == ""
    for bad in (Pin("t", (k(1),), -1, ""), Pin("t", (k(1),), 5, "two words"), Pin("t", (k(1),), 5, "x" * 200)):
        with pytest.raises(MalformedEvent):
            decode(encode(Envelope(bad, "c", 1, 3)))


def test_status_and_the_snapshot_show_pins_with_a_bounded_tenant_list() -> None:
    from kvtier.daemon.snapshot import TOP_TENANTS, pins_snapshot
    from kvtier.status import render_status

    pins = Pins(PinRules(budget_bytes=20 * BB), BB, lambda: 10_000)
    for t in range(TOP_TENANTS + 3):  # more tenants than get a name of their own
        pins.pin([k(100 * t + i) for i in range(t + 1)], f"tenant-{t}", 60, NOW)
    pins.pin([k(9999)], "", 60, NOW)
    snap = pins_snapshot(pins, retained=5, retain_errors=1)
    assert len(snap["tenants"]) == TOP_TENANTS + 1 and snap["tenants"]["tenant-10"] == 11
    assert snap["tenants"]["other"] == 1 + 1 + 2 + 3  # tenants 0 to 2 and the unnamed one: the smallest
    assert sum(snap["tenants"].values()) == snap["blocks"] == len(pins)
    tier = {"blocks": 0, "capacity": 4, "bytes": 0, "capacity_bytes": 4 << 20}
    pool = {"block_bytes": BB, "puts": 0, "puts_dropped": 0, "misses": 0, "redis_corrupt": 0,
            "tiers": {"cpu": tier}, "pins": snap}
    line = render_status({"node": "n", "pid": 1, "uptime_s": 3, "pools": {"p": pool}})
    assert f"pins   {len(pins)} blocks" in line and "tenant-10 11" in line and "1 Redis TTLs not lengthened" in line
