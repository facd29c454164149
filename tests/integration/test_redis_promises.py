"""The Redis tier's promises under write-through: every block a node stores reaches Redis, even
when a faster tier sheds it before its copy runs (issue 13)."""

from __future__ import annotations

import pytest
import torch

from kvtier.client import Client
from kvtier.store.redis_blocks import redis_block_key, unpack_block
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

# 2 MiB blocks, a gpu tier of 16 and a roomy cpu tier: the gpu tier sheds to cpu while the redis
# worker is still busy with the copies of the blocks it sheds.
BIG_POOL = """
[pools.t]
model = "wt"
layers = 16
kv_heads = 8
head_dim = 128
block_tokens = 32
dtype = "float16"
device = "cpu"
gpu_blocks = 16
cpu_blocks = 512
"""
PROMPTS, BLOCKS = 6, 32


async def test_write_through_copies_blocks_the_gpu_tier_shed_before_their_copy_ran(daemon_factory, redis_server):
    d = daemon_factory(pools_toml=BIG_POOL, extra='[policy]\nredis_write = "write-through"\n')
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir, staging_blocks=BLOCKS) as client:
        shape = client.pool("t").shape
        chains = []
        for p in range(PROMPTS):
            keys = client.block_keys("t", list(range(32 * BLOCKS)), salt=f"through-{p}".encode())
            kv = torch.randn((BLOCKS, *shape), generator=torch.Generator().manual_seed(p)).to(torch.float16)
            res = await client.put("t", keys, kv)
            assert res.staged == BLOCKS, res
            assert await client.wait_resident("t", keys, timeout=30)  # its staging slots are free again
            chains.append((keys, kv))
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: sum(r.exists(redis_block_key("t", k)) for k in every) == len(every),
                               timeout=20, message=f"all {len(every)} blocks written through to Redis")
        keys, kv = chains[0]
        fp, bb = client.pool("t").fingerprint, client.pool("t").block_bytes
        for i in (0, BLOCKS // 2, BLOCKS - 1):
            payload, _ = unpack_block(r.get(redis_block_key("t", keys[i])), fp, keys[i], bb)
            assert bytes(payload) == kv[i].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    # Every block was copied (some twice over: a copy that missed its source counts as failed).
    await async_wait_until(lambda: d.pool_stats()["tiers"]["redis"]["copied_in"] >= PROMPTS * BLOCKS, timeout=10,
                           message="the daemon's stats count every copy")
    print("redis copies failed (redone):", d.pool_stats()["tiers"]["redis"]["failed"])
    r.close()
