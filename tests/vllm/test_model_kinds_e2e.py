"""The models of 2026 on real vLLM engines (CPU build): a hybrid of sliding-window and
full-attention layers on two nodes, and an MLA model (DeepSeek-V2 style), with kvtier hits
counted and greedy output identical to what the same engine computes without kvtier. (n-gram
speculative decoding: test_connector_e2e.py.)

The hybrid: the tiny Llama with layer_types = [sliding, full] and a 64-token window (a 360-token
prompt reaches past it). vLLM turns its hybrid KV-cache manager off for a connector without
SupportsHMA, so the model has one group of full-attention pages (the sliding layer's pages are
kept whole and computed with the window): kvtier stores and loads them like a dense model's.
"""

from __future__ import annotations

import pytest

from kvtier.tools.vllm_engine import EngineProcess, connector_config, make_mla_model, make_model
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS, pool_toml

POOL_MLA = "tiny-mla"  # 2 layers of one 576-float latent per token, 16-token blocks: head_dim 288 gives the bytes
MLA_BS = 16

pytestmark = pytest.mark.timeout(900)  # three engine starts

P1 = PROMPTS["P1"]


def stored_in_redis(node, n: int) -> bool:
    return node.pool_stats(POOL).get("tiers", {}).get("redis", {}).get("copied_in", 0) >= n


@pytest.fixture(scope="module")
def record(tmp_path_factory, node_factory) -> dict:
    a, b = node_factory("vllm-kinds-a"), node_factory("vllm-kinds-b")
    logs = tmp_path_factory.mktemp("engines")
    hybrid = make_model(tmp_path_factory.mktemp("hybrid"), seed=3,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    rec: dict = {}
    # vLLM's own prefix cache off: a repeat can only come from kvtier.
    with EngineProcess(hybrid, logs / "hybrid-a.log", connector_config(POOL, a.runtime_dir),
                       prefix_caching=False) as e:
        rec["hybrid_first"] = e.generate(P1)  # computed: what this engine answers without kvtier
        wait_until(lambda: stored_in_redis(a, 11), timeout=30, message="the hybrid's blocks in Redis")
        rec["hybrid_repeat"] = e.generate(P1)
        rec["hybrid_log"] = e.log_text()
    b_before = b.pool_stats(POOL)
    with EngineProcess(hybrid, logs / "hybrid-b.log", connector_config(POOL, b.runtime_dir, redis_wait_ms=30_000,
                                                                        lookup_timeout_ms=5_000),
                       prefix_caching=False) as e:
        rec["hybrid_b"] = e.generate(P1)
    rec["b_before"], rec["b_after"] = b_before, b.pool_stats(POOL)
    mla_node = node_factory("vllm-mla", pools=pool_toml(POOL_MLA, kv_heads=1, head_dim=288, block_tokens=MLA_BS))
    mla = make_mla_model(tmp_path_factory.mktemp("mla"))
    with EngineProcess(mla, logs / "mla.log", connector_config(POOL_MLA, mla_node.runtime_dir)) as e:
        rec["mla_first"] = e.generate(P1)
        wait_until(lambda: mla_node.pool_stats(POOL_MLA).get("puts", 0) >= 22, timeout=30,
                   message="the MLA model's 22 blocks stored")
        rec["mla_repeat"] = e.generate(P1)
        rec["mla_log"] = e.log_text()
    rec["mla_stats"] = mla_node.pool_stats(POOL_MLA)
    return rec


def test_a_hybrid_sliding_and_full_model_reuses_its_prefix_on_the_node(record):
    assert record["hybrid_first"]["cached"] == 0
    assert record["hybrid_repeat"]["cached"] == 11 * BS
    assert record["hybrid_repeat"]["tokens"] == record["hybrid_first"]["tokens"]
    assert "kvtier: connector disabled" not in record["hybrid_log"]
    # vLLM saw a hybrid (so this is not a dense model by accident) and kept every block for it.
    assert "Hybrid KV cache manager is disabled for this hybrid model" in record["hybrid_log"]


def test_a_hybrid_model_loads_its_prefix_on_another_node_through_redis(record):
    assert record["hybrid_b"]["cached"] == 11 * BS
    assert record["hybrid_b"]["tokens"] == record["hybrid_first"]["tokens"]
    assert record["b_after"]["hits"] - record["b_before"].get("hits", 0) >= 11


def test_an_mla_model_saves_and_loads_its_latent_pages(record):
    """vLLM's CPU build turns its own prefix cache off for MLA, so the repeat's prefix can only
    come from kvtier: 22 blocks of 16 tokens."""
    assert "MLA is enabled on a non-GPU platform" in record["mla_log"]
    assert "kvtier: connector disabled" not in record["mla_log"]
    assert record["mla_first"]["cached"] == 0
    assert record["mla_repeat"]["cached"] == 22 * MLA_BS
    assert record["mla_repeat"]["tokens"] == record["mla_first"]["tokens"]
    assert record["mla_stats"]["hits"] >= 22
