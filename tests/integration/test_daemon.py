"""Through a running `kvtier daemon` process: put, lookup, get; demote to Redis and promote back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from kvtier.bus.codec import decode_entry
from kvtier.bus.publisher import FIELD
from kvtier.client import Client
from kvtier.core.events import Tier
from kvtier.store.redis_blocks import redis_block_key, unpack_block
from tests.support.blocks import SHAPE, make_kv, put_chain, same_bytes, stored_somewhere
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration
def shm_segments(node: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvtier.{node}."))


async def test_put_lookup_get_is_byte_exact(daemon_factory):
    d = daemon_factory()
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(300, 300 + 16 * 6)), salt=b"tenant-a")
        assert len(keys) == 6
        kv = make_kv(6, seed=1)
        res = await client.put("t", keys, kv)
        assert (res.staged, res.dropped) == (6, 0)
        assert await client.wait_resident("t", keys, timeout=10)
        hit = client.lookup("t", keys)
        assert hit.length == 6 and set(hit.tiers) <= {Tier.GPU, Tier.CPU}

        extra = client.block_keys("t", list(range(300, 300 + 16 * 8)), salt=b"tenant-a")  # 2 unknown blocks
        out = torch.full((8, *SHAPE), 7.0, dtype=torch.float16)
        assert await client.get("t", extra, out) == 6
        assert same_bytes(out[:6], kv)
        assert torch.all(out[6:] == 7.0), "blocks past the hit prefix must be left untouched"

        other_salt = client.block_keys("t", list(range(300, 300 + 16 * 6)), salt=b"tenant-b")
        assert client.lookup("t", other_salt).length == 0, "another salt must never hit"

    await async_wait_until(lambda: d.pool_stats().get("tiers", {}).get("gpu", {}).get("hits", 0) >= 6,
                           message="the daemon counted the reads as hits")
    assert d.pool_stats()["misses"] >= 2
    assert d.stop() == 0
    assert shm_segments(d.node) == [], "a clean stop with persist_arena=false leaves no segments"


async def fill_past_capacity(client: Client, n_chains: int, seed: int):
    """16 chains of 4 blocks into 4 gpu + 8 cpu slots: most of them must end up in Redis."""
    chains = [client.block_keys("t", [seed * 100_000 + c * 1000 + i for i in range(64)], salt=b"s")
              for c in range(n_chains)]
    kvs = [make_kv(4, seed=seed + c) for c in range(n_chains)]
    for keys, kv in zip(chains, kvs):
        await put_chain(client, keys, kv)
    return chains, kvs


def remote_chain(client: Client, chains, r) -> list[int]:
    """Chains with no block left on this node and every block in Redis."""
    return [c for c, keys in enumerate(chains)
            if all(client.lookup("t", [k]).length == 0 and r.exists(redis_block_key("t", k)) for k in keys)]


async def nothing_lost(client: Client, chains) -> None:
    """Every block is still somewhere: resident here, or in Redis."""
    for keys in chains:
        assert await stored_somewhere(client, keys)


async def test_demote_to_redis_and_promote_back(daemon_factory, redis_server):
    d = daemon_factory(gpu=4, cpu=8)
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        chains, kvs = await fill_past_capacity(client, 16, seed=10)
        c = (await async_wait_until(lambda: remote_chain(client, chains, r), timeout=15,
                                    message="a chain written back to redis entirely"))[0]
        await nothing_lost(client, chains)
        keys, kv = chains[c], kvs[c]
        raw = r.get(redis_block_key("t", keys[0]))
        payload, _ = unpack_block(raw, client.pool("t").fingerprint, keys[0], client.pool("t").block_bytes)
        assert bytes(payload) == bytes(kv[0].contiguous().view(torch.uint8).reshape(-1).numpy())

        found = await client.locate("t", keys)
        assert (found.length, found.redis_length) == (0, 4)
        await client.prefetch("t", keys)
        assert await client.wait_resident("t", keys, timeout=10)
        out = torch.empty((4, *SHAPE), dtype=torch.float16)
        assert await client.get("t", keys, out) == 4
        assert same_bytes(out, kv)
    assert d.stop() == 0  # the final stats are written on the way out
    s = d.pool_stats()
    assert s["tiers"]["redis"]["demoted_in"] >= 1
    assert s["tiers"]["cpu"]["promoted_in"] >= 4
    assert s["tiers"]["cpu"]["demoted_in"] >= 1 and s["tiers"]["gpu"]["evicted"] >= 1
    r.close()


async def test_two_daemons_share_blocks_through_redis(daemon_factory, redis_server):
    a = daemon_factory(node="node-a", gpu=4, cpu=8)
    b = daemon_factory(node="node-b", gpu=4, cpu=8)
    r = redis_server.client()
    async with await Client.connect(a.runtime_dir) as ca, await Client.connect(b.runtime_dir) as cb:
        assert cb.block_keys("t", list(range(64)), salt=b"x") == ca.block_keys("t", list(range(64)), salt=b"x")
        chains, kvs = await fill_past_capacity(ca, 16, seed=20)
        c = (await async_wait_until(lambda: remote_chain(ca, chains, r), timeout=15,
                                    message="node A wrote a chain back to redis entirely"))[0]
        keys, kv = chains[c], kvs[c]
        assert cb.lookup("t", keys).length == 0
        found = await cb.locate("t", keys)
        assert found.redis_length == 4, "node B sees node A's blocks in Redis"
        await cb.prefetch("t", keys)
        assert await cb.wait_resident("t", keys, timeout=10)
        out = torch.empty((4, *SHAPE), dtype=torch.float16)
        assert await cb.get("t", keys, out) == 4
        assert same_bytes(out, kv)
    assert b.stop() == 0
    assert b.pool_stats()["tiers"]["cpu"]["promoted_in"] >= 4
    r.close()


async def test_warm_restart_keeps_the_cpu_arena(daemon_factory):
    d = daemon_factory(node="warm", gpu=0, cpu=16, persist_arena=True)
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 5)), salt=b"w")
        kv = make_kv(5, seed=5)
        await client.put("t", keys, kv)
        assert await client.wait_resident("t", keys, timeout=10)
    assert d.stop() == 0
    arena = f"kvtier.{d.node}.t.cpu"
    assert arena in shm_segments(d.node), "persist_arena keeps the cpu arena"
    d.start()
    try:
        async with await Client.connect(d.runtime_dir) as client:
            assert client.lookup("t", keys).length == 5
            out = torch.empty((5, *SHAPE), dtype=torch.float16)
            assert await client.get("t", keys, out) == 5
            assert same_bytes(out, kv)
    finally:
        d.stop()
        os.unlink(f"/dev/shm/{arena}")
    assert "reattached" in d.log_tail(20000)


async def test_a_pool_closed_mid_copy_stays_mapped_until_the_copies_finish(daemon_factory):
    """The client re-maps its pools when the daemon restarts; copies running in the client's copy
    threads at that moment must not have the mapping pulled from under them (a SIGSEGV)."""
    d = daemon_factory(node="inuse", gpu=0, cpu=16)
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 3)), salt=b"in-use")
        kv = make_kv(3, seed=9)
        await put_chain(client, keys, kv)
        p = client.pool("t")
        with p.in_use():  # as get and put hold it around their threaded copies
            p.close()  # what following a daemon restart does to the old pool
            out = torch.empty((3, *SHAPE), dtype=torch.float16)
            assert all(p.read(k, out[i]) for i, k in enumerate(keys)), "still mapped while in use"
            assert same_bytes(out, kv)
            assert p.staging is not None
        assert p.staging is None, "closed once the copies are done"


async def test_status_shows_tiers_counters_and_transfer_latency(daemon_factory):
    import json
    import subprocess
    import sys

    d = daemon_factory()
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 3)), salt=b"status")
        await client.put("t", keys, make_kv(3, seed=8))
        assert await client.wait_resident("t", keys, timeout=10)
    await async_wait_until(lambda: d.pool_stats().get("tiers", {}).get("gpu", {}).get("transfers", 0) >= 3,
                           message="three timed stores")
    cmd = [sys.executable, "-m", "kvtier.cli", "status", "--runtime-dir", str(d.runtime_dir)]
    raw = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60, check=True).stdout)
    gpu = raw["pools"]["t"]["tiers"]["gpu"]
    assert gpu["blocks"] == 3 and gpu["stored"] == 3 and 0 < gpu["transfer_s"] <= 3 * gpu["transfer_max_s"]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    row = next(line for line in table.splitlines() if line.strip().startswith("gpu"))
    assert row.split()[1:3] == ["3", "8"], table  # blocks, capacity
    assert "/" in row.split()[-1], "mean/max transfer ms"


async def test_write_through_puts_blocks_in_redis_while_they_stay_local(daemon_factory, redis_server):
    d = daemon_factory(extra='[policy]\nredis_write = "write-through"\n')
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 4)), salt=b"through")
        kv = make_kv(4, seed=12)
        await client.put("t", keys, kv)
        assert await client.wait_resident("t", keys, timeout=10)
        await async_wait_until(lambda: all(r.exists(redis_block_key("t", k)) for k in keys), timeout=10,
                               message="every stored block copied to redis")
        assert client.lookup("t", keys).length == 4, "the local copies stay"
        raw = r.get(redis_block_key("t", keys[2]))
        payload, _ = unpack_block(raw, client.pool("t").fingerprint, keys[2], client.pool("t").block_bytes)
        assert bytes(payload) == bytes(kv[2].contiguous().view(torch.uint8).reshape(-1).numpy())
    assert d.stop() == 0
    assert d.pool_stats()["tiers"]["redis"]["copied_in"] == 4
    r.close()


async def test_locate_and_present_ask_the_blocks_redis_when_the_bus_is_elsewhere(daemon_factory, redis_server,
                                                                                 tmp_path):
    """With [redis] bus_url set, block keys live on `url` and the streams on `bus_url`: a client
    must ask the blocks Redis whether a block is there, not the bus (it used to ask the bus)."""
    from tests.support.redis_proc import RedisProcess

    bus = RedisProcess.spawn(tmp_path / "bus")
    try:
        writer = daemon_factory(bus_url=bus.url, extra='[policy]\nredis_write = "write-through"\n')
        reader = daemon_factory(bus_url=bus.url)
        r = redis_server.client()
        async with await Client.connect(writer.runtime_dir) as client:
            keys = client.block_keys("t", list(range(16 * 3)), salt=b"bus-elsewhere")
            await client.put("t", keys, make_kv(3, seed=4))
            await async_wait_until(lambda: all(r.exists(redis_block_key("t", k)) for k in keys), timeout=10,
                                   message="blocks written through to the blocks Redis")
        async with await Client.connect(reader.runtime_dir) as client:
            assert (await client.locate("t", keys)).redis_length == 3
            assert await client.present("t", [keys[2], b"\x01" * 32, keys[0]]) == [True, False, True]
        r.close()
    finally:
        bus.stop(kill=True)


async def test_a_prefetch_never_overtakes_the_read_reports_before_it(daemon_factory, redis_server):
    """Read reports wait up to 20 ms to be batched; a prefetch sent meanwhile carries them ahead of
    itself. Before, a get-then-prefetch loop faster than that let the daemon see the prefetch
    while the earlier prefetches' leases (which reads end) were all still held: past the lease
    cap, it shed blocks it had just been asked to prefetch, and the prefetch never completed."""
    d = daemon_factory()
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(64)), salt=b"read")
        await put_chain(client, keys, make_kv(4, seed=3))
        out = torch.empty((4, *SHAPE), dtype=torch.float16)
        assert await client.get("t", keys, out) == 4
        await client.prefetch("t", client.block_keys("t", list(range(64)), salt=b"next"))
        sent = [e.event for _id, fields in r.xrange(client.desc.streams.client) for e in decode_entry(fields[FIELD])]
    kinds = [type(e).__name__ for e in sent]
    assert kinds[-2:] == ["Access", "Prefetch"], kinds
    assert sent[-2].keys == tuple(keys)
    r.close()


async def test_a_client_reads_its_own_puts_before_the_daemon_places_them(daemon_factory):
    """Read your own writes: with the daemon stopped (SIGSTOP) nothing staged is placed, yet the
    client that put the blocks reads them from its staging slots, verified. Bytes changed in a
    staged slot are a miss, never wrong bytes; another client sees nothing; once the daemon runs
    again the blocks are placed and the same reads come from the arena."""
    d = daemon_factory(node="own", gpu=0, cpu=16)
    async with await Client.connect(d.runtime_dir) as client, await Client.connect(d.runtime_dir) as other:
        keys = client.block_keys("t", list(range(500, 500 + 16 * 4)))
        kv = make_kv(4, seed=9)
        d.proc.send_signal(signal.SIGSTOP)
        try:
            assert (await client.put("t", keys, kv)).staged == 4
            assert client.lookup("t", keys).length == 0  # not placed: lookup tells the truth
            out = torch.zeros((4, *SHAPE), dtype=torch.float16)
            assert await client.get("t", keys, out) == 4
            assert same_bytes(out, kv) and client.pool("t").own_reads == 4
            assert await other.get("t", keys, torch.zeros((4, *SHAPE), dtype=torch.float16)) == 0
            w = client.pool("t").staging
            assert w is not None
            slot = w.slot_of(keys[2])
            assert slot is not None
            w.table.payloads()[slot, 100] ^= 0xFF  # a staged block changed after its checksum
            out.zero_()
            assert await client.get("t", keys, out) == 2  # the changed block ends the prefix
            assert same_bytes(out[:2], kv[:2])
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert await client.wait_resident("t", keys[:2], timeout=10)
        out.zero_()
        own = client.pool("t").own_reads
        assert await client.get("t", keys[:2], out) == 2 and same_bytes(out[:2], kv[:2])
        assert client.pool("t").own_reads == own  # these came from the arena
