"""Bad input of every kind: a clear error, or a counted miss and a log line. The daemon keeps
serving, and the blocks it already holds stay intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier.bus.publisher import Publisher
from kvtier.client import Client
from kvtier.core.events import Put, StagedBlock
from kvtier.errors import BadRequest, UnknownPool
from kvtier.shm.slots import checksum
from kvtier.store.redis_blocks import pack_block, redis_block_key
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration


async def _stored_baseline(client: Client) -> tuple[list[bytes], torch.Tensor]:
    keys = client.block_keys("t", list(range(9000, 9000 + 16 * 3)), salt=b"base")
    kv = make_kv(3, seed=77)
    await client.put("t", keys, kv)
    assert await client.wait_resident("t", keys, timeout=10)
    return keys, kv


async def _still_intact(client: Client, keys, kv) -> None:
    out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
    assert await client.get("t", keys, out) == len(keys)
    assert same_bytes(out, kv)


def _dlq(r, node: str) -> list[dict]:
    return [{k.decode(): v for k, v in fields.items()} for _id, fields in r.xrange(f"kvtier:{{{node}}}:dlq")]


async def test_malformed_stream_entries_are_dead_lettered(daemon_factory, redis_server):
    d = daemon_factory(node="bad-stream")
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys, kv = await _stored_baseline(client)
        client_stream, cpu_stream = f"kvtier:{{{d.node}}}:client", f"kvtier:{{{d.node}}}:tier:cpu"
        r.xadd(client_stream, {b"e": b"\xc1 not msgpack"})
        r.xadd(client_stream, {b"other": b"x"})
        r.xadd(cpu_stream, {b"e": b"\x81\xa1v\x01"})  # a map, but not an envelope
        pub = Publisher(client._redis, "intruder", 1, 10_000)
        # Well-formed but meaningless: an unknown pool.
        await pub.publish(client_stream, Put("no-such-pool", f"kvtier.{d.node}.stage.1.0123456789abcdef",
                                             (StagedBlock(b"k" * 32, None, 0, 2),)))
        await async_wait_until(lambda: len(_dlq(r, d.node)) >= 4, timeout=10, message="4 dead letters")
        reasons = " | ".join(e["reason"].decode() for e in _dlq(r, d.node))
        assert "not valid msgpack" in reasons and "missing field" in reasons
        assert "envelope fields" in reasons and "unknown pool 'no-such-pool'" in reasons
        assert d.alive
        await _still_intact(client, keys, kv)
        # ... and new work after the junk still flows.
        more = client.block_keys("t", list(range(16 * 2)), salt=b"after")
        await client.put("t", more, make_kv(2, seed=3))
        assert await client.wait_resident("t", more, timeout=10)
    for stream in (client_stream, cpu_stream):  # everything, junk included, ends up acked
        wait_until(lambda stream=stream: r.xpending(stream, "kvtier")["pending"] == 0, timeout=10,
                   message=f"{stream} drained")
    r.close()


async def test_corrupt_redis_values_are_rejected_deleted_and_counted(daemon_factory, redis_server):
    d = daemon_factory(node="bad-redis")
    r = redis_server.client()
    async with await Client.connect(d.runtime_dir) as client:
        keys, kv = await _stored_baseline(client)
        pool = client.pool("t")
        victims = client.block_keys("t", list(range(5000, 5000 + 16 * 3)), salt=b"evil")
        payload = make_kv(1, seed=9)[0].contiguous().view(torch.uint8).reshape(-1).numpy()
        good = pack_block(pool.fingerprint, victims[0], payload, checksum(payload))
        flipped = bytearray(good)
        flipped[-1] ^= 0xFF  # payload byte: checksum mismatch
        wrong_layout = pack_block(bytes(32), victims[1], payload, checksum(payload))
        wrong_key = pack_block(pool.fingerprint, victims[0], payload, checksum(payload))  # stored under victims[2]
        r.set(redis_block_key("t", victims[0]), bytes(flipped))
        r.set(redis_block_key("t", victims[1]), bytes(wrong_layout))
        r.set(redis_block_key("t", victims[2]), bytes(wrong_key))
        for v in victims:
            await client.prefetch("t", [v])
        await async_wait_until(lambda: d.pool_stats().get("redis_corrupt", 0) >= 3, timeout=10,
                               message="3 corrupt values counted")
        assert client.lookup("t", victims).length == 0, "a corrupt value is never served"
        assert not any(r.exists(redis_block_key("t", v)) for v in victims), "corrupt values are deleted"
        assert d.pool_stats()["tiers"]["cpu"]["failed"] >= 3
        assert "redis.corrupt_block" in d.log_tail(50_000)
        await _still_intact(client, keys, kv)
    r.close()


async def test_client_input_errors_are_clear(daemon_factory):
    d = daemon_factory(node="bad-client")
    async with await Client.connect(d.runtime_dir) as client:
        keys, kv = await _stored_baseline(client)
        with pytest.raises(UnknownPool, match="no-such-pool"):
            client.lookup("no-such-pool", keys)
        with pytest.raises(UnknownPool):
            client.block_keys("no-such-pool", [1, 2, 3])
        with pytest.raises(BadRequest, match="32 bytes"):
            await client.get("t", [keys[0][:31]], torch.empty((1, *SHAPE), dtype=torch.float16))
        with pytest.raises(BadRequest, match="32 bytes"):
            client.lookup("t", [keys[0] + b"x"])
        with pytest.raises(BadRequest, match="dtype"):
            await client.get("t", keys, torch.empty((3, *SHAPE), dtype=torch.float32))
        with pytest.raises(BadRequest, match="shape"):
            await client.put("t", keys, torch.empty((3, 2, 2, 2, 16, 31), dtype=torch.float16))
        with pytest.raises(BadRequest, match="shape"):
            await client.get("t", keys, torch.empty((2, *SHAPE), dtype=torch.float16))  # too few rows
        with pytest.raises(BadRequest, match="token"):
            client.block_keys("t", [-1] * 16)
        await _still_intact(client, keys, kv)
    assert d.alive


async def test_put_naming_a_bogus_staging_segment_is_a_counted_drop(daemon_factory):
    d = daemon_factory(node="bad-stage")
    async with await Client.connect(d.runtime_dir) as client:
        keys, kv = await _stored_baseline(client)
        pub = Publisher(client._redis, "forger", 1, 10_000)
        bogus = client.block_keys("t", list(range(16 * 4)), salt=b"forged")
        for i, seg in enumerate((f"kvtier.{d.node}.stage.1.00000000deadbeef",
                                 "kvtier.other-node.stage.1.0123456789abcdef", "../../etc/passwd")):
            try:
                await pub.publish(f"kvtier:{{{d.node}}}:client", Put("t", seg, (StagedBlock(bogus[i], None, 0, 2),)))
            except Exception:
                pass  # the codec itself refuses some names; that is also a clear rejection
        # A real staging segment, but a slot outside it.
        await client.put("t", keys[:1], kv[:1])  # ensures the client's staging exists
        staging = client.pool("t").staging.seg.name
        await pub.publish(f"kvtier:{{{d.node}}}:client", Put("t", staging, (StagedBlock(bogus[3], None, 10_000, 2),)))
        await async_wait_until(lambda: d.pool_stats().get("puts_dropped", 0) >= 3, timeout=10,
                               message="bogus puts counted as drops")
        assert client.lookup("t", bogus).length == 0
        assert "bad_staging" in d.log_tail(50_000)
        await _still_intact(client, keys, kv)
    assert d.alive


WRITER = textwrap.dedent("""
    import signal, sys, torch
    from kvtier.client import SyncClient
    c = SyncClient(sys.argv[1])
    keys = c.block_keys("t", list(range(16 * 4)), salt=b"proc")
    g = torch.Generator().manual_seed(42)
    kv = torch.randint(-30000, 30000, (4, 2, 2, 2, 16, 32), generator=g, dtype=torch.int16).view(torch.float16)
    res = c.put("t", keys, kv)
    assert c.wait_resident("t", keys, 10)
    print(res.staged, flush=True)
    if sys.argv[2] == "hang":
        c.put("t", c.block_keys("t", list(range(16)), salt=b"hang"), kv[:1])
        signal.pause()  # until the test kills it
    c.close()
""")


async def test_blocks_put_by_another_process_and_staging_reaped_after_a_crash(daemon_factory):
    d = daemon_factory(node="procs")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", WRITER, str(d.runtime_dir), "exit"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "4"
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 4)), salt=b"proc")
        g = torch.Generator().manual_seed(42)
        kv = torch.randint(-30000, 30000, (4, *SHAPE), generator=g, dtype=torch.int16).view(torch.float16)
        await _still_intact(client, keys, kv)

    hang = subprocess.Popen([sys.executable, "-c", WRITER, str(d.runtime_dir), "hang"], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert hang.stdout.readline().strip() == "4"
    stage = f"kvtier.{d.node}.stage.{hang.pid}."
    wait_until(lambda: any(p.startswith(stage) for p in os.listdir("/dev/shm")), timeout=10)
    hang.send_signal(signal.SIGKILL)
    hang.wait()
    wait_until(lambda: not any(p.startswith(stage) for p in os.listdir("/dev/shm")), timeout=20,
               message="the dead client's staging segment is reaped")
    assert d.alive
