"""`kvtier bench --prefill`: the prefill-saved scenario.

N client processes replay one trace of requests. Each request is one of a few shared system
prompts (zipf over prompts: a few are hot) plus a private suffix. Each client looks the request
up, pulls what Redis holds, reads the cached prefix (every block checked against the bytes it
must hold), and "prefills" the rest by putting it. The tiers are smaller than the prompts'
working set, so blocks keep moving between gpu, cpu and Redis.

Reported: where the blocks read came from (per tier), the time to get a request's cached prefix,
and the prefill compute the hits avoided under a stated cost model.
"""

from __future__ import annotations

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
from kvtier.tools.bench import LLAMA
from kvtier.tools.bench_env import Env
from kvtier.tools.demo import make_trace, progress_line, shared_prompts, sum_reports

# The cost model's default: Llama-3-8B prefill costs about 2 x 8e9 FLOP per token; a GPU that
# sustains 400 TFLOP/s of bf16 in prefill then does about 25,000 tokens/s.
PREFILL_TOKENS_PER_S = 25_000
BLOCK_TOKENS = LLAMA["block_tokens"]


def run_prefill(args) -> int:
    prompts = shared_prompts(args.prefixes)
    prompt_blocks = sum(len(p) for p in prompts) // BLOCK_TOKENS
    print(f"kvtier bench --prefill: {args.clients} clients replay {args.requests} requests over {args.prefixes} "
          f"shared prompts ({prompt_blocks} blocks of 2 MiB); gpu {args.gpu_blocks} + cpu {args.cpu_blocks} blocks "
          f"local, the rest in Redis", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-prefill-") as tmp:
        work = Path(tmp)
        trace = work / "trace.json"
        trace.write_text(json.dumps(make_trace(args.requests, args.prefixes, args.seed)))
        env = Env(LLAMA, args.cpu_blocks, work, device=args.device, gpu_blocks=args.gpu_blocks)
        try:
            reports, wall = _replay(env, work, trace, args)
            stats = env.stats()
        finally:
            env.close()
    out = summarize(sum_reports(reports), args.prefill_tok_s)
    out.update(clients=args.clients, requests_in_trace=args.requests, prefixes=args.prefixes, wall_s=wall,
               gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks, daemon=stats.get("pools", {}).get("b", {}))
    print(render(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if out["wrong_blocks"]:
        print("kvtier bench --prefill: WRONG BYTES were read (a bug: please report it)", file=sys.stderr)
        return 1
    return 0


def _replay(env: Env, work: Path, trace: Path, args) -> tuple[list[dict], float]:
    env_vars = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                          os.environ.get("PYTHONPATH")]))}
    workers = [subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "_demo-worker", "--runtime-dir", str(env.rdir), "--pool", "b",
         "--prefixes", str(args.prefixes), "--seed", str(i), "--report", str(work / f"client-{i}.json"),
         "--trace", str(trace), "--share", str(i), "--shares", str(args.clients), "--think-s", "0.005"],
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


def summarize(tot: dict, tokens_per_s: float) -> dict:
    blocks = max(1, tot["blocks"])
    times = np.asarray(tot["prefix_s"]) if tot["prefix_s"] else np.zeros(1)
    hit_tokens = tot["local_hits"] * BLOCK_TOKENS
    avoided_s = hit_tokens / tokens_per_s
    fetch_s = float(times.sum())
    block_bytes = BlockLayout(**LLAMA).block_bytes
    return {
        "requests": tot["requests"],
        "blocks_wanted": tot["blocks"],
        "hit_rate": {"gpu": tot["gpu_at_lookup"] / blocks, "cpu": tot["cpu_at_lookup"] / blocks,
                     "redis": tot["via_redis"] / blocks, "miss": (tot["blocks"] - tot["local_hits"]) / blocks},
        "prefix_ms": {"p50": 1000 * float(np.percentile(times, 50)), "p90": 1000 * float(np.percentile(times, 90)),
                      "p99": 1000 * float(np.percentile(times, 99)),
                      "mean_per_block": 1000 * fetch_s / max(1, tot["local_hits"])},
        "redis_pulls": {"requests": tot["pulls"], "timed_out": tot["pull_timeouts"], "wait_s": tot["pull_s"]},
        # A cached block saves time only if it arrives faster than its tokens are recomputed.
        "break_even_gbps": block_bytes * tokens_per_s / BLOCK_TOKENS / 1e9,
        "cost_model": {"prefill_tokens_per_s": tokens_per_s,
                       "basis": "Llama-3-8B, 2 x 8e9 FLOP per token, at a sustained 400 TFLOP/s (bf16)"
                       if tokens_per_s == PREFILL_TOKENS_PER_S else "as given on the command line"},
        "hit_tokens": hit_tokens,
        "recompute_avoided_s": avoided_s,
        "fetch_s": fetch_s,
        "net_saved_s": avoided_s - fetch_s,
        # The same account for each source: local tiers (resident at lookup) and Redis pulls.
        "local": {"avoided_s": (tot["gpu_at_lookup"] + tot["cpu_at_lookup"]) * BLOCK_TOKENS / tokens_per_s,
                  "spent_s": fetch_s - tot["pull_s"]},
        "redis": {"avoided_s": tot["via_redis"] * BLOCK_TOKENS / tokens_per_s, "spent_s": tot["pull_s"]},
        "wrong_blocks": tot["wrong_blocks"],
        "put_dropped": tot["put_dropped"],
    }


def render(o: dict) -> str:
    h, p = o["hit_rate"], o["prefix_ms"]
    return "\n".join([
        f"requests {o['requests']}, blocks wanted {o['blocks_wanted']}, wall {o['wall_s']:.1f} s",
        f"blocks read from: gpu {h['gpu']:.1%}  cpu {h['cpu']:.1%}  redis (pulled, then read) {h['redis']:.1%}  "
        f"missed (recomputed) {h['miss']:.1%}",
        f"time to get the cached prefix, per request that had one: p50 {p['p50']:.1f} ms  p90 {p['p90']:.1f} ms  "
        f"p99 {p['p99']:.1f} ms  ({p['mean_per_block']:.2f} ms per block read)",
        f"of which pulling from Redis: {o['redis_pulls']['requests']} requests "
        f"waited {o['redis_pulls']['wait_s']:.2f} s "
        f"in all ({o['redis_pulls']['timed_out']} gave up after 1 s and recomputed the rest),",
        f"and the rest ({o['local']['spent_s']:.2f} s) reading local tiers",
        f"cost model: prefill at {o['cost_model']['prefill_tokens_per_s']:,.0f} tokens/s "
        f"({o['cost_model']['basis']}); a 2 MiB block of 16 tokens must arrive at "
        f"{o['break_even_gbps']:.1f} GB/s or more to beat recomputing it",
        f"prefill avoided: {o['hit_tokens']:,} tokens = {o['recompute_avoided_s']:.2f} s of GPU time, for "
        f"{o['fetch_s']:.2f} s spent getting them: net {o['net_saved_s']:+.2f} s",
        f"  from local tiers: {o['local']['avoided_s']:.2f} s avoided for {o['local']['spent_s']:.2f} s reading; "
        f"from Redis: {o['redis']['avoided_s']:.2f} s avoided for {o['redis']['spent_s']:.2f} s pulling",
        f"wrong blocks read: {o['wrong_blocks']}, puts dropped: {o['put_dropped']}",
    ])
