"""kvtier on a real Redis Cluster (issue 13): blocks spread over every master, cross-node reuse,
resharding under load, a master killed, and failover to a replica; and on a master that
Sentinels watch, with a failover. Each test spawns its own servers (tests/support/redis_cluster.py,
tests/support/redis_sentinel.py) on free loopback ports."""

from __future__ import annotations

import asyncio

import pytest
import torch
from redis.crc import key_slot

from kvtier.client import Client
from kvtier.store.redis_blocks import redis_block_key
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_sentinel import SentinelSet
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

THROUGH = '[policy]\nredis_write = "write-through"\n'
BLOCKS = 4  # per chain


@pytest.fixture
def cluster(tmp_path):
    with RedisCluster.serving(tmp_path, masters=3) as c:
        yield c


def stream_tag(node: str) -> str:
    return f"kvtier:{{{node}}}:client"  # every stream of a node shares this slot


async def put_chains(client: Client, n: int, seed: int) -> list[tuple[list[bytes], torch.Tensor]]:
    chains = []
    for c in range(n):
        keys = client.block_keys("t", list(range(16 * BLOCKS)), salt=f"chain-{seed}-{c}".encode())
        kv = make_kv(BLOCKS, seed=seed * 1000 + c)
        assert (await client.put("t", keys, kv)).staged == BLOCKS
        chains.append((keys, kv))
    return chains


def in_redis(rc, keys) -> bool:
    return all(rc.exists(redis_block_key("t", k)) for k in keys)


async def read_remote(client: Client, keys, kv, timeout: float = 15) -> None:
    """Node-to-node reuse: Redis holds the chain, prefetch brings it here, get is byte-exact."""
    assert (await client.locate("t", keys)).redis_length == len(keys)
    await client.prefetch("t", keys)
    assert await client.wait_resident("t", keys, timeout=timeout)
    out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
    assert await client.get("t", keys, out) == len(keys)
    assert same_bytes(out, kv)


async def test_two_nodes_share_blocks_over_a_cluster_and_blocks_spread_over_every_master(daemon_factory, cluster):
    # Node A names the cluster; node B is pointed at one master with a plain redis:// URL, as a
    # new user would, and finds out it is a cluster node.
    a = daemon_factory(node="a", redis_url=cluster.url, extra=THROUGH)
    b = daemon_factory(node="b", redis_url=f"redis://{cluster.nodes[1].addr}")
    assert "redis.cluster_detected" in b.log_tail(20000)
    rc = cluster.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        chains = await put_chains(ca, 8, seed=1)
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: in_redis(rc, every), timeout=20, message="written through to the cluster")
        per_master = []
        for m in cluster.masters():
            with m.client() as mc:
                per_master.append(mc.dbsize())
        assert all(n > 0 for n in per_master), f"block keys spread over every master: {per_master}"
        for keys, kv in chains:
            await read_remote(cb, keys, kv)
    assert b.stop() == 0
    assert b.pool_stats()["tiers"]["cpu"]["promoted_in"] >= len(every)
    assert b.pool_stats()["redis_corrupt"] == 0
    rc.close()


async def test_a_session_pin_lengthens_the_ttl_of_blocks_on_every_master(daemon_factory, cluster):
    """Pins' Redis side on a cluster: each block's EXPIRE goes to the master that serves it."""
    a = daemon_factory(node="a", redis_url=cluster.url, extra=THROUGH, gpu=8, cpu=64)
    rc = cluster.client()
    async with await Client.connect(a.runtime_dir) as c:
        chains = await put_chains(c, 6, seed=7)
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: in_redis(rc, every), timeout=20, message="written through to the cluster")
        for k in every:
            rc.expire(redis_block_key("t", k), 5)  # copies about to expire
        for keys, _ in chains:
            await c.pin("t", keys, 300, tenant="agent")
        await async_wait_until(lambda: (a.pool_stats().get("pins") or {}).get("retained") == len(every), timeout=20,
                               message="every copy's TTL lengthened")
        assert a.pool_stats()["pins"]["retain_errors"] == 0
        ttls = [rc.ttl(redis_block_key("t", k)) for k in every]
        assert all(250 < t <= 300 for t in ttls), ttls
        assert len({cluster.owner_of(redis_block_key("t", k)).addr for k in every}) > 1, "one master holds them all"
    rc.close()


async def test_resharding_under_load_loses_nothing_and_reads_nothing_wrong(daemon_factory, cluster):
    """Slots move while node A puts and nodes B and C read through Redis: node A's own stream slot
    (its bus follows MOVED), and 1500 block slots held half-migrated while the load runs (puts and
    reads follow ASK), then handed over (MOVED)."""
    a = daemon_factory(node="a", redis_url=cluster.url, extra=THROUGH)
    b = daemon_factory(node="b", redis_url=cluster.url)
    c = daemon_factory(node="c", redis_url=cluster.url)
    rc = cluster.client()
    src = cluster.owner_of(stream_tag(a.node))
    dst = next(m for m in cluster.masters() if m is not src)
    tag = key_slot(stream_tag(a.node).encode())
    busy = {key_slot(stream_tag(n.node).encode()) for n in (b, c)}
    block_slots = [s for s in cluster.slots_of(src) if s != tag and s not in busy][:1500]
    moving = set(block_slots)
    async with (await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb,
                await Client.connect(c.runtime_dir) as cc):
        before = await put_chains(ca, 6, seed=2)
        await async_wait_until(lambda: in_redis(rc, [k for ks, _ in before for k in ks]), timeout=20,
                               message="the first chains written through")
        written: list[tuple[list[bytes], torch.Tensor]] = []
        window = {"open": False, "new_keys_in_moving_slots": 0, "old_chains_read": 0}
        done = asyncio.Event()

        async def load() -> None:
            seed = 100
            while not done.is_set():
                seed += 1
                (keys, kv), = await put_chains(ca, 1, seed=seed)
                await async_wait_until(lambda keys=keys: in_redis(rc, keys), timeout=20,
                                       message="a chain put mid-reshard")
                await read_remote(cb, keys, kv)
                written.append((keys, kv))
                if window["open"]:
                    window["new_keys_in_moving_slots"] += sum(
                        key_slot(redis_block_key("t", k).encode()) in moving for k in keys)
                    if window["old_chains_read"] < len(before):  # node C reads the old chains via ASK
                        keys0, kv0 = before[window["old_chains_read"]]
                        await read_remote(cc, keys0, kv0)
                        window["old_chains_read"] += 1

        def midway() -> None:
            window["open"] = True
            wait_until(lambda: window["new_keys_in_moving_slots"] >= 2 and window["old_chains_read"] == len(before),
                       timeout=60, interval=0.05, message="puts and reads while the slots are half-migrated")

        loader = asyncio.create_task(load())
        await asyncio.to_thread(cluster.move_slots, [tag], src, dst)
        moved = await asyncio.to_thread(cluster.move_slots, block_slots, src, dst, midway)
        rounds = len(written)
        await async_wait_until(lambda: len(written) >= rounds + 2, timeout=30, message="load after the reshard")
        done.set()
        await loader
        assert moved > 0, "the moved slots held block keys"
        assert cluster.owner_of(stream_tag(a.node)) is dst
        with dst.client() as d:
            assert sum(d.execute_command("CLUSTER", "COUNTKEYSINSLOT", s) for s in block_slots) > 0
        for keys, _kv in before + written:
            assert in_redis(rc, keys)
    for d in (a, b, c):
        assert d.alive and d.stop() == 0
        assert d.pool_stats()["redis_corrupt"] == 0
    # The half-migrated slots were really met: node A's writes and node C's reads of keys that
    # had moved were redirected (ASK), and followed.
    assert a.pool_stats()["redis_redirects"] > 0 and c.pool_stats()["redis_redirects"] > 0
    rc.close()


def daemon_with_bus(factory, cluster, on: bool, master, **kw):
    """A daemon whose streams live (`on`) or do not live on `master`. Node ids are random, so
    configs are made until one's stream slot falls where it should; only that one starts."""
    for _ in range(30):
        d = factory(start=False, redis_url=cluster.url, **kw)
        if (cluster.owner_of(stream_tag(d.node)) is master) == on:
            return d.start()
    raise AssertionError("no node id put its streams where the test needs them")


FAST_RESYNC = "resync_interval_s = 0.2\nresync_keys = 256\n"


async def test_a_master_killed_its_blocks_become_misses_the_others_keep_serving_and_the_bus_recovers(
        daemon_factory, cluster):
    victim = cluster.masters()[0]
    a = daemon_with_bus(daemon_factory, cluster, False, victim, node="a", cpu=64, extra=THROUGH,
                        redis_extra=FAST_RESYNC)  # it keeps every block, so it can write them again
    b = daemon_with_bus(daemon_factory, cluster, False, victim, node="b", cpu=64)  # room for every block
    c = daemon_with_bus(daemon_factory, cluster, True, victim, node="c")  # its bus is on the victim
    rc = cluster.client()
    async with (await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb,
                await Client.connect(c.runtime_dir) as cc):
        chains = await put_chains(ca, 8, seed=3)
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: in_redis(rc, every), timeout=20, message="written through")
        lost = {k for k in every if cluster.owner_of(redis_block_key("t", k)) is victim}
        assert lost and len(lost) < len(every), "the victim serves some of the blocks, not all"
        rc.close()

        victim.stop(kill=True)
        # Node B asks Redis: exactly the victim's blocks are absent, the others are there.
        for keys, _ in chains:
            assert await cb.present("t", keys) == [k not in lost for k in keys]
            first_lost = next((i for i, k in enumerate(keys) if k in lost), len(keys))
            assert (await cb.locate("t", keys)).redis_length == first_lost
        # Pulling everything: the other masters' blocks arrive and read byte-exact; the victim's
        # are failed transfers (misses), counted and logged; nothing wrong is read.
        await cb.prefetch("t", every)
        served = [(i, k) for keys, kv in chains for i, k in enumerate(keys) if k not in lost]
        await async_wait_until(lambda: all(cb.lookup("t", [k]).length for _, k in served), timeout=20,
                               message="the other masters' blocks pulled to node B")
        kv_of = {k: kv[i] for keys, kv in chains for i, k in enumerate(keys)}
        out = torch.empty((1, *SHAPE), dtype=torch.float16)
        for k in every:
            n = await cb.get("t", [k], out)
            assert n == (k not in lost)
            if n:
                assert same_bytes(out[0], kv_of[k])
        await async_wait_until(lambda: b.pool_stats()["tiers"]["cpu"]["failed"] >= len(lost), timeout=20,
                               message="node B counts the victim's blocks as failed pulls")
        assert b.pool_stats()["redis_errors"] >= len(lost)
        assert '"why": "redis"' in b.log_tail(200_000) and "tier.transfer_failed" in b.log_tail(200_000)

        # Node C's bus lives on the victim: it is down, the daemon stays up, and puts there are
        # dropped (said so), never stuck.
        await async_wait_until(lambda: "bus.redis_unavailable" in c.log_tail(100_000), timeout=20,
                               message="node C sees its bus down")
        keys_c = cc.block_keys("t", list(range(16 * BLOCKS)), salt=b"c-during")
        assert (await cc.put("t", keys_c, make_kv(BLOCKS, seed=7))).dropped == BLOCKS
        assert c.alive and a.alive and b.alive

        # The slot owner returns (empty: no persistence). Node C's bus recovers, node A writes
        # its lost blocks again (re-replication), and node B can read them.
        victim.start()
        await asyncio.to_thread(wait_until, cluster.healthy, 30, 0.1, "the cluster is whole again")
        keys_c = cc.block_keys("t", list(range(16 * BLOCKS)), salt=b"c-after")
        await async_wait_until(lambda: _put_lands(cc, keys_c), timeout=30, message="node C's bus serves again")
        rc = cluster.client()
        await async_wait_until(lambda: in_redis(rc, every), timeout=30, message="node A re-replicated the lost blocks")
        again = sorted(lost)
        assert not any(cb.lookup("t", [k]).length for k in again)
        await cb.prefetch("t", again)
        assert await cb.wait_resident("t", again, timeout=15)
        for k in again:
            assert await cb.get("t", [k], out) == 1 and same_bytes(out[0], kv_of[k])
    for d in (a, b, c):
        assert d.alive and d.stop() == 0
        assert d.pool_stats()["redis_corrupt"] == 0
    assert a.pool_stats()["resync_copies"] >= len(lost)
    rc.close()


async def _put_lands(client: Client, keys) -> bool:
    """A put is accepted and stored (False while the bus is still down: the put was dropped)."""
    res = await client.put("t", keys, make_kv(len(keys), seed=8))
    return res.staged == len(keys) and await client.wait_resident("t", keys, timeout=5)


@pytest.fixture
def replicated(tmp_path):
    with RedisCluster.serving(tmp_path, masters=3, replicas=1) as c:
        yield c


async def located(client: Client, keys) -> bool:
    return (await client.locate("t", keys)).redis_length == len(keys)


async def test_failover_to_a_replica_resumes_service_without_a_restart(daemon_factory, replicated):
    cluster = replicated
    b = daemon_factory(node="b", redis_url=cluster.url, cpu=64)
    victim = cluster.owner_of(stream_tag(b.node))  # node B's bus fails over with it
    a = daemon_with_bus(daemon_factory, cluster, False, victim, node="a", cpu=64, extra=THROUGH)
    rc = cluster.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        chains = await put_chains(ca, 8, seed=4)
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: in_redis(rc, every), timeout=20, message="written through")
        assert any(cluster.owner_of(redis_block_key("t", k)) is victim for k in every)
        rc.close()
        await asyncio.to_thread(cluster.wait_replicated, victim)
        replica = cluster.replica_of(victim)

        victim.stop(kill=True)
        await async_wait_until(lambda: replica.role() == "master", timeout=30, interval=0.1,
                               message="the replica took over")
        # Node B's bus is back on the new master (a put lands), and every block written before
        # the failover, the failed master's too, is read on node B byte-exact.
        keys_b = cb.block_keys("t", list(range(16 * BLOCKS)), salt=b"b-after-failover")
        await async_wait_until(lambda: _put_lands(cb, keys_b), timeout=30, message="node B's bus serves again")
        for keys, kv in chains:
            await async_wait_until(lambda keys=keys: located(cb, keys), timeout=20,
                                   message="node B sees the chain in Redis")
            await read_remote(cb, keys, kv)
        # New blocks from node A land on the new master too.
        (keys, kv), = await put_chains(ca, 1, seed=5)
        rc = cluster.client()
        await async_wait_until(lambda: in_redis(rc, keys), timeout=20, message="written after the failover")
        await read_remote(cb, keys, kv)
    for d in (a, b):
        assert d.alive and d.stop() == 0
        assert d.pool_stats()["redis_corrupt"] == 0
    rc.close()


# --- Sentinel: the same promises with a master and a replica that Sentinels watch ------------


@pytest.fixture
def sentinels(tmp_path):
    with SentinelSet.serving(tmp_path) as s:
        yield s


async def test_sentinel_failover_resumes_service_without_a_restart(daemon_factory, sentinels):
    a = daemon_factory(node="a", redis_url=sentinels.url, cpu=64, extra=THROUGH)
    b = daemon_factory(node="b", redis_url=sentinels.url, cpu=64)
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        chains = await put_chains(ca, 4, seed=6)
        every = [k for keys, _ in chains for k in keys]
        with sentinels.master.client() as r:
            await async_wait_until(lambda: in_redis(r, every), timeout=20, message="written through")
        keys0, kv0 = chains[0]
        await read_remote(cb, keys0, kv0)  # node-to-node through the Sentinel-managed master
        await asyncio.to_thread(sentinels.wait_replicated)

        old = sentinels.master.port
        sentinels.master.stop(kill=True)
        await async_wait_until(lambda: sentinels.master_port() != old, timeout=30, interval=0.1,
                               message="the Sentinels promoted the replica")
        assert sentinels.master_port() == sentinels.replica.port
        # Both daemons follow the new master: node B's bus serves (a put lands), it reads the
        # chains written before the failover, and node A's new writes reach the new master.
        keys_b = cb.block_keys("t", list(range(16 * BLOCKS)), salt=b"b-after-sentinel-failover")
        await async_wait_until(lambda: _put_lands(cb, keys_b), timeout=30, message="node B's bus serves again")
        for keys, kv in chains[1:]:
            await async_wait_until(lambda keys=keys: located(cb, keys), timeout=20, message="node B sees the chain")
            await read_remote(cb, keys, kv)
        (keys, kv), = await put_chains(ca, 1, seed=7)
        with sentinels.replica.client() as r:
            await async_wait_until(lambda: in_redis(r, keys), timeout=20, message="written to the new master")
        await read_remote(cb, keys, kv)
    for d in (a, b):
        assert d.alive and d.stop() == 0
        assert d.pool_stats()["redis_corrupt"] == 0


async def test_a_hung_master_costs_misses_not_the_other_masters_service(daemon_factory, cluster):
    """A master that answers nothing (SIGSTOP): its blocks time out once, then are failed at once
    while it stays marked down (store/master_health.py); the others' blocks arrive byte-exact; once
    it answers again, its blocks are read too."""
    victim = cluster.masters()[0]
    a = daemon_with_bus(daemon_factory, cluster, False, victim, node="a", cpu=64, extra=THROUGH)
    b = daemon_with_bus(daemon_factory, cluster, False, victim, node="b", cpu=64)
    rc = cluster.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        chains = await put_chains(ca, 8, seed=9)
        every = [k for keys, _ in chains for k in keys]
        await async_wait_until(lambda: in_redis(rc, every), timeout=20, message="written through")
        hung = [k for k in every if cluster.owner_of(redis_block_key("t", k)) is victim]
        served = [k for k in every if k not in hung]
        assert hung and served
        kv_of = {k: kv[i] for keys, kv in chains for i, k in enumerate(keys)}
        out = torch.empty((1, *SHAPE), dtype=torch.float16)
        cluster.hang(victim)
        try:
            await cb.prefetch("t", every)
            await async_wait_until(lambda: all(cb.lookup("t", [k]).length for k in served), timeout=30,
                                   message="the other masters' blocks, with one master hung")
            for k in served:
                assert await cb.get("t", [k], out) == 1 and same_bytes(out[0], kv_of[k])
            assert not any(cb.lookup("t", [k]).length for k in hung)

            async def skipped_once_marked_down() -> bool:
                await cb.prefetch("t", hung[:1])  # each failure keeps the master marked down longer
                return b.pool_stats()["redis_skipped"] > 0

            await async_wait_until(skipped_once_marked_down, timeout=60, interval=0.2,
                                   message="pulls from the hung master failed at once, not after a timeout")
            assert b.pool_stats()["tiers"]["cpu"]["failed"] >= len(hung)
        finally:
            cluster.hang(victim, False)
        await async_wait_until(lambda: _pulled(cb, hung), timeout=30, interval=0.2,
                               message="the master answers again: its blocks arrive")
        for k in hung:
            assert await cb.get("t", [k], out) == 1 and same_bytes(out[0], kv_of[k])
    for d in (a, b):
        assert d.alive and d.stop() == 0
        assert d.pool_stats()["redis_corrupt"] == 0
    rc.close()


async def _pulled(client: Client, keys) -> bool:
    """Ask for the keys again (a failed pull is not retried by itself); whether all are here."""
    missing = [k for k in keys if not client.lookup("t", [k]).length]
    if missing:
        await client.prefetch("t", missing)
    return not missing


async def test_the_prefix_index_on_a_cluster(daemon_factory, cluster):
    """`where` (issue 16) on a 3-master cluster: the index hashes spread over the masters like the
    blocks, and the answer names the node holding the chain and counts what Redis holds."""
    index = '[prefix_index]\nenabled = true\nttl_s = 60\nrefresh_s = 5.0\n'
    a = daemon_factory(node="wa", redis_url=cluster.url, gpu=0, extra=THROUGH + index)
    b = daemon_factory(node="wb", redis_url=cluster.url, gpu=0, extra=index)
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        keys = ca.block_keys("t", list(range(16 * 6)), salt=b"where-cluster")
        assert (await ca.put("t", keys, make_kv(6, seed=8))).staged == 6

        async def named():
            w = await cb.where("t", keys)
            ok = w.best is not None and w.best.node == a.node and w.length == 6 and w.redis_length == 6
            return w if ok else None

        await async_wait_until(named, timeout=20, message="where names node A on the cluster")
    rc = cluster.client()
    masters_with_index = 0
    for m in cluster.masters():
        with m.client() as mc:
            masters_with_index += bool(mc.keys("kvtier:where:*"))
    assert masters_with_index >= 2, "the index hashes spread over the masters"
    rc.close()
