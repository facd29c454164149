"""A streaming vLLM engine process for the load benchmark (`kvtier bench --vllm`, the burst table).

`python -m kvtier.tools.vllm_stream_engine --model DIR [...]` starts vLLM's `AsyncLLM`, prints
`KVTIER-READY`, then reads one JSON job a line from stdin and answers `KVTIER-RESULT {...}`:
- {"prime": [prompt, ...]}: each prompt computed (max_tokens 1), one after another;
- {"decoders": [{"prompt", "max_tokens"}], "burst": [{"prompt", "max_tokens"}]}: the decoders
  start; once each has produced two tokens the burst arrives at once. Timestamps are taken in
  this process as each output arrives: the burst's time to first token, and the decoders'
  inter-token gaps that end while the burst is being served (from its arrival to its last
  first token).
Answers go to the real stdout; vLLM's own output goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from kvtier.tools.vllm_engine import ENGINE_STOP_S, answer_channel


async def _stream(engine, rid: str, prompt: list[int], max_tokens: int, times: list[float], out: dict) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seen = 0
    async for o in engine.generate({"prompt_token_ids": prompt}, params, rid):
        n = len(o.outputs[0].token_ids)
        now = time.perf_counter()
        times.extend([now] * (n - seen))
        seen = n
        out["cached"] = int(o.num_cached_tokens or 0)
        out["tokens"] = list(o.outputs[0].token_ids)


async def _burst(engine, job: dict, seq: list[int]) -> dict:
    def rid() -> str:
        seq[0] += 1
        return f"r{seq[0]}"

    dec_times: list[list[float]] = [[] for _ in job["decoders"]]
    dec_out: list[dict] = [{} for _ in job["decoders"]]
    decoders = [asyncio.create_task(_stream(engine, rid(), d["prompt"], d["max_tokens"], t, o))
                for d, t, o in zip(job["decoders"], dec_times, dec_out)]
    while any(len(t) < 2 for t in dec_times):
        if any(d.done() for d in decoders):
            raise RuntimeError("a decoder finished before the burst: give it more max_tokens")
        await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    b_times: list[list[float]] = [[] for _ in job["burst"]]
    b_out: list[dict] = [{} for _ in job["burst"]]
    await asyncio.gather(*(_stream(engine, rid(), b["prompt"], b["max_tokens"], t, o)
                           for b, t, o in zip(job["burst"], b_times, b_out)))
    t_end = max(t[0] for t in b_times)
    await asyncio.gather(*decoders)
    gaps = [b - a for t in dec_times for a, b in zip(t, t[1:]) if t0 < b <= t_end]
    return {"ttft": [t[0] - t0 for t in b_times], "cached": [o["cached"] for o in b_out],
            "tokens": [o["tokens"] for o in b_out], "itl": gaps, "window_s": t_end - t0,
            "decoder_tokens": [len(t) for t in dec_times]}


async def _prime(engine, prompts: list[list[int]], seq: list[int]) -> dict:
    cached = []
    for p in prompts:
        seq[0] += 1
        out: dict = {}
        await _stream(engine, f"r{seq[0]}", p, 1, [], out)
        cached.append(out["cached"])
    return {"cached": cached}


async def serve(args: argparse.Namespace) -> None:
    answer = answer_channel()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kv = KVTransferConfig(**json.loads(args.kv_transfer_config)) if args.kv_transfer_config else None
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, block_size=32, max_model_len=args.max_model_len, dtype=args.dtype, enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or None, enable_prefix_caching=args.prefix_caching,
        kv_transfer_config=kv, seed=0))
    answer("KVTIER-READY")
    loop = asyncio.get_running_loop()
    seq = [0]
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if not line.strip():
                continue
            job = json.loads(line)
            res = await (_prime(engine, job["prime"], seq) if "prime" in job else _burst(engine, job, seq))
            answer("KVTIER-RESULT " + json.dumps(res))
    finally:
        engine.shutdown(timeout=ENGINE_STOP_S)  # room for the connector to log its counts (vllm_engine.serve)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.vllm_stream_engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-transfer-config", default="")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--prefix-caching", action="store_true")
    asyncio.run(serve(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
