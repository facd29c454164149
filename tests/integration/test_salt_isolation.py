"""Tenant isolation: a block stored under salt A is never a hit under any other salt (or LoRA id),
in any tier (gpu, cpu, Redis), on the node that stored it or on another node sharing its Redis.

Each negative check comes with a positive control on the same path (salt A does hit), so a
zero means isolation, not a broken test.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.client import Client
from kvtier.core.events import Tier
from kvtier.store.redis_blocks import redis_block_key
from tests.support.blocks import SHAPE, make_kv, put_chain, same_bytes
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

SALT_A = b"tenant-a"
# Other tenants over the same tokens: another salt, no salt, the empty salt (distinct from none),
# salts that extend or truncate A's bytes, and A's salt with a LoRA id.
OTHERS = [(b"tenant-b", None), (None, None), (b"", None), (SALT_A + b"\x00", None), (SALT_A[:-1], None),
          (SALT_A, "lora-1")]
CHAINS, BLOCKS = 8, 4  # 32 blocks into 4 gpu + 8 cpu slots: most end up in Redis only
SENTINEL = 7.0


def tokens(c: int) -> list[int]:
    return [50_000 + c * 1000 + i for i in range(16 * BLOCKS)]


def redis_only(client: Client, chains, r) -> list[int]:
    return [c for c, keys in enumerate(chains)
            if all(client.lookup("t", [k]).length == 0 and r.exists(redis_block_key("t", k)) for k in keys)]


def missed_in_redis(daemon, key: bytes) -> bool:
    """The daemon tried to promote `key` from Redis and found no valid copy there."""
    tag = f'"key": "{key.hex()[:16]}"'
    return any(tag in line and '"source_miss"' in line and '"promote"' in line
               for line in daemon.log_tail(1 << 20).splitlines())


def redis_hexes(r) -> set[str]:
    return {k.decode().rsplit(":", 1)[1] for k in r.scan_iter(match="kvtier:blk:t:*", count=1000)}


async def no_hit_under_other_salts(client: Client, r) -> int:
    """Check every other namespace over every chain's tokens; returns how many keys were checked."""
    a_keys = {k for c in range(CHAINS) for k in client.block_keys("t", tokens(c), salt=SALT_A)}
    in_redis = redis_hexes(r)
    assert in_redis <= {k.hex() for k in a_keys}, "only salt A's blocks were ever written"
    checked = 0
    for c in range(CHAINS):
        for salt, lora in OTHERS:
            keys = client.block_keys("t", tokens(c), salt=salt, lora_id=lora)
            assert len(keys) == BLOCKS and not set(keys) & a_keys, (salt, lora)
            assert client.lookup("t", keys).length == 0
            found = await client.locate("t", keys)
            assert (found.length, found.redis_length) == (0, 0), (salt, lora, found)
            out = torch.full((BLOCKS, *SHAPE), SENTINEL, dtype=torch.float16)
            assert await client.get("t", keys, out) == 0
            assert torch.all(out == SENTINEL)
            for k in keys:  # each block alone, not only as a prefix
                assert client.lookup("t", [k]).length == 0
                assert (await client.locate("t", [k])).redis_length == 0
                assert await client.get("t", [k], out) == 0
                assert k.hex() not in in_redis
                checked += 1
    return checked


async def test_salt_a_blocks_never_hit_under_other_salts_in_any_tier(daemon_factory, redis_server):
    a = daemon_factory(node="salt-a", gpu=4, cpu=8, log_level="debug")  # a line per failed transfer
    r = redis_server.client()
    try:
        async with await Client.connect(a.runtime_dir) as ca:
            kvs = [make_kv(BLOCKS, seed=300 + c) for c in range(CHAINS)]
            chains = [ca.block_keys("t", tokens(c), salt=SALT_A) for c in range(CHAINS)]
            for keys, kv in zip(chains, kvs):
                await put_chain(ca, keys, kv)

            def tiers_holding_a() -> set[str]:
                where = set()
                for keys in chains:
                    for k in keys:
                        hit = ca.lookup("t", [k])
                        if hit.length:
                            where.add(hit.tiers[0].label)
                        if r.exists(redis_block_key("t", k)):
                            where.add(Tier.REDIS.label)
                return where

            # Salt A is in every tier at once (some blocks demoted to Redis by the later puts).
            await async_wait_until(lambda: tiers_holding_a() == {"gpu", "cpu", "redis"}, timeout=20,
                                   message="salt A blocks in gpu, cpu and redis")
            # Positive controls: salt A hits locally, byte-exact, and a chain of it is in Redis only.
            best = max(range(CHAINS), key=lambda c: ca.lookup("t", chains[c]).length)
            out = torch.empty((BLOCKS, *SHAPE), dtype=torch.float16)
            got = await ca.get("t", chains[best], out)
            assert got >= 1 and same_bytes(out[:got], kvs[best][:got])
            remote = (await async_wait_until(lambda: redis_only(ca, chains, r), timeout=15,
                                             message="a salt A chain in Redis only"))[0]
            assert (await ca.locate("t", chains[remote])).redis_length == BLOCKS

            checked = await no_hit_under_other_salts(ca, r)
            assert checked == CHAINS * len(OTHERS) * BLOCKS

            # A prefetch under another salt brings nothing in: the daemon looks each key up in
            # Redis and finds nothing (its log says so per key), and nothing becomes resident.
            b_keys = ca.block_keys("t", tokens(remote), salt=b"tenant-b")
            await ca.prefetch("t", b_keys)
            await async_wait_until(lambda: all(missed_in_redis(a, k) for k in b_keys), timeout=10,
                                   message="every salt B promote found nothing in Redis")
            assert ca.lookup("t", b_keys).length == 0
            assert (await ca.locate("t", b_keys)).redis_length == 0
            await no_hit_under_other_salts(ca, r)

        # A second node on the same Redis: salt A is shared with it, nothing else is.
        b = daemon_factory(node="salt-b", gpu=4, cpu=8, log_level="debug")
        async with await Client.connect(b.runtime_dir) as cb:
            await no_hit_under_other_salts(cb, r)
            c = redis_only(cb, chains, r)[0]  # at least chain `remote`: promotes copy, Redis keeps it
            other = cb.block_keys("t", tokens(c), salt=b"tenant-b")
            await cb.prefetch("t", other)
            await cb.prefetch("t", chains[c])  # positive control: node B's cpu tier has room for it
            assert await cb.wait_resident("t", chains[c], timeout=10)
            await async_wait_until(lambda: all(missed_in_redis(b, k) for k in other), timeout=10,
                                   message="every salt B promote on node B found nothing in Redis")
            out = torch.empty((BLOCKS, *SHAPE), dtype=torch.float16)
            assert await cb.get("t", chains[c], out) == BLOCKS and same_bytes(out, kvs[c])
            assert cb.lookup("t", other).length == 0
            await no_hit_under_other_salts(cb, r)
        assert a.alive and b.alive
    finally:
        r.close()
