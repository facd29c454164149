"""Session pins (issue 32) on a real daemon and redis-server: a pinned chain stays on the node
through a flood of puts that evicts an unpinned one, its Redis copies are kept at least as long
as the pin, pins end when let go or when they expire, and budgets refuse what is over them,
counted, logged and shown in stats and metrics."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvtier.client import Client
from kvtier.errors import BadRequest
from kvtier.store.redis_blocks import redis_block_key
from tests.support.blocks import make_kv, put_chain
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

BLOCK = 8192  # the test pool's block bytes
THROUGH = '[policy]\nredis_write = "write-through"\n'


def pins(d) -> dict:
    return d.pool_stats().get("pins") or {}


def resident(client: Client, keys) -> int:
    return client.lookup("t", keys).length


async def flood(client: Client, salt: bytes, chains: int, n: int = 4) -> None:
    """Puts of `chains` new chains of n blocks, each stored before the next (the cpu tier sheds meanwhile)."""
    for i in range(chains):
        keys = client.block_keys("t", list(range(16 * n)), salt=salt + b"%d" % i)
        await put_chain(client, keys, make_kv(n, seed=100 + i))


async def test_a_pinned_chain_outlives_a_flood_that_evicts_an_unpinned_one(daemon_factory, redis_server):
    d = daemon_factory(node="a", gpu=0, cpu=16, extra=THROUGH)
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as c:
        kept = c.block_keys("t", list(range(64)), salt=b"agent")
        other = c.block_keys("t", list(range(64)), salt=b"no-pin")
        await put_chain(c, kept, make_kv(4, seed=1))  # the colder of the two: shed first, were it not pinned
        await put_chain(c, other, make_kv(4, seed=2))
        await async_wait_until(lambda: all(r.exists(redis_block_key("t", k)) for k in kept), timeout=10,
                               message="written through to redis")
        r.expire(redis_block_key("t", kept[0]), 5)  # a Redis copy about to expire: the pin keeps it
        await c.pin("t", kept, 100, tenant="agent-1")
        await async_wait_until(lambda: pins(d).get("blocks") == 4 and pins(d).get("retained") == 4, timeout=10,
                               message="pinned, and the Redis copies retained")
        assert pins(d)["tenants"] == {"agent-1": 4} and pins(d)["bytes"] == 4 * BLOCK
        assert 90 <= r.ttl(redis_block_key("t", kept[0])) <= 100
        assert r.ttl(redis_block_key("t", kept[1])) > 100  # a longer time to live is never shortened

        await flood(c, b"flood", 10)
        await async_wait_until(lambda: resident(c, other) == 0, timeout=15,
                               message="the flood evicted the unpinned chain")
        assert resident(c, kept) == 4, "the pinned chain is still on the node"
        assert d.pool_stats()["tiers"]["cpu"]["evicted"] >= 4

        await c.pin("t", kept, 0, tenant="someone-else")  # not theirs to let go
        await c.pin("t", kept, 0, tenant="agent-1")
        await async_wait_until(lambda: pins(d).get("blocks") == 0, timeout=10, message="let go")
        assert pins(d)["released"] == 4 and pins(d)["tenants"] == {}
        await flood(c, b"again", 10)
        await async_wait_until(lambda: resident(c, kept) == 0, timeout=15, message="evicted once let go")
        assert all(r.exists(redis_block_key("t", k)) for k in kept), "evicted from the node, kept in Redis"
    r.close()


async def test_budgets_refuse_what_is_over_them_and_pins_expire(daemon_factory):
    budget = '[pins]\nbudget_bytes = "24KiB"\nnode_share = 0.5\n'  # 3 blocks a tenant; 8 of the node's 16 slots
    d = daemon_factory(node="a", gpu=0, cpu=16, extra=THROUGH + budget)
    async with await Client.connect(d.runtime_dir) as c:
        chains = [c.block_keys("t", list(range(80)), salt=b"t%d" % i) for i in range(4)]
        for i, keys in enumerate(chains[:3]):
            await put_chain(c, keys, make_kv(5, seed=i))
        await c.pin("t", chains[0], 60, tenant="t1")  # 5 blocks: 3 pinned, the tail refused
        await async_wait_until(lambda: pins(d).get("refused_budget") == 2, timeout=10, message="over t1's budget")
        assert pins(d)["tenants"] == {"t1": 3}
        await c.pin("t", chains[0][:3], 60, tenant="t2")  # pinned already: extended, charged to no one else
        await c.pin("t", chains[1][:3], 60, tenant="t2")
        await c.pin("t", chains[2][:3], 60)  # no tenant: its own budget; the node's share ends it at 8
        await async_wait_until(lambda: pins(d).get("refused_node") == 1, timeout=10, message="over the node's share")
        p = pins(d)
        assert p["tenants"] == {"t1": 3, "t2": 3, "": 2} and p["blocks"] == 8 and p["extended"] == 3
        assert "coordinator.pin_refused" in d.log_tail(200_000)
        metrics = urllib.request.urlopen(d.stats()["metrics_url"], timeout=5).read().decode()
        assert 'kvtier_pinned_blocks{pool="t",tenant="t1"} 3.0' in metrics
        assert 'kvtier_pins_total{outcome="refused_budget",pool="t"} 2.0' in metrics

        await c.pin("t", chains[3][:1], 60, tenant="t3")  # a chain not stored yet: pinned all the same
        await c.pin("t", chains[1][:3], 1, tenant="t2")  # extends nothing (60 s stands)
        await c.pin("t", chains[0][:3], 1, tenant="t1")
        stats_before = json.dumps(pins(d))
        await async_wait_until(lambda: pins(d).get("refused_node") == 2, timeout=10, message="t3 over the share")
        assert pins(d)["blocks"] == 8, stats_before


async def test_a_tenant_named_in_config_has_its_own_budget(daemon_factory):
    budget = '[pins]\nbudget_bytes = "16KiB"\ntenant_budget_bytes = { big = "32KiB", none = 0 }\n'  # 2, 4, 0 blocks
    d = daemon_factory(node="a", gpu=0, cpu=16, extra=THROUGH + budget)
    async with await Client.connect(d.runtime_dir) as c:
        keys = [c.block_keys("t", list(range(80)), salt=b"n%d" % i) for i in range(3)]
        for i, chain in enumerate(keys):
            await put_chain(c, chain, make_kv(5, seed=i))
        for chain, tenant in zip(keys, ("big", "small", "none")):
            await c.pin("t", chain, 60, tenant=tenant)
        await async_wait_until(lambda: pins(d).get("refused_budget") == 1 + 3 + 5, timeout=10,
                               message="each over its own budget")
        assert pins(d)["tenants"] == {"big": 4, "small": 2}


async def test_short_pins_expire_by_themselves(daemon_factory):
    d = daemon_factory(node="a", gpu=0, cpu=16, extra=THROUGH)
    async with await Client.connect(d.runtime_dir) as c:
        keys = c.block_keys("t", list(range(48)), salt=b"short")
        await put_chain(c, keys, make_kv(3, seed=3))
        await c.pin("t", keys, 1, tenant="brief")
        await async_wait_until(lambda: pins(d).get("pinned") == 3, timeout=10, message="pinned")
        await c.pin("t", keys, 2, tenant="brief")  # renewed: a second more
        # No event comes meanwhile: the pins end on time all the same (the stats chore expires them).
        await async_wait_until(lambda: pins(d).get("expired") == 3, timeout=15, message="expired")
        assert pins(d)["blocks"] == 0 and pins(d)["extended"] == 3


async def test_bad_pins_are_clear_errors(daemon_factory):
    d = daemon_factory(node="a", gpu=0, cpu=16)
    async with await Client.connect(d.runtime_dir) as c:
        keys = c.block_keys("t", list(range(16)), salt=b"bad")
        with pytest.raises(BadRequest, match="ttl_s must be an int"):
            await c.pin("t", keys, -1)
        with pytest.raises(BadRequest, match="ttl_s must be an int"):
            await c.pin("t", keys, 1.5)  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="tenant must be empty or a name"):
            await c.pin("t", keys, 10, tenant="a tenant\n")
        with pytest.raises(ValueError):
            await c.pin("t", [b"short"], 10)
