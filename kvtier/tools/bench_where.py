"""`kvtier bench --where`: the cluster prefix index's `where` against a bare lookup of the same keys.

A private redis-server (TCP loopback) is filled with the index entries 1,000 nodes would write
for one 32k-token prompt (2,048 blocks of 16 tokens): node j holds the first L_j blocks in its
cpu or gpu tier, L_j uniform in [0, 2048], so a block has 500 holders on average and the first
ones nearly 1,000 (1,026,173 entries); Redis itself holds the first 1,024 blocks. The figure is
one `where` of the whole chain (client/where_query.py, the code Client.where runs: the nodes with
the longest run, verified); the bound, in the same run, is a bare lookup of the same keys:
pipelined EXISTS of each block's index hash, in the same chunks.
Best of `repeat` rounds each. `--quick` uses 50 nodes and 256 blocks, and checks the answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.core.where import field, where_key
from kvtier.store.redis_blocks import redis_block_key
from kvtier.tools.bench_basics import say

POOL = "bench"


async def _measure(url: str, nodes: int, blocks: int, repeat: int) -> dict[str, Any]:
    from kvtier.bus.connect import make_blocks_redis
    from kvtier.client.where_query import WHERE_CHUNK, WHERE_LIMIT, query_where
    from kvtier.keys import BlockKey
    from kvtier.store.batches import batches_for

    r = make_blocks_redis(url, socket_timeout=60, connect_timeout=5, retries=1)
    try:
        keys = [BlockKey(hashlib.sha256(b"where" + i.to_bytes(4, "little")).digest()) for i in range(blocks)]
        rng = random.Random(16)
        lengths = {f"node-{j:04d}": rng.randint(0, blocks) for j in range(nodes)}
        holders: list[list[str]] = [[] for _ in keys]
        for node, n in lengths.items():
            tier = "gpu" if rng.random() < 0.3 else "cpu"
            for i in range(n):
                holders[i].append(field(node, tier))
        batches = batches_for(r)
        mem0 = (await r.info("memory"))["used_memory"]
        fill: list[tuple[object, ...]] = []
        for k, hs in zip(keys, holders):
            if hs:
                fill.append(("HSET", where_key(POOL, k), *[x for h in hs for x in (h, "1")]))
        fill += [("SET", redis_block_key(POOL, bytes(k)), b"x") for k in keys[:blocks // 2]]
        for at in range(0, len(fill), 64):
            out = await batches.run(fill[at:at + 64])
            bad = next((o for o in out if isinstance(o, Exception)), None)
            if bad is not None:
                raise bad
        entries = sum(len(h) for h in holders)
        await r.delete(*[redis_block_key(POOL, bytes(k)) for k in keys[:blocks // 2]])
        index_bytes = (await r.info("memory"))["used_memory"] - mem0  # the index alone
        fill = [("SET", redis_block_key(POOL, bytes(k)), b"x") for k in keys[:blocks // 2]]
        await batches.run(fill)

        best_where = best_bare = float("inf")
        answer = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            answer = await query_where(batches, POOL, keys)
            best_where = min(best_where, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for at in range(0, len(keys), WHERE_CHUNK):
                await batches.run([("EXISTS", where_key(POOL, k)) for k in keys[at:at + WHERE_CHUNK]])
            best_bare = min(best_bare, time.perf_counter() - t0)
        assert answer is not None
        top = max(lengths.values())
        longest = sorted(n for n, length in lengths.items() if length == top)
        correct = (answer.length == top and answer.redis_length == blocks // 2
                   and {run.node for run in answer.nodes} <= set(longest)
                   and len(answer.nodes) == min(len(longest), WHERE_LIMIT)
                   and all(lengths[run.node] == run.length for run in answer.nodes))
        return {"nodes": nodes, "blocks": blocks, "entries": entries, "index_bytes": index_bytes,
                "bytes_per_entry": index_bytes / max(entries, 1), "where_ms": best_where * 1e3,
                "bare_lookup_ms": best_bare * 1e3, "ratio": best_where / best_bare, "correct": correct,
                "answer_length": answer.length, "answer_nodes": len(answer.nodes)}
    finally:
        await r.aclose()


def where_row(quick: bool, repeat: int) -> dict[str, Any]:
    from kvtier.processes import stop_processes
    from kvtier.tools.bench_env import start_redis

    nodes, blocks = (50, 256) if quick else (1000, 2048)
    with tempfile.TemporaryDirectory(prefix="kvtier-where-") as work:
        server, url = start_redis(Path(work))
        try:
            say(f"where: {nodes} nodes' index entries for a {blocks}-block chain, against a bare lookup")
            return asyncio.run(_measure(url, nodes, blocks, repeat))
        finally:
            stop_processes([server], 10)
