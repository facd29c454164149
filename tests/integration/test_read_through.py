"""Read-through (issue 14): `get(..., remote=True)` serves a whole prefix, the node's own blocks
from shared memory and the rest straight from Redis into the caller's tensor, verified; the
daemon hears of those reads and brings the blocks up. Faults: a corrupt value, a Redis that
hangs, credentials that may not read blocks."""

from __future__ import annotations

import pytest
import structlog
import torch

from kvtier.client import Client, SyncClient
from kvtier.store.redis_blocks import BLK_HDR, redis_block_key
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.fault_proxy import FaultProxy
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

THROUGH = '[policy]\nredis_write = "write-through"\n'
N = 6


async def chain_in_redis(client: Client, r, salt: bytes, n: int = N, seed: int = 1):
    keys = client.block_keys("t", list(range(16 * n)), salt=salt)
    kv = make_kv(n, seed=seed)
    assert (await client.put("t", keys, kv)).staged == n
    await async_wait_until(lambda: all(r.exists(redis_block_key("t", k)) for k in keys), timeout=10,
                           message="written through")
    return keys, kv


async def test_a_prefix_held_elsewhere_is_read_straight_from_redis_then_brought_up(daemon_factory, redis_server):
    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys, kv = await chain_in_redis(ca, r, b"far")
        out = torch.empty((N + 2, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out) == 0, "without remote=True: the local answer"
        assert await cb.get("t", keys + cb.block_keys("t", list(range(10**5, 10**5 + 32))), out, remote=True) == N
        assert same_bytes(out[:N], kv)
        assert cb.stats.remote_reads == N and cb.stats.remote_corrupt == 0
        # The daemon heard of the reads and brought the blocks up: the next get is local.
        assert await cb.wait_resident("t", keys, timeout=10)
        out2 = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out2) == N and same_bytes(out2, kv)
    # Both from one stats snapshot, waited for together: a snapshot written between the reads'
    # report (counted as the coordinator gets it) and the promotes' end holds the first alone.
    await async_wait_until(lambda: (s := b.pool_stats()).get("remote_reads", 0) >= N
                           and s["tiers"]["cpu"]["promoted_in"] >= N, timeout=10,
                           message="the reads counted by the daemon, and the blocks promoted")
    r.close()


async def test_the_local_head_comes_from_shared_memory_and_the_rest_from_redis(daemon_factory, redis_server):
    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys, kv = await chain_in_redis(ca, r, b"mixed")
        assert (await cb.put("t", keys[:2], kv[:2])).staged == 2  # node B computed the first two itself
        assert await cb.wait_resident("t", keys[:2], timeout=10)
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out, remote=True) == N and same_bytes(out, kv)
        assert cb.stats.remote_reads == N - 2, "only the part node B does not hold came from Redis"
    r.close()


async def test_a_prefix_alternating_between_shared_memory_and_redis_is_read_whole(daemon_factory, redis_server):
    """Issue 25: each block comes from wherever it is. Node B holds blocks 1 and 3 (and Redis no
    longer does: evicted there), Redis holds the others: one call reads all six, four of them
    from Redis, and locate counts all six. Before, both stopped after block 0."""
    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys, kv = await chain_in_redis(ca, r, b"alternating")
        for i in (1, 3):
            assert (await cb.put("t", keys[i:i + 1], kv[i:i + 1], parent=keys[i - 1])).staged == 1
        assert await cb.wait_resident("t", [keys[1], keys[3]], timeout=10)
        r.delete(redis_block_key("t", keys[1]), redis_block_key("t", keys[3]))
        found = await cb.locate("t", keys)
        assert (found.length, found.redis_length) == (0, N)
        # A block in neither place ends the run there.
        fourth = r.get(redis_block_key("t", keys[4]))
        r.delete(redis_block_key("t", keys[4]))
        assert (await cb.locate("t", keys)).redis_length == 4
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out, remote=True) == 4 and same_bytes(out[:4], kv[:4])
        assert cb.stats.remote_reads == 2, "blocks 1 and 3 came from shared memory"
        r.set(redis_block_key("t", keys[4]), fourth)
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out, remote=True) == N and same_bytes(out, kv)
        assert (await cb.locate("t", keys)).redis_length + cb.lookup("t", keys).length == N
    r.close()


async def test_a_long_read_through_goes_in_bounded_parts_and_stops_at_the_first_hole(daemon_factory, redis_server):
    """Values that cannot land in place need a buffer each: a read-through fetches a bounded part
    at a time (256 MiB; two blocks here), and fetches no part after the one where the run ends."""
    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys, kv = await chain_in_redis(ca, r, b"parts")
        cb._remote.part_bytes = 2 * kv[0].numel() * kv.element_size()
        # Which rows each part asks Redis for (a spy on the real fetch; Redis's own GET count also
        # moves with the daemon's promotions of the first read, so it cannot say this exactly).
        parts: list[list[int]] = []
        fetch = cb._remote._fetch

        async def spy(rb, pool, ks, rows, dest, executor, ok):
            parts.append(list(rows))
            return await fetch(rb, pool, ks, rows, dest, executor, ok)

        cb._remote._fetch = spy  # type: ignore[method-assign]
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out, remote=True) == N and same_bytes(out, kv)
        assert cb.stats.remote_reads == N and parts == [[0, 1], [2, 3], [4, 5]]
        parts.clear()
        more, kv2 = await chain_in_redis(ca, r, b"parts-corrupt", seed=2)
        name = redis_block_key("t", more[1])
        value = bytearray(r.get(name))
        value[BLK_HDR.size + 7] ^= 0xFF  # present (EXISTS says so) but corrupt: found only once read
        r.set(name, bytes(value))
        before = cb.stats.remote_reads
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", more, out, remote=True) == 1 and same_bytes(out[:1], kv2[:1])
        assert cb.stats.remote_reads - before == 1 and cb.stats.remote_corrupt == 1
        assert parts == [[0, 1]]  # the first part only: the run ended in it
    r.close()


async def test_a_corrupt_value_ends_the_prefix_is_counted_and_deleted(daemon_factory, redis_server):
    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys, kv = await chain_in_redis(ca, r, b"bad")
        name = redis_block_key("t", keys[3])
        value = bytearray(r.get(name))
        value[BLK_HDR.size + 100] ^= 0xFF  # one flipped payload byte
        r.set(name, bytes(value))
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out, remote=True) == 3 and same_bytes(out[:3], kv[:3])
        assert cb.stats.remote_corrupt == 1
        assert not r.exists(name), "the corrupt value was deleted"
    r.close()


async def test_a_hung_redis_costs_at_most_the_remote_timeout_and_the_local_answer_stands(daemon_factory,
                                                                                         redis_server):
    """The blocks live behind a proxy that stops answering (url); the bus is elsewhere (bus_url)."""
    proxy = FaultProxy(upstream_unix=str(redis_server.socket_path)).start()
    try:
        a = daemon_factory(node="a", extra=THROUGH)
        b = daemon_factory(node="b", redis_url=proxy.url, bus_url=redis_server.url)
        r = redis_server.client()
        async with await Client.connect(a.runtime_dir) as ca, \
                await Client.connect(b.runtime_dir, remote_timeout=0.5) as cb:
            keys, kv = await chain_in_redis(ca, r, b"hung")
            out = torch.empty((N, *SHAPE), dtype=torch.float16)
            assert await cb.get("t", keys, out, remote=True) == N, "through the proxy while it passes"
            assert same_bytes(out, kv)
            other, kv2 = await chain_in_redis(ca, r, b"hung-2", seed=2)
            proxy.set("blackhole")
            assert await cb.get("t", other, out, remote=True) == 0
            assert cb.stats.remote_failures >= 1
            proxy.set("pass")
            await async_wait_until(lambda: _reads_all(cb, other, kv2), timeout=20, message="Redis answers again")
        r.close()
    finally:
        proxy.set("pass")
        proxy.stop()


async def _reads_all(client: Client, keys, kv) -> bool:
    out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
    return await client.get("t", keys, out, remote=True) == len(keys) and same_bytes(out, kv)


async def test_credentials_that_may_not_read_blocks_fall_back_to_pulling_with_one_warning(daemon_factory,
                                                                                          redis_server):
    admin = redis_server.client()
    admin.acl_setuser("engine-ro", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-get"])
    try:
        a = daemon_factory(node="a", extra=THROUGH)
        b = daemon_factory(node="b")
        blocks_url = f"unix://engine-ro:pw@{redis_server.socket_path}"
        with structlog.testing.capture_logs() as logged:  # the client library logs through structlog here
            async with await Client.connect(a.runtime_dir) as ca, \
                    await Client.connect(b.runtime_dir, blocks_url=blocks_url) as cb:
                keys, kv = await chain_in_redis(ca, admin, b"acl")
                out = torch.empty((N, *SHAPE), dtype=torch.float16)
                assert await cb.get("t", keys, out, remote=True) == N and same_bytes(out, kv)
                keys2, kv2 = await chain_in_redis(ca, admin, b"acl-2", seed=2)
                assert await cb.get("t", keys2, out, remote=True) == N and same_bytes(out, kv2)
                assert cb.stats.remote_reads == 0, "nothing was read through: it was pulled"
        denied = [e for e in logged if e["event"] == "client.remote_read_denied"]
        assert len(denied) == 1 and "NOPERM" in denied[0]["error"], "one clear warning, not one per read"
    finally:
        admin.acl_deluser("engine-ro")
        admin.close()


def test_the_sync_client_reads_through_too(daemon_factory, redis_server):
    import asyncio

    a = daemon_factory(node="a", extra=THROUGH)
    b = daemon_factory(node="b")
    r = redis_server.client()

    async def put() -> tuple[list[bytes], torch.Tensor]:
        async with await Client.connect(a.runtime_dir) as ca:
            return await chain_in_redis(ca, r, b"sync")

    keys, kv = asyncio.run(put())
    with SyncClient(b.runtime_dir) as sb:
        out = torch.empty((N, *SHAPE), dtype=torch.float16)
        assert sb.get("t", keys, out) == 0
        assert sb.get("t", keys, out, remote=True) == N and same_bytes(out, kv)
    r.close()
