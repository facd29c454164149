"""The Redis tier against the best raw redis-py can do on the same server and bytes, in one run.

The bound is searched, not assumed: raw SETs and GETs of the same values are timed over a grid of
pipeline depths (values per pipeline) and connection counts (pipelines in flight at once), on a
probe of the blocks; the best few shapes are then timed over all of them, best of `repeat`. On
this 2-core machine the best SET shape was a shallow pipeline over several connections, and a
64 MiB pipeline on one connection ran at a quarter of it (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

GB = 1e9
DEPTHS = (1, 2, 4, 8, 16, 32)
CONNECTIONS = (1, 2, 4, 8)
PROBE_BYTES = 128 << 20  # what each shape of the grid is first tried on
FINALISTS = 3  # shapes timed over all the blocks


async def best_of(fn: Callable[[], Awaitable[None]], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        best = min(best, time.perf_counter() - t0)
    return best


def raw_round(r: Any, op: str, names: list[bytes], values: list[memoryview], depth: int, conns: int):
    """SET (or GET) every name, `depth` per pipeline, `conns` pipelines in flight at once."""
    async def worker(idx: list[int]) -> None:
        for i in range(0, len(idx), depth):
            pipe = r.pipeline(transaction=False)
            for j in idx[i:i + depth]:
                if op == "set":
                    pipe.set(names[j], values[j])
                else:
                    pipe.get(names[j])
            await pipe.execute()

    async def run() -> None:
        await asyncio.gather(*(worker(list(range(c, len(names), conns))) for c in range(conns)))
    return run


async def raw_best(r: Any, op: str, names: list[bytes], values: list[memoryview], value_bytes: int,
                   repeat: int) -> dict[str, Any]:
    """The fastest shape for `op` over these values, and its GB/s over all of them."""
    probe = max(1, min(len(names), PROBE_BYTES // value_bytes))
    tried = []
    for depth in DEPTHS:
        for conns in CONNECTIONS:
            if depth * conns > 2 * probe:
                continue
            t = await best_of(raw_round(r, op, names[:probe], values[:probe], depth, conns), 1)
            tried.append((probe * value_bytes / t / GB, depth, conns))
    tried.sort(reverse=True)
    finals = []
    for _, depth, conns in tried[:FINALISTS]:
        t = await best_of(raw_round(r, op, names, values, depth, conns), repeat)
        finals.append((len(names) * value_bytes / t / GB, depth, conns))
    gbps, depth, conns = max(finals)
    return {"gbps": gbps, "depth": depth, "connections": conns,
            "grid": {f"{d}x{c}": round(g, 3) for g, d, c in tried}}


async def raw_get_copy_gbps(r: Any, names: list[bytes], payload_bytes: int, repeat: int) -> dict[str, Any]:
    """The bound of a read-through: raw GETs of these values in redis-py's best shape for them,
    each payload copied into a destination already paged in, as an engine's buffer is."""
    values = list(await r.mget(names))
    if any(v is None for v in values):
        raise RuntimeError("raw GET bound: a value is gone")
    shape = await raw_best(r, "get", names, values, len(values[0]), repeat)
    depth, conns = shape["depth"], shape["connections"]
    dst = np.ones((len(names), payload_bytes), dtype=np.uint8)

    async def worker(idx: list[int]) -> None:
        for i in range(0, len(idx), depth):
            pipe = r.pipeline(transaction=False)
            for j in idx[i:i + depth]:
                pipe.get(names[j])
            for j, v in zip(idx[i:i + depth], await pipe.execute()):
                np.copyto(dst[j], np.frombuffer(v, dtype=np.uint8, offset=len(v) - payload_bytes))

    async def run() -> None:
        await asyncio.gather(*(worker(list(range(c, len(names), conns))) for c in range(conns)))

    t = await best_of(run, repeat)
    return {"gbps": len(names) * payload_bytes / t / GB, "depth": depth, "connections": conns}


async def redis_tier_vs_raw(url: str, layout: dict, n: int, repeat: int, make_client: Callable[..., Any],
                            make_raw: Callable[..., Any]) -> dict[str, Any]:
    """RedisBlocks.put_many, and its verified fetch copied into place, of n blocks in one call
    each (in the tier's default pipeline shape), against the best raw SETs and GETs of the same
    values."""
    import structlog

    from kvtier.layout import BlockLayout
    from kvtier.shm.slots import checksum
    from kvtier.store.redis_blocks import CONNECTIONS as TIER_CONNECTIONS
    from kvtier.store.redis_blocks import PIPELINE_BYTES, WRITE_PIPELINE_BYTES, RedisBlocks

    lay = BlockLayout(**layout)
    bb = lay.block_bytes
    client = make_client(url, socket_timeout=60, connect_timeout=5, retries=1)
    raw = make_raw(url, socket_timeout=60, connect_timeout=5, retries=1)
    try:
        blocks = RedisBlocks(client, "bench", lay.fingerprint, bb, 0, structlog.get_logger())
        data = np.random.default_rng(2).integers(0, 255, (n, bb), dtype=np.uint8)
        keys = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]
        values = []
        for k, row in zip(keys, data):
            value, view = blocks.new_value()
            view[:] = row
            values.append(blocks.seal(value, k, checksum(row)))
        ok = True

        async def tier_put() -> None:
            errors = await blocks.put_many(list(zip(keys, values)))
            if any(errors):
                raise RuntimeError(f"put_many failed: {next(e for e in errors if e)}")

        # Reads land where a promote puts them: a destination already paged in (an arena slot).
        dst = np.ones_like(data)

        async def tier_get() -> None:
            nonlocal ok
            dst.fill(1)  # a stale copy must not pass the check below (not timed: the bound pays no such pass)
            t0 = time.perf_counter()
            got = await blocks.fetch(keys, into=lambda i: dst[i])  # verified where it landed
            times.append(time.perf_counter() - t0)
            # Outside the timing, as for the raw GETs: every round's bytes are compared.
            ok = ok and all(isinstance(g, tuple) for g in got) and bool(np.array_equal(dst, data))

        times: list[float] = []
        t_put = await best_of(tier_put, repeat)
        for _ in range(repeat):
            await tier_get()
        t_get = min(times)
        names = [b"raw:" + k for k in keys]
        raw_set = await raw_best(raw, "set", names, values, len(values[0]), repeat)
        raw_get = await raw_best(raw, "get", names, values, len(values[0]), repeat)
        moved = n * len(values[0])  # the same bytes as the raw rounds: header and payload
        return {"put_gbps": moved / t_put / GB, "get_gbps": moved / t_get / GB,
                "raw_put_gbps": raw_set["gbps"], "raw_get_gbps": raw_get["gbps"],
                "raw_put_shape": raw_set, "raw_get_shape": raw_get, "correct": ok,
                "tier_shape": {"pipeline_bytes": PIPELINE_BYTES, "write_pipeline_bytes": WRITE_PIPELINE_BYTES,
                               "connections": TIER_CONNECTIONS}}
    finally:
        await client.aclose()
        await raw.aclose()


async def redis_row(url: str, layout: dict, n: int, repeat: int, out: dict) -> None:
    """`kvtier bench`'s redis rows: the redis tier's pipelined write and verified read (what demote
    and promote run), each against the best raw redis-py SETs and GETs of the same bytes."""
    from kvtier.bus.connect import make_blocks_redis, make_redis

    out["redis"] = await redis_tier_vs_raw(url, layout, n, repeat, make_blocks_redis, make_redis)
