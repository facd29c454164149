"""`kvtier bench --vllm`: time to first token on real vLLM engines, kvtier against vLLM's own
prefix cache, no cache at all, and LMCache's multi-process mode (the peer) on the same engine.

Cells (per prefix length; `max_tokens=1`, each sample a distinct tail; TTFT is taken inside the
engine's process around `LLM.generate`):
1. cold: no connector, prefix caching off;
2. floor: vLLM's own prefix-cache hit in the same engine (nothing to load);
3. kvtier, prefix in this node's shared-memory arena, in a fresh engine;
4. kvtier, in the engine that saved the prefix, on its very next request;
5. kvtier, prefix only in Redis, in a fresh engine on a second node (every sample a prefix that
   node never saw: each is a first cross-node read);
6. kvtier, prefix nowhere (what a miss costs over cold);
7. the peer (LMCache MP, when `--peer` names its venv): as cells 3 and 4.
Engines run with prefix caching off except the floor's, so that a repeat can come only from the
connector. The median and the worst sample of each cell are reported.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.layout import BlockLayout
from kvtier.tools.bench_env import Env, pool_toml
from kvtier.tools.redis_cluster import free_port

# The model: an 8-layer random Llama, hidden 1024, 4 KV heads of 128, bf16 (16 KiB of KV
# a token), so that a 2,048-token prefill is real work on a CPU. --quick: the tests' tiny one.
BENCH_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=8192)
BENCH_POOL = dict(layers=8, kv_heads=4, head_dim=128, block_tokens=32, dtype="bfloat16")
TAIL = 32
CELLS = ("cold", "floor", "kvtier_local", "kvtier_next", "kvtier_redis", "kvtier_miss", "peer_local", "peer_next")


def _say(msg: str) -> None:
    print(f"kvtier bench --vllm: {msg}", file=sys.stderr, flush=True)


class LMCacheServer:
    """LMCache 0.5.6's multi-process server (interop.md, section 6), in the peer's venv."""

    ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}

    def __init__(self, python: str, workdir: Path, l1_gb: float) -> None:
        self.port = free_port()
        self.log = workdir / "lmcache-server.log"
        cmd = [python, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--chunk-size", "256", "--l1-size-gb", str(l1_gb), "--no-l1-use-lazy", "--eviction-policy", "LRU",
               "--supported-transfer-mode", "engine_driven", "--shm-name", f"kvtier-bench-lmcache-{self.port}",
               "--prometheus-port", str(free_port())]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **self.ENV})
        deadline = time.monotonic() + 120
        while "LMCache cache server is running" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the LMCache server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def connector(self) -> dict:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": "engine_driven"}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ttft_cells(workdir: Path, lengths: list[int], samples: int, *, quick: bool, peer_python: str | None,
               out: dict, dtype: str = "bfloat16") -> None:
    from kvtier.tools.engine_logs import worker_loads
    from kvtier.tools.vllm_engine import TINY_POOL, EngineProcess, connector_config, make_model

    layout = {"model": "tiny-llama", **TINY_POOL} if quick else {"model": "bench-llama", **BENCH_POOL, "dtype": dtype}
    model = make_model(workdir / "model", **({} if quick else BENCH_MODEL))
    block_bytes = BlockLayout(**layout).block_bytes
    bt = layout["block_tokens"]
    # Node A keeps every prompt this run saves (one prefix, three sets of samples a length); node B
    # only what it reads through and the daemon brings up.
    cpu_blocks = sum((n + TAIL) // bt + 1 for n in lengths) * (1 + 3 * samples) + 64
    pools = pool_toml("bench", layout, "cpu", 0, cpu_blocks)
    pools_b = pool_toml("bench", layout, "cpu", 0, sum((n + TAIL) // bt + 1 for n in lengths) * samples + 64)
    mib = max(64, 4 * (max(lengths) + 2 * TAIL) * block_bytes // bt >> 20)
    eng = dict(dtype="" if quick else dtype, max_model_len=max(lengths) + 2 * TAIL + 64, kv_cache_mib=mib,
               max_num_seqs=4)
    # --quick: the cost model off (on the tiny model recomputing costs what loading does, and the
    # smoke run checks where each prefix came from); the full run measures what a user gets.
    kv_extra = {"cost_model": False} if quick else {}
    rng = random.Random(29)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    prefixes = {n: draw(n) for n in lengths}  # cells 2, 3: one prefix, `samples` tails
    own = {n: [draw(n) for _ in range(samples)] for n in lengths}  # cell 4: each saved, then asked for
    remote = {n: [draw(n) for _ in range(samples)] for n in lengths}  # cell 5: each a first cross-node read
    res: dict[str, dict[int, list[float]]] = {c: {n: [] for n in lengths} for c in CELLS}
    loaded: dict[str, dict[int, list[int]]] = {c: {n: [] for n in lengths} for c in CELLS}

    def timed(e, cell: str, n: int, prompt: list[int]) -> None:
        r = e.generate(prompt, max_tokens=1)
        res[cell][n].append(r["seconds"])
        loaded[cell][n].append(r["cached"])

    def engine(name: str, kv: dict | None, caching: bool = False, **kw):
        _say(f"engine {name}")
        return EngineProcess(model, workdir / f"{name}.log", kv, prefix_caching=caching, **eng, **kw)

    def warm(e) -> None:  # the first request pays one-off costs (graph set-up, allocator): not measured
        e.generate(draw(max(lengths) // 2), max_tokens=1)

    for d in ("a", "b"):
        (workdir / d).mkdir(exist_ok=True)
    a = Env(None, 0, workdir / "a", pools_toml=pools, policy_toml='[policy]\nredis_write = "write-through"')
    b = Env(None, 0, workdir / "b", pools_toml=pools_b, redis_url=a.url)
    try:
        with engine("cold", None) as e:
            warm(e)
            for n in lengths:
                for _ in range(samples):
                    timed(e, "cold", n, draw(n) + draw(TAIL))
        with engine("floor", None, caching=True) as e:
            warm(e)
            for n in lengths:
                e.generate(prefixes[n] + draw(TAIL), max_tokens=1)
                for _ in range(samples):
                    timed(e, "floor", n, prefixes[n] + draw(TAIL))
        with engine("kvtier-a-save", connector_config("bench", a.rdir, **kv_extra)) as e:
            warm(e)
            for n in lengths:
                e.generate(prefixes[n] + draw(TAIL), max_tokens=1)
                for p in remote[n]:
                    e.generate(p + draw(TAIL), max_tokens=1)
                for p in own[n]:
                    e.generate(p + draw(TAIL), max_tokens=1)
                    timed(e, "kvtier_next", n, p + draw(TAIL))
                for _ in range(samples):
                    timed(e, "kvtier_miss", n, draw(n) + draw(TAIL))
        _wait_stored(a, sum(n // bt * (1 + samples) for n in lengths))  # cells 3 and 5's prefixes
        with engine("kvtier-a-fresh", connector_config("bench", a.rdir, **kv_extra)) as e:
            warm(e)
            for n in lengths:
                for _ in range(samples):
                    timed(e, "kvtier_local", n, prefixes[n] + draw(TAIL))
        with engine("kvtier-b-fresh", connector_config("bench", b.rdir, **kv_extra)) as e:
            warm(e)
            for n in lengths:
                for p in remote[n]:
                    timed(e, "kvtier_redis", n, p + draw(TAIL))
        if peer_python:
            _peer(peer_python, workdir, engine, warm, timed, lengths, prefixes, samples, draw,
                  l1_gb=max(1.0, round(cpu_blocks * block_bytes / (1 << 30), 1)))
    finally:
        b.close()
        a.close()
    # What each kvtier engine's connector worker loaded and failed to (then recomputed), logged
    # as it stopped: `loaded_tokens` is vLLM's `cached`, which counts a promised load either way.
    loads = {name: worker_loads(workdir / f"{name}.log")
             for name in ("kvtier-a-save", "kvtier-a-fresh", "kvtier-b-fresh")}
    out["ttft_cells"] = {
        "model": "tiny Llama (2 layers, fp32)" if quick else (
            f"random Llama: 8 layers, hidden 1024, 4 KV heads of 128, {dtype} ({block_bytes // bt >> 10} KiB of KV "
            "per token)"),
        "samples": samples, "tail_tokens": TAIL, "worker_loads": loads,
        "cells": {c: {str(n): {"median_ms": statistics.median(v) * 1000, "worst_ms": max(v) * 1000,
                               "loaded_tokens": loaded[c][n]}
                      for n, v in per.items() if v} for c, per in res.items() if any(per.values())}}


def _wait_stored(env: Env, blocks: int) -> None:
    Env.wait_for(lambda: env.stats().get("pools", {}).get("bench", {}).get("tiers", {}).get("redis", {})
                 .get("copied_in", 0) >= blocks, "node A's saves stored and written to Redis", timeout=300)


def _peer(python: str, workdir: Path, engine: Callable, warm: Callable, timed: Callable, lengths: list[int],
          prefixes: dict, samples: int, draw: Callable, l1_gb: float) -> None:
    server = LMCacheServer(python, workdir, l1_gb)
    try:
        kv = server.connector()
        with engine("peer-save", kv, python=python, env=LMCacheServer.ENV) as e:
            warm(e)
            for n in lengths:
                e.generate(prefixes[n] + draw(TAIL), max_tokens=1)
                for _ in range(samples):
                    q = draw(n)
                    e.generate(q + draw(TAIL), max_tokens=1)
                    timed(e, "peer_next", n, q + draw(TAIL))
        time.sleep(1.0)  # the peer's saves are asynchronous and it has no "stored" signal to wait on
        with engine("peer-fresh", kv, python=python, env=LMCacheServer.ENV) as e:
            warm(e)
            for n in lengths:
                for _ in range(samples):
                    timed(e, "peer_local", n, prefixes[n] + draw(TAIL))
    finally:
        server.close()


def ttft_rows(out: dict) -> list[dict]:
    """Rows for the report: each cell's median and worst against the floor (or cold), with the
    issue's targets."""
    t = out["ttft_cells"]["cells"]
    rows = []
    targets = {"kvtier_local": ("floor", 1.1), "kvtier_next": ("floor", 1.1), "kvtier_redis": ("floor", 1.5),
               "kvtier_miss": ("cold", 1.05), "peer_local": ("floor", None), "peer_next": ("floor", None),
               "floor": ("cold", None)}
    for cell, (against, target) in targets.items():
        for n, v in t.get(cell, {}).items():
            base = t.get(against, {}).get(n)
            if base is None:
                continue
            worst = v["worst_ms"] / base["median_ms"]
            rows.append({"path": f"TTFT {cell}, {n}-token prefix", "figure":
                         f"median {v['median_ms']:.0f} ms, worst {v['worst_ms']:.0f} ms",
                         "bound": f"{against} median {base['median_ms']:.0f} ms", "ratio": worst,
                         "target": f"worst <= {target}x" if target else "(reference)",
                         "meets": True if target is None else worst <= target})
    return rows
