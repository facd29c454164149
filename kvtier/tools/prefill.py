"""`kvtier bench --prefill`: the prefill-saved scenario.

N client processes replay one trace of requests. Each request is one of a few shared system
prompts (zipf over prompts: a few are hot) plus a private suffix. Each client reads the cached
prefix, by read-through (the local head from shared memory, the rest straight from Redis) or
with `--pull` by prefetch and wait; checks every block against the bytes it must hold; waits the
prefill time of the rest at the cost model's rate (the GPU's time, not the CPU's); and puts it.
The tiers are smaller than the prompts' working set, so blocks keep moving between gpu, cpu and
Redis.

Reported: where the blocks read came from (per tier), the time to get a request's cached prefix,
and the prefill compute the hits avoided under a stated cost model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.layout import BlockLayout
from kvtier.processes import die_with_parent, stop_processes
from kvtier.tools.bench_basics import LLAMA, memcpy_gbps
from kvtier.tools.bench_env import Env
from kvtier.tools.demo import make_trace, progress_line, shared_prompts, sum_reports

# The cost model's defaults: prefill costs about 2 x parameters FLOP per token; a GPU that
# sustains 400 TFLOP/s of bf16 in prefill then does about 25,000 tokens/s of Llama-3-8B and
# 2,857 of a 70B-class model.
PREFILL_TOKENS_PER_S = 25_000
LLAMA70B = dict(model="llama3-70b", layers=80, kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
LAYOUTS = {"llama8b": (LLAMA, 25_000, "Llama-3-8B"), "llama70b": (LLAMA70B, 2_857, "a 70B-class model")}
BLOCK_TOKENS = LLAMA["block_tokens"]
RAW_BOUND_BLOCKS = 64  # values the raw GET + copy bound is measured over, at the end of the run


def run_prefill(args) -> int:
    layout, default_tok_s, model = LAYOUTS[getattr(args, "layout", "llama8b")]
    tok_s = args.prefill_tok_s or default_tok_s
    bb = BlockLayout(**layout).block_bytes
    prompts = shared_prompts(args.prefixes)
    prompt_blocks = sum(len(p) for p in prompts) // BLOCK_TOKENS
    mode = "pull (prefetch, then wait)" if args.pull else "read-through"
    print(f"kvtier bench --prefill: {args.clients} clients replay {args.requests} requests over {args.prefixes} "
          f"shared prompts ({prompt_blocks} blocks of {bb / (1 << 20):.2f} MiB, {model}); gpu {args.gpu_blocks} + "
          f"cpu {args.cpu_blocks} blocks local, the rest in Redis; {mode}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-prefill-") as tmp:
        work = Path(tmp)
        trace = work / "trace.json"
        trace.write_text(json.dumps(make_trace(args.requests, args.prefixes, args.seed)))
        env = Env(layout, args.cpu_blocks, work, device=args.device, gpu_blocks=args.gpu_blocks)
        try:
            reports, wall = _replay(env, work, trace, args, tok_s)
            stats = env.stats()
            print("kvtier bench --prefill: the raw bound: redis-py GET + copy of the same values", flush=True)
            raw_gbps = asyncio.run(_raw_bound(env.url, bb))
        finally:
            env.close()
    out = summarize(sum_reports(reports), tok_s, bb, raw_gbps, memcpy_gbps(64 * bb, 3))
    out.update(clients=args.clients, requests_in_trace=args.requests, prefixes=args.prefixes, wall_s=wall,
               gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks, layout=layout, mode=mode,
               daemon=stats.get("pools", {}).get("b", {}))
    print(render(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if out["wrong_blocks"]:
        print("kvtier bench --prefill: WRONG BYTES were read (a bug: please report it)", file=sys.stderr)
        return 1
    return 0


def _replay(env: Env, work: Path, trace: Path, args, tok_s: float) -> tuple[list[dict], float]:
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                          os.environ.get("PYTHONPATH")]))}
    workers = [subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "_demo-worker", "--runtime-dir", str(env.rdir), "--pool", "b",
         "--prefixes", str(args.prefixes), "--seed", str(i), "--report", str(work / f"client-{i}.json"),
         "--trace", str(trace), "--share", str(i), "--shares", str(args.clients), "--think-s", "0.005",
         "--compute-tok-s", str(tok_s), *(["--pull"] if args.pull else [])],
        env=env_vars, preexec_fn=die_with_parent) for i in range(args.clients)]
    t0 = time.monotonic()
    try:
        while alive := [w for w in workers if w.poll() is None]:
            if time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"the clients did not finish the trace in {args.timeout:.0f} s")
            try:
                alive[0].wait(timeout=2.0)  # a progress line every 2 s until all have finished
            except subprocess.TimeoutExpired:
                pass
            print(progress_line(env.stats(), t0), flush=True)
    finally:
        stop_processes(workers, 5)  # only those still running: on a timeout or an error
    failed = [i for i, w in enumerate(workers) if w.returncode != 0]
    if failed:
        raise RuntimeError(f"clients {failed} failed (exit codes {[workers[i].returncode for i in failed]})")
    return [json.loads((work / f"client-{i}.json").read_text()) for i in range(args.clients)], time.monotonic() - t0


async def _raw_bound(url: str, bb: int) -> float:
    """redis-py's best GET + copy rate over block values the run left in Redis (same server, same
    bytes); 0 when there are none."""
    from kvtier.bus.connect import make_redis
    from kvtier.tools.bench_redis import raw_get_copy_gbps

    r = make_redis(url, socket_timeout=60, connect_timeout=5, retries=1)
    try:
        names = [n async for n in r.scan_iter(match="kvtier:blk:b:*", count=1000)][:RAW_BOUND_BLOCKS]
        if not names:
            return 0.0
        return float((await raw_get_copy_gbps(r, names, bb, 3))["gbps"])
    finally:
        await r.aclose()


def summarize(tot: dict, tokens_per_s: float, block_bytes: int = 0, raw_gbps: float = 0.0,
              memcpy: float = 0.0) -> dict:
    block_bytes = block_bytes or BlockLayout(**LLAMA).block_bytes
    blocks = max(1, tot["blocks"])
    times = np.asarray(tot["prefix_s"]) if tot["prefix_s"] else np.zeros(1)
    hit_tokens = tot["local_hits"] * BLOCK_TOKENS
    avoided_s = hit_tokens / tokens_per_s
    # Every request's time to get its prefix counts, also one that found nothing (it asked Redis).
    fetch_s = float(tot.get("attempt_s") or times.sum())
    # The raw transfer time of each request's cached prefix: its Redis part at redis-py's GET +
    # copy rate, its local part at memcpy speed, both measured in this run.
    split = np.asarray(tot.get("prefix_blocks") or [[0, 0]], dtype=np.float64)
    raw_s = (split[:, 1] * block_bytes / (raw_gbps * 1e9) if raw_gbps else np.zeros(len(split))) + \
        (split[:, 0] * block_bytes / (memcpy * 1e9) if memcpy else np.zeros(len(split)))
    return {
        "requests": tot["requests"],
        "blocks_wanted": tot["blocks"],
        "hit_rate": {"gpu": tot["gpu_at_lookup"] / blocks, "cpu": tot["cpu_at_lookup"] / blocks,
                     "redis": tot["via_redis"] / blocks, "miss": (tot["blocks"] - tot["local_hits"]) / blocks},
        "prefix_ms": {"p50": 1000 * float(np.percentile(times, 50)), "p90": 1000 * float(np.percentile(times, 90)),
                      "p99": 1000 * float(np.percentile(times, 99)),
                      "mean_per_block": 1000 * fetch_s / max(1, tot["local_hits"])},
        "raw_prefix_ms": {"p50": 1000 * float(np.percentile(raw_s, 50)), "p90": 1000 * float(np.percentile(raw_s, 90)),
                          "redis_gbps": raw_gbps, "memcpy_gbps": memcpy},
        "redis_pulls": {"requests": tot["pulls"], "timed_out": tot["pull_timeouts"], "wait_s": tot["pull_s"],
                        "failed": tot.get("remote_failures", 0),
                        # of wait_s: asking Redis for blocks it did not have, and how often
                        "empty_asks": tot.get("asks_empty", 0), "empty_ask_s": tot.get("ask_s", 0.0)},
        # A cached block saves time only if it arrives faster than its tokens are recomputed.
        "break_even_gbps": block_bytes * tokens_per_s / BLOCK_TOKENS / 1e9,
        "cost_model": {"prefill_tokens_per_s": tokens_per_s,
                       "basis": "prefill at 2 x parameters FLOP per token, at a sustained 400 TFLOP/s (bf16)"},
        "hit_tokens": hit_tokens,
        "recompute_avoided_s": avoided_s,
        "fetch_s": fetch_s,
        "net_saved_s": avoided_s - fetch_s,
        # The same account for each source: local tiers (resident at lookup) and Redis.
        "local": {"avoided_s": (tot["gpu_at_lookup"] + tot["cpu_at_lookup"]) * BLOCK_TOKENS / tokens_per_s,
                  "spent_s": fetch_s - tot["pull_s"]},
        "redis": {"avoided_s": tot["via_redis"] * BLOCK_TOKENS / tokens_per_s, "spent_s": tot["pull_s"]},
        "wrong_blocks": tot["wrong_blocks"],
        "put_dropped": tot["put_dropped"],
    }


def render(o: dict) -> str:
    h, p, raw = o["hit_rate"], o["prefix_ms"], o["raw_prefix_ms"]
    mb = o.get("layout") and BlockLayout(**o["layout"]).block_bytes / (1 << 20) or 2.0
    ratio = p["p90"] / raw["p90"] if raw["p90"] else float("nan")
    return "\n".join([
        f"requests {o['requests']}, blocks wanted {o['blocks_wanted']}, wall {o['wall_s']:.1f} s ({o.get('mode', '')})",
        f"blocks read from: gpu {h['gpu']:.1%}  cpu {h['cpu']:.1%}  redis {h['redis']:.1%}  "
        f"missed (recomputed) {h['miss']:.1%}",
        f"time to get the cached prefix, per request that had one: p50 {p['p50']:.1f} ms  p90 {p['p90']:.1f} ms  "
        f"p99 {p['p99']:.1f} ms  ({p['mean_per_block']:.2f} ms per block read)",
        f"raw transfer time of the same bytes (Redis part at redis-py GET + copy, {raw['redis_gbps']:.2f} GB/s; "
        f"local part at memcpy, {raw['memcpy_gbps']:.2f} GB/s): p50 {raw['p50']:.1f} ms  p90 {raw['p90']:.1f} ms;"
        f" p90 ratio {ratio:.2f}",
        f"requests that read from Redis: {o['redis_pulls']['requests']}; Redis took "
        f"{o['redis_pulls']['wait_s']:.2f} s in all, {o['redis_pulls'].get('empty_ask_s', 0.0):.2f} s of it "
        f"asking for blocks it did not have ({o['redis_pulls'].get('empty_asks', 0)} requests) "
        f"({o['redis_pulls']['timed_out']} pulls gave up after 1 s, "
        f"{o['redis_pulls']['failed']} read-throughs were cut short by an error or timeout),",
        f"and the rest ({o['local']['spent_s']:.2f} s) reading local tiers",
        f"cost model: prefill at {o['cost_model']['prefill_tokens_per_s']:,.0f} tokens/s "
        f"({o['cost_model']['basis']}); a {mb:.0f} MiB block of 16 tokens must arrive at "
        f"{o['break_even_gbps']:.2f} GB/s or more to beat recomputing it",
        f"prefill avoided: {o['hit_tokens']:,} tokens = {o['recompute_avoided_s']:.2f} s of GPU time, for "
        f"{o['fetch_s']:.2f} s spent getting them: net {o['net_saved_s']:+.2f} s",
        f"  from local tiers: {o['local']['avoided_s']:.2f} s avoided for {o['local']['spent_s']:.2f} s reading; "
        f"from Redis: {o['redis']['avoided_s']:.2f} s avoided for {o['redis']['spent_s']:.2f} s reading "
        f"(net {o['redis']['avoided_s'] - o['redis']['spent_s']:+.2f} s)",
        f"wrong blocks read: {o['wrong_blocks']}, puts dropped: {o['put_dropped']}",
    ])
