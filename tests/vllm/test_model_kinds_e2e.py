"""The models of 2026 on real vLLM engines (CPU build): a hybrid of sliding-window and
full-attention layers on two nodes, with kvtier hits counted and greedy output identical to what
the same engine computes without kvtier. (n-gram speculative decoding: test_connector_e2e.py.)

The hybrid: the tiny Llama with layer_types = [sliding, full] and a 64-token window (a 360-token
prompt reaches past it). vLLM turns its hybrid KV-cache manager off for a connector without
SupportsHMA, so the model has one group of full-attention pages (the sliding layer's pages are
kept whole and computed with the window): kvtier stores and loads them like a dense model's.
"""

from __future__ import annotations

import pytest

from kvtier.tools.vllm_engine import EngineProcess, connector_config, make_model
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS

pytestmark = pytest.mark.timeout(900)  # two engine starts

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
