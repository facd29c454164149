"""`kvtier bench --cluster`: the Redis tier and cross-node pulls on a local Redis Cluster of 1 and
of 3 masters, each against raw redis-py cluster pipelines of the same bytes, in the same run.

- redis put: GB/s of `RedisBlocks.put_many` (pipelines per master, several at once), against the
  best raw `RedisCluster.pipeline()` SETs of the same values over a grid of pipeline depths and
  connection counts (kvtier/tools/bench_redis.py);
- redis get: GB/s of the verified `RedisBlocks.get_many`, against the best raw GETs likewise;
- pull: GB/s of node B's prefetch of node A's chain until resident, then get, against raw
  pipelined GETs of the same values plus a copy into a buffer.

The cluster is real redis-server processes on loopback (kvtier/tools/redis_cluster.py), so on a
machine with few cores the masters, the daemons and the benchmark share them: record the core
count beside the figures (docs/performance.md). Scaling is the 3-master figure over the 1-master
one, for kvtier and for the raw bound alike.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from kvtier.tools.bench_basics import GB, say, sizes
from kvtier.tools.bench_env import Env
from kvtier.tools.bench_redis import best_of
from kvtier.tools.bench_report import finish
from kvtier.tools.redis_cluster import LocalCluster

THROUGH = '[policy]\nredis_write = "write-through"\n'


async def redis_rows(url: str, layout: dict, n: int, repeat: int) -> dict[str, Any]:
    """put_many/get_many of n blocks against the best raw cluster pipelines of the same values,
    and how the keys spread over the masters."""
    import redis.asyncio.cluster

    from kvtier.bus.connect import make_blocks_redis, make_redis
    from kvtier.tools.bench_redis import redis_tier_vs_raw

    res = await redis_tier_vs_raw(url, layout, n, repeat, make_blocks_redis, make_redis)
    raw = make_redis(url, socket_timeout=60, connect_timeout=5, retries=1)
    assert isinstance(raw, redis.asyncio.cluster.RedisCluster)
    try:
        await raw.initialize()
        res["keys_per_master"] = [await raw.execute_command("DBSIZE", target_nodes=m) for m in raw.get_primaries()]
    finally:
        await raw.aclose()
    return res


async def pull_row(a: Env, b: Env, layout: dict, n: int, repeat: int, url: str) -> dict[str, Any]:
    """Node A puts an n-block chain (written through to the cluster); node B pulls it (prefetch
    until resident, then get), against raw pipelined GETs of the same values plus a copy."""
    import redis.asyncio.cluster
    import torch

    from kvtier.bus.connect import make_redis
    from kvtier.client import Client
    from kvtier.store.redis_blocks import redis_block_key

    async with await Client.connect(a.rdir, staging_blocks=min(n, 256)) as ca, \
            await Client.connect(b.rdir) as cb:
        p = ca.pool("b")
        bb = p.block_bytes
        data = np.random.default_rng(4).integers(0, 255, (n, bb), dtype=np.uint8)
        kv = torch.from_numpy(data).view(p.dtype).reshape(n, *p.shape)
        out: dict[str, Any] = {"pull_s": [], "correct": True}
        raw = make_redis(url, socket_timeout=60, connect_timeout=5, retries=1)
        assert isinstance(raw, redis.asyncio.cluster.RedisCluster)
        try:
            for r in range(repeat):
                keys = ca.block_keys("b", list(range(n * p.layout.block_tokens)), salt=f"pull-{r}".encode())
                for i in range(0, n, 64):
                    res = await ca.put("b", keys[i:i + 64], kv[i:i + 64], parent=keys[i - 1] if i else None)
                    while res.dropped:
                        await asyncio.sleep(0.001)
                        j = i + res.staged
                        res = await ca.put("b", keys[j:i + 64], kv[j:i + 64], parent=keys[j - 1] if j else None)
                deadline = time.monotonic() + 120
                while (await cb.locate("b", keys)).redis_length < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError("pull: node A's chain did not reach the cluster")
                    await asyncio.sleep(0.01)
                dst = torch.empty_like(kv)
                t0 = time.perf_counter()
                await cb.prefetch("b", keys)
                if not await cb.wait_resident("b", keys, timeout=120):
                    raise RuntimeError("pull: the chain did not arrive on node B")
                got = await cb.get("b", keys, dst)
                out["pull_s"].append(time.perf_counter() - t0)
                out["correct"] = out["correct"] and got == n and bool(
                    np.array_equal(dst.view(torch.uint8).reshape(n, bb).numpy(), data))
                names = [redis_block_key("b", k) for k in keys]
                buf = np.empty((n, bb), dtype=np.uint8)

                async def raw_pull(names=names, buf=buf) -> None:
                    per = max(1, (64 << 20) // bb)
                    for i in range(0, n, per):
                        pipe = raw.pipeline(transaction=False)
                        for name in names[i:i + per]:
                            pipe.get(name)
                        for j, v in enumerate(await pipe.execute()):
                            buf[i + j] = np.frombuffer(v, dtype=np.uint8, count=bb, offset=len(v) - bb)

                out.setdefault("raw_s", []).append(await best_of(raw_pull, 1))
        finally:
            await raw.aclose()
        t, t_raw = min(out.pop("pull_s")), min(out.pop("raw_s"))
        return {"pull_gbps": n * bb / t / GB, "raw_pull_gbps": n * bb / t_raw / GB, "correct": out["correct"]}


def run_masters(masters: int, layout: dict, n: int, repeat: int, tmp: Path) -> dict[str, Any]:
    from kvtier.layout import BlockLayout

    bb = BlockLayout(**layout).block_bytes
    with LocalCluster.serving(tmp, masters=masters) as cluster:
        say(f"{masters} master(s): redis tier against raw cluster pipelines, {n} blocks of {bb / (1 << 20):.2f} MiB")
        res = uvloop.run(redis_rows(cluster.url, layout, n, repeat))  # the daemon's loop
        say(f"{masters} master(s): node B pulls node A's {n}-block chain")
        for node in ("a", "b"):
            (tmp / f"{node}{masters}").mkdir()
        a = Env(layout, int(repeat * n / 0.85) + 16, tmp / f"a{masters}", redis_url=cluster.url, policy_toml=THROUGH)
        try:
            # Room for every round's chain below the high watermark: a prefetch into a full tier
            # waits for shedding, and no more than half the tier may wait (core/policy.py).
            b = Env(layout, int(repeat * n / 0.85) + 16, tmp / f"b{masters}", redis_url=cluster.url)
            try:
                pull = asyncio.run(pull_row(a, b, layout, n, repeat, cluster.url))
                res.update(pull, correct=res["correct"] and pull["correct"])
            finally:
                b.close()
        finally:
            a.close()
    return res


def run_cluster_bench(args) -> int:
    layout, bb, n, repeat = sizes(args, 32)
    out: dict[str, Any] = {"quick": args.quick, "blocks": n, "block_bytes": bb, "cpu_cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-") as tmp:
        for masters in (1, 3):
            (Path(tmp) / str(masters)).mkdir()
            out[f"masters_{masters}"] = run_masters(masters, layout, n, repeat, Path(tmp) / str(masters))
    return finish(out, render(out), args.json, all(out[f"masters_{m}"]["correct"] for m in (1, 3)))


ROWS = (("redis put", "put_gbps", "raw_put_gbps"), ("redis get (verified)", "get_gbps", "raw_get_gbps"),
        ("cross-node pull", "pull_gbps", "raw_pull_gbps"))


def render(out: dict[str, Any]) -> str:
    lines = [f"Redis Cluster on {out['cpu_cores']} CPU cores, {out['blocks']} blocks of "
             f"{out['block_bytes'] / (1 << 20):.2f} MiB",
             "| path | masters | kvtier GB/s | raw redis-py GB/s | ratio | 3 masters / 1 |",
             "|---|---|---|---|---|---|"]
    one, three = out["masters_1"], out["masters_3"]
    for path, ours, bound in ROWS:
        for m, r in ((1, one), (3, three)):
            scale = f"{three[ours] / one[ours]:.2f} (raw {three[bound] / one[bound]:.2f})" if m == 3 else ""
            lines.append(f"| {path} | {m} | {r[ours]:.2f} | {r[bound]:.2f} | {r[ours] / r[bound]:.2f} | {scale} |")
    return "\n".join(lines)
