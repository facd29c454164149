"""Fair share on a real daemon and redis-server (kvtier/core/tenants.py): one tenant writes ten
times its share of the cpu tier while another replays a hot prefix, and the hot tenant's local
hit rate stays within 10% of its rate with no flood. Without fair share the flood, which
outruns the replays, pushes the hot prefix out of the tier (plain LRU)."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from kvtier.client import Client
from tests.support.blocks import SHAPE, make_kv, put_chain
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

CPU = 32  # slots; two tenants present, so a share is 16
HOT = 8  # the hot prefix's blocks, within the hot tenant's share
THROUGH = '[policy]\nredis_write = "write-through"\n'


async def replay(c: Client, keys) -> int:
    """Read the hot prefix as an engine would: its locally cached head, read (and reported)."""
    n = c.lookup("t", keys).length
    if n:
        out = torch.empty((n, *SHAPE), dtype=torch.float16)
        assert await c.get("t", keys[:n], out) == n
    return n


async def test_a_flood_from_one_tenant_leaves_anothers_hot_prefix_alone(daemon_factory):
    d = daemon_factory(node="a", gpu=0, cpu=CPU, extra=THROUGH)
    async with await Client.connect(d.runtime_dir) as c:
        hot = c.block_keys("t", list(range(16 * HOT)), salt=b"hot")
        await put_chain_as(c, hot, make_kv(HOT, seed=1), "hot")
        # Hit rate with no flood.
        quiet = [await replay(c, hot) for _ in range(5)]
        base = sum(quiet) / (HOT * len(quiet))
        assert base == 1.0, quiet

        # The flood: 10x the flood tenant's share, in chains of 4; a replay after each 40 blocks,
        # more than the whole tier, so LRU alone would have pushed the hot prefix out by then.
        flooded = []
        for i in range(40):
            keys = c.block_keys("t", list(range(64)), salt=b"flood%d" % i)
            await put_chain_as(c, keys, make_kv(4, seed=100 + i), "flood")
            if i % 10 == 9:
                flooded.append(await replay(c, hot))
        rate = sum(flooded) / (HOT * len(flooded))
        assert rate >= base - 0.10, f"hot tenant's hit rate {rate:.0%} under the flood, {base:.0%} without"

        await async_wait_until(lambda: tenants(d).get("flood", {}).get("evicted", 0) > 0, timeout=10,
                               message="the flood's own blocks evicted")
        t = tenants(d)
        assert t["hot"].get("evicted", 0) == 0 and t["hot"]["cpu_bytes"] == HOT * d.pool_stats()["block_bytes"], t
        reads = HOT * (len(quiet) + len(flooded))
        await async_wait_until(lambda: tenants(d)["hot"].get("hits", 0) >= reads, timeout=10,
                               message="the hot tenant's reads counted")
        assert t["flood"]["cpu_bytes"] <= CPU * d.pool_stats()["block_bytes"], t
        metrics = urllib.request.urlopen(d.stats()["metrics_url"], timeout=5).read().decode()
        assert 'kvtier_tenant_bytes{pool="t",tenant="hot",tier="cpu"}' in metrics
        assert 'kvtier_tenant_evictions_total{pool="t",tenant="flood"}' in metrics


def tenants(d) -> dict:
    return d.pool_stats().get("tenants") or {}


async def put_chain_as(c: Client, keys, kv, tenant: str) -> None:
    """put_chain, as `tenant`."""
    res = await c.put("t", keys, kv, tenant=tenant)
    assert res.dropped == 0
    await put_chain(c, keys, kv)  # a duplicate put: waits until all of it is stored
