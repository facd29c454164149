"""A real vLLM engine driven line by line, for the connector's tests and `kvtier bench --vllm`.

    python -m kvtier.tools.vllm_engine make-model DIR
        saves a tiny random Llama (2 layers, 2 KV heads of 32 dims, float32) with a WordLevel
        tokenizer: no hub download; starts a CPU `vllm.LLM` in about 20 s.
    python -m kvtier.tools.vllm_engine serve --model DIR [--kv-transfer-config JSON] [--block-size 32]
        starts `vllm.LLM`, prints `KVTIER-READY`, then reads one JSON request a line from stdin:
        {"prompt": [token ids], "max_tokens": 8, "cache_salt": "..."} and answers each with
        `KVTIER-RESULT {"tokens": [...], "cached": n, "seconds": s}` (the generate call's wall
        time: with max_tokens=1, the time to first token). vLLM's own logs go to stderr.

`EngineProcess` runs `serve` in a child process and drives it request by request.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvtier.tools.engine_zygote import ENGINE_ENV, ForkedEngine, fork_engine

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
# What a kvtier pool for the tiny model must say (vLLM's CPU pages: 2 layers x 16 KiB per block).
TINY_POOL = dict(layers=2, kv_heads=2, head_dim=32, block_tokens=32, dtype="float32")


def make_model(path: str | Path, seed: int = 0, **config) -> Path:
    """The tiny random Llama; `config` adds to its LlamaConfig (layer_types and sliding_window make
    it a hybrid of sliding-window and full-attention layers)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config}, bos_token_id=1, eos_token_id=2, torch_dtype="float32"))
    model.save_pretrained(path)
    return path


def make_mla_model(path: str | Path, seed: int = 0) -> Path:
    """A tiny random DeepSeek-V2 (MLA: one latent page of kv_lora_rank 512 + rope 64 = 576 per
    layer and token, the only head size vLLM's CPU MLA backend takes), dense layers only, with the
    tiny Llama's tokenizer. vLLM's CPU build runs it with 16-token blocks and its own prefix cache
    off."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = make_model(path, seed)  # the tokenizer (and Llama weights, replaced below)
    for f in path.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=TINY["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                           first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           n_shared_experts=1, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    DeepseekV2ForCausalLM(cfg).save_pretrained(path)
    return path


def make_eagle_draft(path: str | Path, seed: int = 0) -> Path:
    """A random EAGLE draft for the tiny Llama (vLLM's EagleLlamaForCausalLM: `fc` over the token
    embedding and the target's hidden state, one decoder layer without its input norm; the
    target's embedding and lm_head are shared). Speculation with it is lossless: the target
    verifies every drafted token."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 1}, torch_dtype="float32", architectures=["LlamaForCausalLM"])
    layer = {k.removeprefix("model."): v.contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()
             if k.startswith("model.layers.0.") and "input_layernorm" not in k}
    layer["fc.weight"] = torch.randn(TINY["hidden_size"], 2 * TINY["hidden_size"]) * 0.02
    save_file(layer, str(path / "model.safetensors"))
    cfg.save_pretrained(path)
    return path


def answer_channel():
    """The engine process's answer line: answers go to the real stdout; everything else that
    writes to fd 1 (vLLM logs to stdout) is sent to stderr, so a driver reads nothing but answers."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(line: str) -> None:
        answers.write(line + "\n")
        answers.flush()

    return answer


def serve(args: argparse.Namespace) -> None:
    answer = answer_channel()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(**json.loads(args.kv_transfer_config)) if args.kv_transfer_config else None
    extra = {}
    if args.kv_events_config:
        from vllm.config.kv_events import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.attention_backend:
        extra["attention_backend"] = args.attention_backend
    llm = LLM(model=args.model, block_size=args.block_size, max_model_len=args.max_model_len, dtype=args.dtype,
              enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching, kv_transfer_config=kv, seed=0,
              served_model_name=args.served_model_name or None, tensor_parallel_size=args.tensor_parallel_size,
              speculative_config=json.loads(args.speculative_config) if args.speculative_config else None, **extra)
    answer("KVTIER-READY")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        batch = req["batch"] if "batch" in req else [req]  # a batch: run together, as one engine's load
        prompts, params = [], []
        for r in batch:
            prompt = {"prompt_token_ids": r["prompt"]}
            if r.get("cache_salt"):
                prompt["cache_salt"] = r["cache_salt"]
            prompts.append(prompt)
            extra_args = {"kv_transfer_params": r["kv_transfer_params"]} if r.get("kv_transfer_params") else None
            params.append(SamplingParams(max_tokens=int(r.get("max_tokens", 8)), temperature=0.0, ignore_eos=True,
                                         logprobs=1 if r.get("logprobs") else None, extra_args=extra_args))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        results = []
        for out in outs:
            o = out.outputs[0]
            res = {"tokens": list(o.token_ids), "cached": int(out.num_cached_tokens or 0), "seconds": dt}
            if o.logprobs is not None:  # the chosen token's logprob at each step
                res["logprobs"] = [float(step[t].logprob) for t, step in zip(o.token_ids, o.logprobs)]
            results.append(res)
        answer("KVTIER-RESULT " + json.dumps(results if "batch" in req else results[0]))
    # vLLM's own exit path force-kills the engine core 5 s after asking it to stop, and its worker
    # alone may take that long on a busy host: the connector's scheduler half, which logs its
    # counts last, would die unlogged. Stop it here with room to finish.
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_STOP_S)


ENGINE_START_S = 180.0  # a cold start on 2 busy cores; about 20 s when the machine is idle
REQUEST_S = 60.0
ENGINE_STOP_S = 30.0  # an engine's orderly stop (about 3 s when idle); EngineProcess.stop waits longer


def connector_config(pool: str, runtime_dir: Path, role: str = "kv_both", **extra) -> dict:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"pool": pool, "runtime_dir": str(runtime_dir), **extra}}


class EngineProcess:
    def __init__(self, model: Path, log_path: Path, kv_transfer_config: dict | None = None,
                 prefix_caching: bool = True, env: dict | None = None, kv_events_config: dict | None = None,
                 served_model_name: str = "", speculative_config: dict | None = None,
                 tensor_parallel_size: int = 1, kv_cache_mib: int = 0, max_num_seqs: int = 0,
                 max_num_batched_tokens: int = 0, max_model_len: int = 0, dtype: str = "",
                 python: str | None = None, attention_backend: str = "", fork: bool = True) -> None:
        # `python`: another venv's interpreter (the LMCache peer runs in .venv-lmcache). `fork`:
        # from the engine zygote where there is one (engine_zygote.py); False: a process afresh.
        cmd = [python or sys.executable, "-m", "kvtier.tools.vllm_engine", "serve", "--model", str(model)]
        if dtype:
            cmd += ["--dtype", dtype]
        if attention_backend:
            cmd += ["--attention-backend", attention_backend]
        for flag, v in (("--kv-cache-mib", kv_cache_mib), ("--max-num-seqs", max_num_seqs),
                        ("--max-num-batched-tokens", max_num_batched_tokens), ("--max-model-len", max_model_len)):
            if v:
                cmd += [flag, str(v)]
        if served_model_name:
            cmd += ["--served-model-name", served_model_name]
        if tensor_parallel_size != 1:
            cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(speculative_config)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if kv_events_config is not None:  # vLLM's own KV-event publisher (KVEventsConfig's fields)
            cmd += ["--kv-events-config", json.dumps(kv_events_config)]
        if not prefix_caching:
            cmd.append("--no-prefix-caching")
        self._spawn(cmd, log_path, env, fork)

    def _spawn(self, cmd: list[str], log_path: Path, env: dict | None, fork: bool = True) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        # Forked from a process that has imported vLLM, where the tests started one (engine_zygote.py).
        self.proc: subprocess.Popen[bytes] | ForkedEngine = (
            (fork_engine(cmd, full_env, self._log) if fork else None)
            or subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=full_env))
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._expect("KVTIER-READY", ENGINE_START_S)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with prefix; fails with the log tail on exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise RuntimeError(f"no {prefix} from the engine within {timeout:.0f} s:\n{self.log_tail()}") from None
            if line is None:
                raise RuntimeError(f"engine exited ({self.proc.wait()}) before {prefix}:\n{self.log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def generate(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None, *,
                 logprobs: bool = False, kv_transfer_params: dict | None = None) -> dict:
        return self._ask({"prompt": prompt, "max_tokens": max_tokens, "cache_salt": cache_salt,
                          "logprobs": logprobs, "kv_transfer_params": kv_transfer_params})

    def generate_batch(self, requests: list[dict], timeout: float = 300.0) -> list[dict]:
        """Requests (generate's fields as a dict each) run together in one `LLM.generate`."""
        return self._ask({"batch": requests}, timeout)

    def ask(self, req: dict, timeout: float = REQUEST_S):
        return self._ask(req, timeout)

    def _ask(self, req: dict, timeout: float = REQUEST_S):
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        return json.loads(self._expect("KVTIER-RESULT", timeout))

    def log_tail(self, n: int = 6000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the engine's loop ends and it shuts down cleanly
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class StreamEngineProcess(EngineProcess):
    """kvtier/tools/vllm_stream_engine.py in its own process (AsyncLLM, streamed timestamps): `ask`
    it {"prime": [...]} or {"decoders": [...], "burst": [...]}."""

    def __init__(self, model: Path, log_path: Path, kv_transfer_config: dict | None = None, *,
                 prefix_caching: bool = False, dtype: str = "bfloat16", max_model_len: int = 4096,
                 kv_cache_mib: int = 512, max_num_seqs: int = 16, max_num_batched_tokens: int = 0,
                 python: str | None = None, env: dict | None = None) -> None:
        cmd = [python or sys.executable, "-m", "kvtier.tools.vllm_stream_engine", "--model", str(model),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-mib", str(kv_cache_mib),
               "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if prefix_caching:
            cmd.append("--prefix-caching")
        self._spawn(cmd, log_path, env)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tools.vllm_engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model")
    mk.add_argument("dir")
    sv = sub.add_parser("serve")
    sv.add_argument("--model", required=True)
    sv.add_argument("--kv-transfer-config", default="")
    sv.add_argument("--kv-events-config", default="", help="vLLM KVEventsConfig fields as JSON")
    sv.add_argument("--block-size", type=int, default=32)
    sv.add_argument("--max-model-len", type=int, default=4096)
    sv.add_argument("--kv-cache-mib", type=int, default=64)
    sv.add_argument("--no-prefix-caching", action="store_true")
    sv.add_argument("--served-model-name", default="", help="the name vLLM serves the model as")
    sv.add_argument("--speculative-config", default="", help="vLLM's speculative_config as JSON")
    sv.add_argument("--tensor-parallel-size", type=int, default=1)
    sv.add_argument("--max-num-seqs", type=int, default=4)
    sv.add_argument("--dtype", default="float32", help="the model's compute dtype (and the KV cache's)")
    sv.add_argument("--attention-backend", default="", help="vLLM's attention backend by name (default: its choice)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    args = ap.parse_args(argv)
    if args.cmd == "make-model":
        print(make_model(args.dir))
    else:
        serve(args)


if __name__ == "__main__":
    main()
