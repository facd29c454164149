"""redis-py's asyncio RedisCluster loses ASK redirects once a node has more than one pooled
connection: it sends ASKING on one connection and the command on another, so the importing node
answers MOVED back to the source, and the command ends in `ClusterError: TTL exhausted.`

Run: python scripts/repro/cluster_ask_asking.py  (needs redis-server and redis-cli on PATH)
It makes a 3-master cluster on free loopback ports, marks one slot MIGRATING, MIGRATEs its key,
then GETs it: once on a fresh client (one connection per node: works), once after concurrent
commands have opened several connections to the target (fails), and once through kvtier's
batches (store/batches.py: ASKING and the command on one connection). Seen with redis-py 8.1.0.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis.asyncio.cluster as arc  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from kvtier.store.batches import ClusterBatches  # noqa: E402
from tests.support.redis_cluster import RedisCluster  # noqa: E402


async def get_via(cluster: RedisCluster, key: str, warm: bool, kvtier: bool = False) -> str:
    rc = arc.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=2)
    try:
        await rc.initialize()
        if warm:  # several connections to every node, as any concurrent user has
            await asyncio.gather(*(rc.get(f"other{{{i}}}") for i in range(64)))
        if kvtier:
            (got,) = await ClusterBatches(rc).run([("GET", key)])
            return repr(got)
        return repr(await rc.get(key))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await rc.aclose()


def main() -> None:
    with RedisCluster.serving(tempfile.mkdtemp(), masters=3) as cluster:
        key = "migrating-key"
        src = cluster.owner_of(key)
        dst = next(m for m in cluster.masters() if m is not src)
        with src.client() as s, dst.client() as d:
            s.set(key, b"value")
            slot = key_slot(key.encode())
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id())
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id())
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", key)
        print("fresh client:", asyncio.run(get_via(cluster, key, warm=False)))
        print("warm client: ", asyncio.run(get_via(cluster, key, warm=True)))
        print("kvtier, warm:", asyncio.run(get_via(cluster, key, warm=True, kvtier=True)))


if __name__ == "__main__":
    main()
