"""Redis misbehaves; the node keeps serving what it holds, and recovers when Redis does.

The daemon and the client reach the test's redis-server through a fault proxy
(tests/support/fault_proxy.py) that can delay, blackhole, reset or cut traffic at any moment.
Under each fault, for longer than the daemon's socket timeout: lookups and gets from the local
tiers keep returning exact bytes; a put returns within a bounded time (dropped and counted, not
hung); the daemon stays up, its event loop stays responsive (lag measured by the daemon), its
stats keep being written and its systemd watchdog keeps being pinged. After healing, new puts
become visible again and every pending entry is reclaimed and acked.

Also: Redis restarted empty (no persistence) in the middle of a workload, and Redis at
maxmemory (OOM errors are counted and backed off, without a hot retry loop).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvtier.client import Client
from kvtier.tools.daemon_process import DaemonProcess
from tests.support.blocks import make_kv, same_bytes
from tests.support.daemon_proc import write_config
from tests.support.fault_proxy import FaultProxy
from tests.support.waiting import async_wait_until, wait_until
from tests.support.workload import demo_totals, start_demo_workers, stop_demo_workers

pytestmark = pytest.mark.integration
FAULT_S = 4.0  # longer than the daemon's socket timeout (2 s in tests), so every timeout fires
# Half the socket timeout: a call that blocks the loop until a timeout fires still shows. (500 ms
# was once exceeded, 598 ms, by a loaded 2-core CI machine with nothing blocking.)
LAG_BOUND_MS = 1000.0


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def proxied(tmp_path, redis_server):
    proxy = FaultProxy(upstream_unix=str(redis_server.socket_path)).start()
    node = f"fault-{os.getpid()}-{time.monotonic_ns() % 10**8}"
    cfg = write_config(tmp_path, node=node, redis_url=proxy.url, gpu=8, cpu=16)
    d = DaemonProcess(cfg, tmp_path / f"rt-{node}", env={"WATCHDOG_USEC": "400000"}).start()
    wait_until(lambda: d.pool_stats(), timeout=10, message="the first stats.json")
    try:
        yield proxy, d
    finally:
        proxy.set("pass")
        if d.alive:
            d.stop(20)  # past the daemon's own stop backstop (grace 5 s + 10 s): it ends either way
        proxy.stop()


@pytest.mark.parametrize("mode", ["delay", "blackhole", "reset", "limit"])
async def test_local_tiers_keep_serving_through_a_redis_fault(proxied, redis_server, mode: str) -> None:
    proxy, d = proxied
    async with await Client.connect(d.runtime_dir) as client:
        keys = client.block_keys("t", list(range(16 * 6)), salt=mode.encode())
        kv = make_kv(6, seed=3)
        assert (await client.put("t", keys, kv)).dropped == 0
        assert await client.wait_resident("t", keys, timeout=10)

        before = d.stats()
        d.take_messages()
        proxy.set(mode, delay_s=0.8, limit_bytes=200)
        out = make_kv(6, seed=99)
        put_times: list[float] = []

        fault_over = asyncio.Event()

        async def keep_putting() -> None:  # puts go through Redis: each may wait out a timeout
            for i in range(1000):
                if fault_over.is_set():
                    return
                t0 = time.monotonic()
                await client.put("t", client.block_keys("t", list(range(10**6 + i * 64, 10**6 + i * 64 + 32))), kv)
                put_times.append(time.monotonic() - t0)

        putter = asyncio.create_task(keep_putting())
        reads = 0
        t_end = time.monotonic() + FAULT_S
        while time.monotonic() < t_end:
            # Reads from shared memory never wait on Redis.
            assert client.lookup("t", keys).length == 6
            assert await client.get("t", keys, out) == 6 and same_bytes(out, kv)
            reads += 1
            await asyncio.sleep(0.05)
        # Told to stop, not cancelled: redis-py can swallow a cancellation mid-command (Python
        # 3.11), and a putter that missed it would keep putting into the fault for ever.
        fault_over.set()
        await asyncio.wait_for(putter, timeout=30)
        slowest_put = max(put_times, default=0.0)
        assert reads > FAULT_S / 0.05 / 2, f"only {reads} local reads in {FAULT_S}s"
        # Bounded: a put gives up after the client's timeouts and bounded retries, never hangs.
        assert slowest_put < 15, slowest_put
        assert d.alive, d.log_tail()
        during = d.stats()
        assert during["written_at"] > before["written_at"] + FAULT_S / 2, "stats stopped: the loop is stuck"
        assert during["loop"]["lag_max_ms"] < LAG_BOUND_MS, during["loop"]
        pings = d.take_messages().count("WATCHDOG=1")  # one every 0.2 s while the loop is healthy
        assert pings >= FAULT_S / 0.2 / 2, f"only {pings} watchdog pings during the fault"

        proxy.set("pass")  # healed: the consumers resume, and new puts become visible
        fresh = client.block_keys("t", list(range(5 * 10**6, 5 * 10**6 + 16 * 2)), salt=mode.encode())

        async def put_visible() -> bool:
            res = await client.put("t", fresh, kv[:2])
            return res.dropped == 0 and await client.wait_resident("t", fresh, timeout=2)

        await async_wait_until(put_visible, timeout=30, interval=0.5, message="puts work again after healing")
    r = redis_server.client()
    streams = [f"kvtier:{{{d.node}}}:{s}" for s in ("client", "facts", "tier:gpu", "tier:cpu", "tier:redis")]
    wait_until(lambda: all(g["pending"] == 0 for s in streams if r.exists(s) for g in r.xinfo_groups(s)),
               timeout=30, message="pending entries reclaimed and acked after healing")
    r.close()
    assert d.stop() == 0


def test_redis_restarted_empty_mid_load(daemon_factory, redis_server, tmp_path) -> None:
    """No persistence: streams, groups and blocks are gone. Groups are re-created on NOGROUP, the
    redis tier is treated as emptied, gpu and cpu keep serving, and nothing wrong is read."""
    d = daemon_factory(gpu=8, cpu=24)
    workers = start_demo_workers(d.runtime_dir, tmp_path, 2, prefixes=12)
    try:
        wait_until(lambda: d.pool_stats().get("tiers", {}).get("redis", {}).get("demoted_in", 0) > 10,
                   timeout=60, message="blocks were demoted to Redis")
        redis_server.stop(kill=True)
        redis_server.start()  # empty
        puts_before = d.pool_stats()["puts"]
        wait_until(lambda: d.pool_stats().get("puts", 0) > puts_before + 20, timeout=60,
                   message="puts flow again after the restart")
        hits = d.pool_stats()["hits"]
        wait_until(lambda: d.pool_stats()["hits"] > hits + 20, timeout=30, message="reads go on")
        assert d.alive
        r = redis_server.client()
        assert r.xinfo_groups(f"kvtier:{{{d.node}}}:client"), "the consumer group was re-created"
        r.close()
    finally:
        stop_demo_workers(workers)
    assert demo_totals(tmp_path, 2)["wrong_blocks"] == 0
    assert d.stop() == 0


def test_redis_at_maxmemory_is_counted_and_backed_off(daemon_factory, redis_server) -> None:
    """OOM on every write: counted, the daemon neither crashes nor spins, and recovers after."""
    d = daemon_factory(gpu=2, cpu=4)
    r = redis_server.client()
    try:
        async def scenario() -> None:
            async with await Client.connect(d.runtime_dir) as client:
                used = int(r.info("memory")["used_memory"])
                r.config_set("maxmemory-policy", "noeviction")
                r.config_set("maxmemory", str(used + (256 << 10)))
                cpu0, t0 = _cpu_seconds(d.proc.pid), time.monotonic()
                dropped = 0
                for i in range(40):  # far more than fits: gpu + cpu are 6 blocks, Redis is full
                    keys = client.block_keys("t", list(range(i * 10**4, i * 10**4 + 32)), salt=b"oom")
                    dropped += (await client.put("t", keys, make_kv(2, seed=i))).dropped
                    await asyncio.sleep(0.05)
                await async_wait_until(lambda: d.pool_stats().get("redis_errors", 0) > 0 or dropped > 0,
                                       timeout=15, message="OOM errors seen")
                await asyncio.sleep(2)  # a quiet spell under OOM: the daemon must not burn CPU
                busy = (_cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)
                assert busy < 0.6, f"daemon used {busy:.0%} of a core under OOM: a hot retry loop"
                assert d.alive, d.log_tail()
                r.config_set("maxmemory", "0")
                keys = client.block_keys("t", list(range(16 * 2)), salt=b"after")

                async def stored() -> bool:
                    # Puts staged during the OOM may never be stored (their events were refused or
                    # dead-lettered): the client takes those staging slots back after a while, so
                    # keep putting until this one lands, locally or in Redis.
                    found = await client.locate("t", keys)
                    if found.length + found.redis_length == 2:
                        return True
                    await client.put("t", keys, make_kv(2, seed=7))
                    return False

                await async_wait_until(stored, timeout=30, interval=0.5,
                                       message="the daemon recovered and stored a new put")

        asyncio.run(scenario())
    finally:
        r.config_set("maxmemory", "0")
        r.close()
    assert d.stop() == 0
