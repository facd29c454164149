"""Client.prepare_puts: a client that says it will put is granted cpu slots before its first put,
so that put writes every block straight into its final slot (one pass), where without it the
daemon learns of the client from that put and the put is staged (copied twice). A real daemon,
its stats and its streams."""

from __future__ import annotations

import pytest

from kvtier.client import Client
from kvtier.errors import UnknownPool
from tests.support.blocks import make_kv, same_bytes
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

BLOCKS = 16


@pytest.mark.parametrize("prepared", [False, True], ids=["first-put-staged", "prepared"])
async def test_a_prepared_client_puts_its_first_blocks_through_grants(daemon_factory, prepared):
    d = daemon_factory(node=f"prep{int(prepared)}", gpu=0, cpu=256, extra="grant_blocks = 64")
    async with await Client.connect(d.runtime_dir, staging_blocks=64) as client:
        if prepared:
            await client.prepare_puts("t")
            w = client.pool("t").stager()
            await async_wait_until(lambda: w.grants_waiting() >= BLOCKS, timeout=10,
                                   message="the daemon granted the prepared client's segment slots")
        keys = client.block_keys("t", list(range(16 * BLOCKS)))
        res = await client.put("t", keys, make_kv(BLOCKS, seed=1))
        assert res.staged == BLOCKS and res.dropped == 0, res
        assert await client.wait_resident("t", keys, timeout=10)
        got = await client.get("t", keys, out := make_kv(BLOCKS, seed=2))
        assert got == BLOCKS and same_bytes(out, make_kv(BLOCKS, seed=1)), "the bytes put come back"
    want = BLOCKS if prepared else 0
    wait_until(lambda: d.pool_stats().get("granted_puts") == want and d.pool_stats().get("puts") == BLOCKS,
               timeout=10, message=f"{want} of the first put's {BLOCKS} blocks through grants")


async def test_prepare_puts_names_a_pool_the_daemon_serves(daemon_factory):
    d = daemon_factory(node="prepbad", gpu=0, cpu=256)
    async with await Client.connect(d.runtime_dir) as client:
        with pytest.raises(UnknownPool, match="unknown pool 'no-such-pool'"):
            await client.prepare_puts("no-such-pool")
