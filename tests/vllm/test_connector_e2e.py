"""KvtierConnector on real vLLM engines (CPU build), two kvtier nodes sharing one Redis.

Every output is compared with a run of the same prompt on an engine without the connector:
greedy decoding on the same weights must give the same tokens whether the prefix's KV was
computed or loaded. `cached` is vLLM's own count of prompt tokens it did not compute.
"""

from __future__ import annotations

import pytest

from kvtier.tools.vllm_engine import EngineProcess, connector_config
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS

pytestmark = pytest.mark.timeout(900)  # the module's fixtures start four engines

P1, P2, P3 = PROMPTS["P1"], PROMPTS["P2"], PROMPTS["P3"]


@pytest.fixture(scope="module")
def nodes(node_factory):
    return node_factory("vllm-a"), node_factory("vllm-b")


@pytest.fixture(scope="module")
def scenario(tiny_model, tmp_path_factory, nodes) -> dict:
    """The whole story once (engine starts are the expensive part); tests assert on its record."""
    a, b = nodes
    logs = tmp_path_factory.mktemp("engines")
    rec: dict = {}
    # Node A, one engine with vLLM's own prefix cache off, so a repeat can only come from kvtier.
    with EngineProcess(tiny_model, logs / "a1.log", connector_config(POOL, a.runtime_dir),
                       prefix_caching=False) as e:
        rec["a1_first"] = e.generate(P1)
        # Write-through: the 11 blocks are in the cpu arena and in Redis once the daemon says so.
        wait_until(lambda: a.pool_stats(POOL).get("tiers", {}).get("redis", {}).get("copied_in", 0) >= 11,
                   timeout=30, message="node A stored P1's blocks and wrote them to Redis")
        rec["a_after_save"] = a.pool_stats(POOL)
        rec["a1_repeat"] = e.generate(P1)
        rec["a1_other_salt"] = e.generate(P1, cache_salt="tenant-b")
        rec["a1_log"] = e.log_text()
    # Node A, a second engine process: the shared prefix comes from the node's shared memory.
    with EngineProcess(tiny_model, logs / "a2.log", connector_config(POOL, a.runtime_dir)) as e:
        rec["a2_p2"] = e.generate(P2)
    rec["a_stats"] = a.pool_stats(POOL)
    # Node B, another daemon on the same Redis, a cold engine: the prefix comes through Redis.
    b_before = b.pool_stats(POOL)
    # Its Redis lookup and the prefetch may take as long as they need here: this test is about
    # where the blocks come from, not how fast (a slow CI machine must not make it a recompute).
    with EngineProcess(tiny_model, logs / "b.log", connector_config(POOL, b.runtime_dir, redis_wait_ms=30_000,
                                                                     lookup_timeout_ms=5_000)) as e:
        rec["b_p3"] = e.generate(P3)
    rec["b_before"], rec["b_stats"] = b_before, b.pool_stats(POOL)
    return rec


def test_first_run_computes_and_saves_every_full_prompt_block(scenario, baseline):
    assert scenario["a1_first"]["cached"] == 0
    assert scenario["a1_first"]["tokens"] == baseline["P1"]
    assert scenario["a_after_save"]["puts"] >= 11
    tiers = scenario["a_after_save"]["tiers"]
    assert tiers["gpu"]["blocks"] + tiers["cpu"]["blocks"] >= 11


def test_exact_prompt_is_reused_within_one_engine(scenario, baseline):
    # 359 tokens may come from cache (vLLM computes the last one): 11 whole blocks = 352.
    assert scenario["a1_repeat"]["cached"] == 11 * BS
    assert scenario["a1_repeat"]["tokens"] == baseline["P1"]


def test_a_different_cache_salt_hits_nothing(scenario, baseline):
    assert scenario["a1_other_salt"]["cached"] == 0
    assert scenario["a1_other_salt"]["tokens"] == baseline["P1"]


def test_prefix_is_reused_by_another_engine_process_on_the_node(scenario, baseline):
    assert scenario["a2_p2"]["cached"] == 10 * BS
    assert scenario["a2_p2"]["tokens"] == baseline["P2"]
    assert scenario["a_stats"]["hits"] >= 11 + 10  # the repeat's blocks and the prefix, read from shm


def test_node_b_loads_the_prefix_from_redis_instead_of_computing_it(scenario, baseline):
    assert scenario["b_p3"]["cached"] == 10 * BS
    assert scenario["b_p3"]["tokens"] == baseline["P3"]
    before, after = scenario["b_before"], scenario["b_stats"]
    # Node B had none of these blocks: it promoted the prefix from Redis, then the engine read it.
    assert after["tiers"]["cpu"]["promoted_in"] - before.get("tiers", {}).get("cpu", {}).get("promoted_in", 0) >= 10
    assert after["hits"] - before.get("hits", 0) >= 10
