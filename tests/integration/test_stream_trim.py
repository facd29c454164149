"""The bus streams stay a queue on a real daemon and redis-server: entries every group has read
and acked are trimmed ([bus] stream_keep_s), while an entry another group holds pending, and
everything a group has not been handed yet, stay (kvtier/bus/trim.py, kvtier/daemon/sampler.py)."""

from __future__ import annotations

import urllib.request

import pytest

from kvtier.bus.connect import make_redis
from kvtier.bus.trim import entry_id
from kvtier.client import Client
from kvtier.daemon.sampler import _sample_once
from tests.support.blocks import make_kv
from tests.support.redis_cluster import RedisCluster
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration
PUTS = 300  # several of Redis's stream nodes (100 entries each): trimming takes whole nodes


async def test_read_and_acked_entries_are_trimmed_and_held_ones_stay(daemon_factory, redis_server):
    d = daemon_factory(node="a", gpu=0, cpu=64, bus_extra="stream_keep_s = 0")
    r = redis_server.client()
    names = {s: f"kvtier:{{{d.node}}}:{s}" for s in ("client", "facts", "tier:cpu")}
    r.xgroup_create(names["tier:cpu"], "laggard", id="0", mkstream=True)  # never reads: holds the stream
    r.xgroup_create(names["client"], "holder", id="0", mkstream=True)
    async with await Client.connect(d.runtime_dir) as c:
        async def staged(i: int) -> bool:  # a full staging segment drops a put: offer it again
            keys = c.block_keys("t", list(range(16)), salt=b"s%d" % i)
            return (await c.put("t", keys, make_kv(1, seed=i))).staged == 1

        for i in range(PUTS):
            await async_wait_until(lambda i=i: staged(i), timeout=10, message="put staged")
        # The holder reads everything there is and acks all but one entry in the middle.
        [(_, read)] = r.xreadgroup("holder", "h", {names["client"]: ">"})
        assert len(read) >= PUTS
        held = read[len(read) // 2][0]
        r.xack(names["client"], "holder", *[eid for eid, _ in read if eid != held])

        def stream(s: str) -> dict:
            return r.xinfo_stream(names[s])

        await async_wait_until(lambda: stream("facts")["length"] < stream("facts")["entries-added"] // 2,
                               timeout=15, message="the facts stream trimmed")
        # Trimming takes whole stream nodes (XTRIM MINID ~): up to the node that holds the entry.
        await async_wait_until(lambda: entry_id(stream("client")["first-entry"][0]) > entry_id(read[0][0]),
                               timeout=15, message="the client stream trimmed")
        assert entry_id(stream("client")["first-entry"][0]) <= entry_id(held), "the held entry was trimmed"
        assert r.xrange(names["client"], held, held), "the held entry was trimmed"
        assert r.xpending(names["client"], "holder")["min"] == held
        cpu = stream("tier:cpu")
        assert cpu["length"] == cpu["entries-added"], "an entry the laggard was never handed was trimmed"

        def trimmed() -> dict[str, int]:
            return {s: d.stats()["streams"].get(n, {}).get("trimmed", 0) for s, n in names.items()}

        await async_wait_until(lambda: trimmed()["facts"] > 0 and trimmed()["client"] > 0, timeout=10,
                               message="the trims counted in stats")
        assert trimmed()["tier:cpu"] == 0
        counted = trimmed()
        metrics = urllib.request.urlopen(d.stats()["metrics_url"], timeout=5).read().decode()
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith(f'kvtier_stream_trimmed_total{{stream="{names["facts"]}"}}'))
        assert float(line.split()[-1]) >= counted["facts"]
    r.close()


async def test_the_trim_runs_on_a_redis_cluster(tmp_path):
    """Every command of the sampler's round is keyed to the node's hash tag: a cluster pipeline
    takes it (it refuses keyless ones such as TIME)."""
    with RedisCluster.serving(tmp_path, masters=3) as cluster:
        r = make_redis(cluster.url, socket_timeout=2, connect_timeout=2, retries=1)
        try:
            stream = "kvtier:{trim-node}:facts"
            await r.xgroup_create(stream, "kvtier", id="0", mkstream=True)
            for _ in range(PUTS):
                await r.xadd(stream, {"e": b"x"})
            [(_, read)] = await r.xreadgroup("kvtier", "c", {stream: ">"})
            await r.xack(stream, "kvtier", *[eid for eid, _ in read])
            into: dict = {}
            await _sample_once(r, [stream], "kvtier", into, 0)
            assert into[stream]["trimmed"] > 0 and await r.xlen(stream) == PUTS - into[stream]["trimmed"]
        finally:
            await r.aclose()
