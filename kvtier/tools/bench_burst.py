"""`kvtier bench --vllm`, under load: a burst of requests whose prefixes are cached arrives while
others decode (AsyncLLM engines, timestamps taken in the engine's process).

Twelve requests with 2,048-token prefixes arrive together while four requests decode. The
prefixes are, by placement:
- floor: in vLLM's own prefix cache (the same engine computed them);
- kvtier_local: in this node's arena (the same engine saved them; its prefix cache is off);
- kvtier_half_redis: on node B, half saved by B's engine (in its arena), half only in Redis
  (saved on node A);
- peer: in LMCache MP's pool (with `--peer`).
Reported over all rounds (placements alternate within each round, each round with new
prefixes): the burst's TTFT p50 and p99, the decoders' inter-token latency (ITL) p50 and p99
while the burst is served, and how many burst requests did not load their whole prefix.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from kvtier.tools.bench_env import Env, pool_toml
from kvtier.tools.bench_ttft import _say

PLACEMENTS = ("floor", "kvtier_local", "kvtier_half_redis", "peer")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def burst_cells(workdir: Path, *, quick: bool, rounds: int, peer_python: str | None, out: dict,
                dtype: str = "bfloat16") -> None:
    from kvtier.tools.bench_ttft import BENCH_MODEL, BENCH_POOL, LMCacheServer
    from kvtier.tools.engine_logs import worker_loads
    from kvtier.tools.vllm_engine import TINY_POOL, StreamEngineProcess, connector_config, make_model

    prefix_len, burst_n, decoders_n, dec_tokens = (256, 4, 2, 48) if quick else (2048, 12, 4, 192)
    layout = {"model": "tiny-llama", **TINY_POOL} if quick else {"model": "bench-llama", **BENCH_POOL, "dtype": dtype}
    model = make_model(workdir / "model", **({} if quick else BENCH_MODEL))
    bt = layout["block_tokens"]
    per_round = (prefix_len // bt + 2) * burst_n * 2
    # Memory: four engines, two arenas, Redis and LMCache's pool share the machine (24 GiB here). An
    # arena holds one round (older rounds are evicted; write-through keeps them in Redis), and an
    # engine's KV cache the burst plus the decoders (about 830 blocks of 32 tokens) with a margin.
    # Sized for all rounds and 2 GiB a cache, the fp32 run ran out of memory at the burst's start.
    pools = pool_toml("burst", layout, "cpu", 0, per_round + 64)
    eng = dict(dtype="float32" if quick else dtype, max_model_len=prefix_len + 512,
               kv_cache_mib=64 if quick else 1024 if dtype == "bfloat16" else 1280, max_num_seqs=burst_n + decoders_n,
               max_num_batched_tokens=256 if quick else 2048)
    # --quick: the cost model off (on the tiny model recomputing costs what loading does, and the
    # smoke run checks where each prefix came from); the full run measures what a user gets.
    kv_extra = {"cost_model": False} if quick else {}
    rng = random.Random(12)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    for d in ("a", "b"):
        (workdir / d).mkdir(exist_ok=True)
    a = Env(None, 0, workdir / "a", pools_toml=pools, policy_toml='[policy]\nredis_write = "write-through"')
    b = Env(None, 0, workdir / "b", pools_toml=pools, redis_url=a.url,
            policy_toml='[policy]\nredis_write = "write-through"')
    engines: dict[str, StreamEngineProcess] = {}
    server = None
    placements = [p for p in PLACEMENTS if p != "peer" or peer_python]
    res = {p: {"ttft": [], "itl": [], "short": 0, "runs": 0} for p in placements}
    try:
        _say("burst: starting the engines")
        engines["floor"] = StreamEngineProcess(model, workdir / "floor.log", prefix_caching=True, **eng)
        for name, env in (("a", a), ("b", b)):
            engines[name] = StreamEngineProcess(model, workdir / f"{name}.log",
                                                connector_config("burst", env.rdir, **kv_extra), **eng)
        if peer_python:
            server = LMCacheServer(peer_python, workdir, l1_gb=2.0)
            engines["peer"] = StreamEngineProcess(model, workdir / "peer.log", server.connector(),
                                                  python=peer_python, env=LMCacheServer.ENV, **eng)
        for e in engines.values():  # one-off costs (the first forward, connections): not measured
            e.ask({"prime": [draw(prefix_len // 2)]}, timeout=600)
        for r in range(rounds):
            for p in placements:
                prefixes = [draw(prefix_len) for _ in range(burst_n)]
                prime = [q + draw(1) for q in prefixes]
                stored_before = _copied(a) + _copied(b)
                if p == "kvtier_half_redis":
                    half = burst_n // 2
                    engines["b"].ask({"prime": prime[:half]}, timeout=600)
                    engines["a"].ask({"prime": prime[half:]}, timeout=600)
                else:
                    engines[{"floor": "floor", "kvtier_local": "a", "peer": "peer"}[p]].ask(
                        {"prime": prime}, timeout=600)
                if p.startswith("kvtier"):
                    need = burst_n * (prefix_len // bt)
                    Env.wait_for(lambda need=need, before=stored_before: _copied(a) + _copied(b) - before >= need,
                                 "the primed prefixes stored and written to Redis", timeout=300)
                elif p == "peer":
                    time.sleep(1.0)  # its saves are asynchronous, with no "stored" signal to wait on
                target = engines[{"floor": "floor", "kvtier_local": "a", "kvtier_half_redis": "b", "peer": "peer"}[p]]
                _say(f"burst round {r + 1}/{rounds}: {p}")
                job = {"decoders": [{"prompt": draw(64), "max_tokens": dec_tokens} for _ in range(decoders_n)],
                       "burst": [{"prompt": q + draw(32), "max_tokens": 2} for q in prefixes]}
                got = target.ask(job, timeout=600)
                res[p]["ttft"] += got["ttft"]
                res[p]["itl"] += got["itl"]
                res[p]["short"] += sum(c < prefix_len for c in got["cached"])
                res[p]["runs"] += 1
    finally:
        for e in engines.values():
            e.stop()
        if server is not None:
            server.close()
        b.close()
        a.close()
    out["burst"] = {"prefix_tokens": prefix_len, "burst": burst_n, "decoders": decoders_n, "rounds": rounds,
                    "cells": {p: {"ttft_p50_ms": _pct(v["ttft"], 0.5) * 1000,
                                  "ttft_p99_ms": _pct(v["ttft"], 0.99) * 1000,
                                  "itl_p50_ms": _pct(v["itl"], 0.5) * 1000, "itl_p99_ms": _pct(v["itl"], 0.99) * 1000,
                                  "itl_samples": len(v["itl"]), "not_fully_loaded": v["short"], "runs": v["runs"]}
                              for p, v in res.items()},
                    # Each kvtier engine's connector worker, as it stopped: blocks loaded, and
                    # loads that failed and were recomputed (`not_fully_loaded` counts promises).
                    "worker_loads": {name: worker_loads(workdir / f"{name}.log") for name in ("a", "b")}}


def _copied(env: Env) -> int:
    return int(env.stats().get("pools", {}).get("burst", {}).get("tiers", {}).get("redis", {}).get("copied_in", 0))


def burst_rows(out: dict) -> list[dict]:
    """The burst cells against the peer where it ran (else the floor), with the issue's targets."""
    t = out["burst"]["cells"]
    ref = "peer" if "peer" in t else "floor"
    rows = []
    for p, v in t.items():
        base = t[ref]
        for what, key in (("TTFT p99", "ttft_p99_ms"), ("ITL p99", "itl_p99_ms")):
            target = None
            if ref == "peer" and p == "kvtier_local":
                target = 0.8 if what == "TTFT p99" else 1.0
            ratio = v[key] / base[key] if base[key] else 0.0
            rows.append({"path": f"burst {p}: {what} (p50 {v[key.replace('p99', 'p50')]:.0f} ms), "
                                 f"{v['not_fully_loaded']} not fully loaded",
                         "figure": f"{v[key]:.0f} ms", "bound": f"{ref} {base[key]:.0f} ms", "ratio": ratio,
                         "target": f"<= {target}x {ref}" if target else "(reference)",
                         "meets": True if target is None else ratio <= target})
    return rows
