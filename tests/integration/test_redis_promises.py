"""The Redis tier's promises under write-through: every block a node stores reaches Redis, even
when a faster tier sheds it before its copy runs, and again after Redis lost it (issue 13)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.client import Client
from kvtier.store.redis_blocks import redis_block_key, unpack_block
from tests.support.blocks import SHAPE, make_kv
from tests.support.redis_proc import RedisProcess
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


# --- re-replication: blocks Redis lost are written again (core/resync.py) ----------------------

THROUGH = '[policy]\nredis_write = "write-through"\n'
FAST_RESYNC = "resync_interval_s = 0.2\nresync_keys = 64\n"


def all_in_redis(r, keys) -> bool:
    return all(r.exists(redis_block_key("t", k)) for k in keys)


async def _put_and_replicate(client: Client, r, salt: bytes, n: int = 6) -> list:
    keys = client.block_keys("t", list(range(16 * n)), salt=salt)
    assert (await client.put("t", keys, make_kv(n, seed=len(salt)))).staged == n
    assert await client.wait_resident("t", keys, timeout=10)
    await async_wait_until(lambda: all_in_redis(r, keys), timeout=10, message="written through")
    return keys


@pytest.fixture
def own_redis(tmp_path):
    with RedisProcess.serving(tmp_path / "redis") as server:
        yield server


async def test_blocks_are_written_again_after_redis_restarts_empty(daemon_factory, own_redis):
    d = daemon_factory(redis_url=own_redis.url, extra=THROUGH, redis_extra=FAST_RESYNC)
    r = own_redis.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys = await _put_and_replicate(client, r, b"restart")
        own_redis.restart(kill=True)  # no persistence: it comes back empty
        r = own_redis.client()
        assert not any(r.exists(redis_block_key("t", k)) for k in keys)
        await async_wait_until(lambda: all_in_redis(r, keys), timeout=30, message="re-replicated after the restart")
    await async_wait_until(lambda: d.pool_stats()["resync_copies"] >= len(keys), timeout=10, message="counted")


async def test_blocks_redis_evicted_are_written_again(daemon_factory, redis_server):
    """Redis's own eviction, or a failover that lost the writes, looks the same from here: the keys are gone."""
    d = daemon_factory(extra=THROUGH, redis_extra=FAST_RESYNC)
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys = await _put_and_replicate(client, r, b"evicted")
        lost = keys[1::2]
        assert r.delete(*(redis_block_key("t", k) for k in lost)) == len(lost)
        await async_wait_until(lambda: all_in_redis(r, keys), timeout=30, message="the lost blocks are back")
        out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
        fp, bb = client.pool("t").fingerprint, client.pool("t").block_bytes
        payload, _ = unpack_block(r.get(redis_block_key("t", lost[0])), fp, lost[0], bb)
        assert await client.get("t", keys, out) == len(keys)
        assert bytes(payload) == out[1].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    r.close()


async def test_a_warm_arena_facing_a_new_redis_writes_its_blocks_there(daemon_factory, own_redis):
    d = daemon_factory(redis_url=own_redis.url, gpu=0, cpu=16, persist_arena=True, extra=THROUGH,
                       redis_extra=FAST_RESYNC)
    r = own_redis.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys = await _put_and_replicate(client, r, b"warm")
    assert d.stop() == 0
    own_redis.restart(kill=True)
    r = own_redis.client()
    d.start()
    try:
        assert "reattached" in d.log_tail(20000)
        await async_wait_until(lambda: all_in_redis(r, keys), timeout=30, message="the warm blocks reach the new Redis")
    finally:
        d.stop()
        Path(f"/dev/shm/kvtier.{d.node}.t.cpu").unlink(missing_ok=True)
