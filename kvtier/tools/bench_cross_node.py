"""`kvtier bench`'s cross-node row: a cold prefix that another node computed, read through.

Node A puts a chain of CHAIN blocks (written through to Redis); node B, which holds none of it,
reads it with `get(..., remote=True)` into a tensor. The bound is raw redis-py reading the same
values, pipelined in its best shape of the grid (kvtier/tools/bench_redis.py), plus the copy of
each into the same tensor. A new chain each round, so every read is cold.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tools.bench_env import Env
from kvtier.tools.bench_redis import GB, raw_get_copy_gbps

CHAIN = 32
THROUGH = '[policy]\nredis_write = "write-through"\n'


async def _measure(a: Env, b: Env, layout: dict, chain: int, repeat: int) -> dict[str, Any]:
    import torch

    from kvtier.bus.connect import make_redis
    from kvtier.client import Client
    from kvtier.store.redis_blocks import redis_block_key

    async with await Client.connect(a.rdir, staging_blocks=chain) as ca, \
            await Client.connect(b.rdir, remote_timeout=60) as cb:
        p = ca.pool("b")
        bb = p.block_bytes
        data = np.random.default_rng(7).integers(0, 255, (chain, bb), dtype=np.uint8)
        kv = torch.from_numpy(data).view(p.dtype).reshape(chain, *p.shape)
        chains = []
        for r in range(repeat):
            keys = ca.block_keys("b", list(range(chain * p.layout.block_tokens)), salt=f"cold-{r}".encode())
            # wait_s: the daemon frees the last chain's staging slots just after it makes them visible.
            res = await ca.put("b", keys, kv, wait_s=30)
            if res.dropped or not await ca.wait_resident("b", keys, timeout=120):
                raise RuntimeError(f"cross-node: node A did not store its chain ({res.dropped} dropped)")
            chains.append(keys)
        deadline = time.monotonic() + 120
        for keys in chains:
            while (await cb.locate("b", keys)).redis_length < chain:
                if time.monotonic() > deadline:
                    raise RuntimeError("cross-node: node A's chains did not reach Redis")
                await asyncio.sleep(0.01)
        out = torch.ones_like(kv)  # paged in, as an engine's buffer is
        best, ok = float("inf"), True
        for keys in chains:
            t0 = time.perf_counter()
            n = await cb.get("b", keys, out, remote=True)
            best = min(best, time.perf_counter() - t0)
            ok = ok and n == chain and bool(np.array_equal(out.view(torch.uint8).reshape(chain, bb).numpy(), data))
        raw = make_redis(a.url, socket_timeout=60, connect_timeout=5, retries=1)
        try:
            bound = await raw_get_copy_gbps(raw, [redis_block_key("b", k).encode() for k in chains[0]], bb, repeat)
        finally:
            await raw.aclose()
        return {"gbps": chain * bb / best / GB, "bound_gbps": bound["gbps"], "blocks": chain,
                "bound_shape": {"depth": bound["depth"], "connections": bound["connections"]}, "correct": ok}


def cross_node_row(url: str, layout: dict, repeat: int, workdir: Path, chain: int = CHAIN) -> dict[str, Any]:
    for node in ("a", "b"):
        (workdir / node).mkdir()
    a = Env(layout, int(repeat * chain / 0.85) + 16, workdir / "a", redis_url=url, policy_toml=THROUGH)
    try:
        b = Env(layout, 64, workdir / "b", redis_url=url)
        try:
            return asyncio.run(_measure(a, b, layout, chain, repeat))
        finally:
            b.close()
    finally:
        a.close()
