"""Fair share's pure rules (kvtier/core/tenants.py) and the put's tenant on the wire. The rules
at work inside the policy are checked by the policy state machine (test_policy_state.py: no
tenant within its share sheds, or makes room, while another is over)."""

from __future__ import annotations

import pytest

from kvtier.bus.codec import decode, encode
from kvtier.core.events import Envelope, Put, StagedBlock, Tier
from kvtier.core.index import TierIndex
from kvtier.core.policy import Placement
from kvtier.core.tenants import COUNTED, TenantRules, TenantUsage
from tests.support.placement import knobs

CPU = Tier.CPU


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def usage(rules: TenantRules, held: dict[str, int]) -> TenantUsage:
    u = TenantUsage(rules)
    n = 0
    for who, count in held.items():
        for _ in range(count):
            n += 1
            u.claim(key(n), who)
            u.added(CPU, key(n))
    return u


def test_shares_follow_the_weights_of_the_tenants_present() -> None:
    u = usage(TenantRules(weights={"a": 3.0}), {"a": 10, "b": 10})
    assert u.share(CPU, "a", 100) == 75 and u.share(CPU, "b", 100) == 25
    assert u.share(CPU, "newcomer", 100) == 20  # a tenant putting its first block counts as present
    assert u.excess(CPU, 20) == {"b": 5}  # b holds 10 of a 5-block share; a holds 10 of 15


def test_a_cap_makes_a_tenant_over_and_bounds_its_puts() -> None:
    u = usage(TenantRules(caps={"batch": 4}), {"batch": 6, "web": 1})
    assert u.excess(CPU, 100) == {"batch": 2}
    assert u.allowance(CPU, "batch") == 0 and u.allowance(CPU, "web") is None
    assert usage(TenantRules(caps={"batch": 4}), {"batch": 1}).allowance(CPU, "batch") == 3


def test_shedding_takes_only_from_tenants_over_their_share_each_up_to_its_excess() -> None:
    u = usage(TenantRules(), {"hot": 2, "flood": 8})  # coldest first: hot's two, then flood's
    order = list(u.shed_order(CPU, [key(i) for i in range(1, 11)], 10))
    assert order == [key(i) for i in range(3, 6)], "flood's 3 over its 5-block share; hot's none"
    assert u.evictable(CPU, 10) == {"flood"}
    even = usage(TenantRules(), {"hot": 5, "flood": 5})
    assert list(even.shed_order(CPU, [key(1), key(9)], 10)) == [key(1), key(9)] and even.evictable(CPU, 10) is None


def test_a_block_belongs_to_whoever_put_it_first_and_is_forgotten_when_gone() -> None:
    u = TenantUsage()
    u.claim(key(1), "a")
    u.claim(key(1), "b")
    assert u.owner(key(1)) == "a"
    u.added(CPU, key(1))
    u.hit(key(1))
    u.removed(CPU, key(1), evicted=True)
    u.forget(key(1))
    assert u.owner(key(1)) == "" and len(u) == 0 and u.blocks[CPU] == {}
    assert u.counters(10) == {"a": {"hits": 1, "evicted": 1}}


def test_counters_are_bounded_however_many_tenants_come_and_go() -> None:
    u = TenantUsage()
    for i in range(COUNTED + 50):
        u.claim(key(i), f"t{i}")
        u.hit(key(i))
    assert len(u.hits) == COUNTED + 1 and u.hits["other"] == 50  # the first COUNTED by name, then "other"


def test_hits_of_a_batch_count_as_each_hit_would_past_the_bound_too() -> None:
    """hit_many (a read report's keys at once) against hit, key by key: the same counters, with
    the first COUNTED owners named and the rest as "other", unowned blocks as the default."""
    one, many = TenantUsage(), TenantUsage()
    for u in (one, many):
        for i in range(COUNTED + 30):
            u.claim(key(i), f"t{i % (COUNTED + 10)}")
    batch = [key(i) for i in range(COUNTED + 30)] + [key(5), key(10 ** 6), key(COUNTED + 3)]
    for k in batch:
        one.hit(k)
    many.hit_many(batch[:7])
    many.hit_many(batch[7:])
    assert many.hits == one.hits
    assert many.hits["t5"] == 3 and "" not in many.hits and many.hits["other"] == 12  # past the bound: unowned too


def test_rules_refuse_nonsense_and_aliases_rename() -> None:
    with pytest.raises(ValueError):
        TenantRules(weights={"a": 0})
    with pytest.raises(ValueError):
        TenantRules(caps={"a": -1})
    rules = TenantRules(aliases={"lora:sql": "acme"})
    p = Placement("p", {CPU: TierIndex(4), Tier.GPU: TierIndex(0), Tier.REDIS: TierIndex(None)}, knobs(),
                  tenant_rules=rules)
    p.on_put([key(1)], None, 0.0, tenant="lora:sql")
    assert p.tenants.owner(key(1)) == "acme"


def test_a_capped_tenant_gets_no_more_slots_than_its_cap_leaves() -> None:
    p = Placement("p", {CPU: TierIndex(8), Tier.GPU: TierIndex(0), Tier.REDIS: TierIndex(None)}, knobs(),
                  tenant_rules=TenantRules(caps={"batch": 2}))
    tiers, _ = p.on_put([key(i) for i in range(1, 5)], None, 0.0, tenant="batch")
    assert tiers == [CPU, CPU, Tier.REDIS, Tier.REDIS]


def test_the_tenant_is_a_late_field_of_put_left_out_when_empty() -> None:
    block = StagedBlock(key=key(1), parent=None, slot=0, gen=1)
    plain = Envelope(Put("p", "seg", (block,)), "c", 1, 1)
    assert b"tenant" not in encode(plain), "an older daemon must still read a put without a tenant"
    assert decode(encode(plain)).event.tenant == ""
    named = Envelope(Put("p", "seg", (block,), tenant="acme"), "c", 1, 2)
    assert decode(encode(named)).event.tenant == "acme"


def test_status_and_the_snapshot_show_the_tenants_with_the_most_bytes_and_the_rest_as_other() -> None:
    from kvtier.daemon.snapshot import TOP_TENANTS, tenants_snapshot
    from kvtier.status import render_status

    u = TenantUsage()
    for t in range(TOP_TENANTS + 3):  # tenant t holds t + 1 blocks, read once each
        for i in range(t + 1):
            u.claim(key(100 * t + i), f"tenant-{t}")
            u.added(CPU, key(100 * t + i))
            u.hit(key(100 * t + i))
    snap = tenants_snapshot(u.counters(1024))
    assert len(snap) == TOP_TENANTS + 1 and snap["tenant-10"] == {"cpu_bytes": 11 * 1024, "hits": 11}
    assert snap["other"] == {"cpu_bytes": (1 + 2 + 3) * 1024, "hits": 1 + 2 + 3}  # the three smallest
    tier = {"blocks": 0, "capacity": 4, "bytes": 0, "capacity_bytes": 4 << 20}
    pool = {"block_bytes": 1024, "puts": 0, "puts_dropped": 0, "misses": 0, "redis_corrupt": 0,
            "tiers": {"cpu": tier}, "tenants": snap}
    assert "tenant-10 11 KiB hits 11 evicted 0" in render_status({"node": "n", "pid": 1, "pools": {"p": pool}})
    pool["tenants"] = {"": {"cpu_bytes": 1024}}  # the default tenant alone: no line
    assert "tenants" not in render_status({"node": "n", "pid": 1, "pools": {"p": pool}})


def test_blocks_already_leaving_count_against_a_tenants_excess() -> None:
    """Shedding decided last round is still counted until the worker acts: a second round must
    not take the same excess again (it would push that tenant below its share)."""
    u = usage(TenantRules(), {"hot": 2, "flood": 8})
    order = list(u.shed_order(CPU, [key(i) for i in range(1, 11)], 10, leaving=[key(9), key(10)]))
    assert order == [key(3)], "flood's excess of 3, two of it on their way out already"


def test_an_undone_put_forgets_its_owner_and_one_gone_but_coming_back_keeps_it() -> None:
    from kvtier.core.events import Store

    p = Placement("p", {CPU: TierIndex(4), Tier.GPU: TierIndex(4), Tier.REDIS: TierIndex(None)}, knobs())
    [t], _ = p.on_put([key(1)], None, 0.0, tenant="a")
    p.revert([Store("p", t, key(1), None, "seg", 0, 1)])  # never published
    p.on_put([key(1)], None, 1.0, tenant="b")
    assert p.tenants.owner(key(1)) == "b"
    assert p.reserve(Tier.GPU, key(2), None) is not None
    p.tenants.claim(key(2), "c")
    p._incoming[CPU].add(key(2), None, 100.0)  # on its way down into cpu as its gpu copy goes
    p.dropped(Tier.GPU, key(2))
    assert p.tenants.owner(key(2)) == "c"
