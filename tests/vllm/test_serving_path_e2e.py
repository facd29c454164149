"""The serving path on real vLLM engines (CPU build), two kvtier nodes on one Redis (issue 29).

- A second turn, whose prompt is the first turn's prompt and answer, loads the first turn's
  decode blocks on another node (the last of them saved after the request finished, while
  vLLM held its blocks), with the output of an engine without kvtier.
- Twelve requests whose prefixes kvtier holds arrive together with four that decode, under
  chunked prefill: their loads run asynchronously beside the decoders, every prefix is loaded,
  and every output is the no-connector engine's up to drift.
- Preemption: a KV cache too small for the batch, with and without the connector.
- A request whose kv_transfer_params ask for a session pin has its blocks pinned once it finishes.

vLLM's CPU kernels are not batch-invariant: a request batched differently drifts by about 1e-2
in logprob and may then part at a near-tie. Wrong KV shifts the logprobs far more, and before
the outputs part. So outputs are judged by their chosen-token logprobs (`agree`).
"""

from __future__ import annotations

import random

import pytest

from kvtier.tools.vllm_engine import EngineProcess
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, SEPARATE_PROCESSES, connector_config, connector_counts, loaded

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

_rng = random.Random(29)


def toks(n: int) -> list[int]:
    return [_rng.randrange(3, 512) for _ in range(n)]


T1 = toks(200)
TURN1_TOKENS = 89  # 200 + 89 - 1 = 288 tokens computed: the last (9th) block completes in the last step
TAIL2 = toks(20)
BURST_PREFIXES = [toks(10 * BS) for _ in range(12)]
BURST = [{"prompt": p + toks(8), "max_tokens": 4, "logprobs": True} for p in BURST_PREFIXES]
DECODERS = [{"prompt": toks(40), "max_tokens": 48, "logprobs": True} for _ in range(4)]
PREEMPT = [{"prompt": p[:3 * BS] + toks(5), "max_tokens": 96, "logprobs": True} for p in BURST_PREFIXES]
PINNED = toks(3 * BS + 5)  # an agent's turn that asks kvtier to keep its three blocks
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, prefix_caching=False)  # chunked prefill
SMALL = dict(max_num_seqs=12, kv_cache_mib=1, max_model_len=512, prefix_caching=False)  # 32 blocks for ~80 needed
TOL = 0.05  # chosen-token logprob drift allowed (measured: at most 0.008)


def agree(a: dict, b: dict) -> bool:
    """Same tokens, or parting at a near-tie after chosen-token logprobs that stayed within TOL
    (compared up to and including the step where they part)."""
    for x, y, lx, ly in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        if abs(lx - ly) > TOL:
            return False
        if x != y:
            return True
    return len(a["tokens"]) == len(b["tokens"])


@pytest.fixture(scope="module")
def record(tiny_model, tmp_path_factory, node_factory) -> dict:
    a, b = node_factory("serve-a"), node_factory("serve-b")
    logs = tmp_path_factory.mktemp("engines")
    rec: dict = {}
    with EngineProcess(tiny_model, logs / "base.log", **ENGINE) as e:
        rec["base_t1"] = e.generate(T1, TURN1_TOKENS)
        t2 = T1 + rec["base_t1"]["tokens"] + TAIL2
        rec["base_t2"] = e.generate(t2)
        rec["base_burst"] = e.generate_batch(BURST + DECODERS)
    with EngineProcess(tiny_model, logs / "base-small.log", **SMALL) as e:
        rec["base_preempt"] = e.generate_batch(PREEMPT)
    # Engine A in vLLM's default processes, as `vllm serve` runs it: the decode-block saves, the
    # pin and the async loads beside decoders cross from the scheduler to the worker process.
    with EngineProcess(tiny_model, logs / "a.log", connector_config(POOL, a.runtime_dir), env=SEPARATE_PROCESSES,
                       **ENGINE) as e:
        rec["a_t1"] = e.generate(T1, TURN1_TOKENS)
        e.generate(PINNED, 4, kv_transfer_params={"kvtier": {"pin_s": 600, "tenant": "agent-7"}})
        wait_until(lambda: (a.pool_stats(POOL).get("pins") or {}).get("blocks") == 3, timeout=30,
                   message="the finished request's blocks pinned")
        rec["a_pins"] = a.pool_stats(POOL)["pins"]
        # The prefixes, computed and saved once (a request's own next one would find them too).
        e.generate_batch([{"prompt": p + [7], "max_tokens": 1} for p in BURST_PREFIXES])
        wait_until(lambda: a.pool_stats(POOL)["tiers"]["redis"]["copied_in"] >= 9 + 12 * 10, timeout=60,
                   message="turn one's nine blocks and the twelve prefixes stored and in Redis")
        rec["a_burst"] = e.generate_batch(BURST + DECODERS)
    rec["a_log"] = (logs / "a.log").read_text(errors="replace")
    with EngineProcess(tiny_model, logs / "a-small.log", connector_config(POOL, a.runtime_dir), **SMALL) as e:
        rec["a_preempt"] = e.generate_batch(PREEMPT)
    rec["a_small_log"] = (logs / "a-small.log").read_text(errors="replace")
    with EngineProcess(tiny_model, logs / "b.log", connector_config(POOL, b.runtime_dir), **ENGINE) as e:
        rec["b_t2"] = e.generate(T1 + rec["a_t1"]["tokens"] + TAIL2)
    rec["b_log"] = (logs / "b.log").read_text(errors="replace")
    return rec


def test_a_second_turn_loads_the_first_turns_decode_blocks_on_another_node(record):
    assert "(EngineCore pid=" in record["a_log"] and "(Worker pid=" in record["a_log"]  # saved across processes
    assert record["a_t1"]["tokens"] == record["base_t1"]["tokens"]
    # Turn one computed 288 tokens: 6 prompt blocks, 3 decode blocks, the last completed in its
    # final step. Turn two (309 tokens) may load 9 blocks: all of them, from Redis on node B.
    assert record["b_t2"]["cached"] == 9 * BS
    assert record["b_t2"]["tokens"] == record["base_t2"]["tokens"]
    w = connector_counts(record["b_log"], "worker")
    assert loaded(w, "remote") == 9, w


def test_a_request_that_asks_for_a_pin_has_its_blocks_pinned_once_it_finishes(record):
    pins = record["a_pins"]
    assert pins["tenants"] == {"agent-7": 3} and pins["retained"] == 3 and pins["refused_budget"] == 0
    assert connector_counts(record["a_log"])["pinned_blocks"] == 3


def test_twelve_loads_beside_four_decoders_all_load_and_agree_with_no_connector(record):
    burst, base = record["a_burst"], record["base_burst"]
    assert [r["cached"] for r in burst[:12]] == [10 * BS] * 12  # every prefix loaded
    assert [r["cached"] for r in burst[12:]] == [0] * 4
    assert all(agree(x, y) for x, y in zip(burst, base))
    assert sum(x["tokens"] == y["tokens"] for x, y in zip(burst, base)) >= 12
    assert connector_counts(record["a_log"])["hit_blocks"] == 12 * 10
    w = connector_counts(record["a_log"], "worker")
    assert loaded(w, "local") == 12 * 10, w


def test_preemption_under_the_connector_agrees_with_no_connector(record):
    ours, base = record["a_preempt"], record["base_preempt"]
    assert all(agree(x, y) for x, y in zip(ours, base))
    assert sum(x["tokens"] == y["tokens"] for x, y in zip(ours, base)) >= len(base) // 2
    c = connector_counts(record["a_small_log"])
    assert c["resumed_requests"] >= 1  # the cache was too small: vLLM preempted and resumed
    assert c["hit_blocks"] >= 12 * 3  # kvtier promised the prefixes,
    assert connector_counts(record["a_small_log"], "worker")["loaded_blocks"] >= 12 * 3  # and loaded them
