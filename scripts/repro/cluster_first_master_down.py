"""redis-py's asyncio RedisCluster cannot start while the first master of its slot map is down:
loading the map ends with COMMAND on that one node (the default node), and its failure fails
every command, also for keys that other, healthy masters serve. Retries do not help: the load
runs outside the retry loop.

Run: python scripts/repro/cluster_first_master_down.py  (needs redis-server and redis-cli on PATH)
Seen with redis-py 8.1.0: with the master of slot 0 killed, a new client's GET of a key that
another master serves raises ConnectionError; kvtier's client (bus/connect.py) answers it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis.asyncio.cluster as arc  # noqa: E402

from kvtier.bus.connect import make_redis  # noqa: E402
from tests.support.redis_cluster import RedisCluster  # noqa: E402


async def get(client, key: str) -> str:
    try:
        return repr(await client.get(key))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        await client.aclose()


def main() -> None:
    with RedisCluster.serving(tempfile.mkdtemp(), masters=3) as cluster:
        first = cluster.owner_of("{06S}")  # slot 0
        key = next(f"k{i}" for i in range(1000) if cluster.owner_of(f"k{i}") is not first)
        with cluster.owner_of(key).client() as c:
            c.set(key, b"value")
        first.stop(kill=True)
        seeds = [arc.ClusterNode("127.0.0.1", n.port) for n in cluster.nodes]
        plain = arc.RedisCluster(startup_nodes=seeds, socket_timeout=2, require_full_coverage=False)
        print("redis-py RedisCluster:", asyncio.run(get(plain, key)))
        ours = make_redis(cluster.url, socket_timeout=2, connect_timeout=2, retries=3)
        print("kvtier make_redis:    ", asyncio.run(get(ours, key)))


if __name__ == "__main__":
    main()
