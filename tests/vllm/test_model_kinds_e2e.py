"""The models of 2026 on real vLLM engines (CPU build): a hybrid of sliding-window and
full-attention layers on two nodes, an MLA model (DeepSeek-V2 style) and EAGLE speculative
decoding, with kvtier hits counted and greedy output identical to what the same engine computes
without kvtier. (n-gram speculative decoding: test_connector_e2e.py.)

The hybrid: the tiny Llama with layer_types = [sliding, full] and a 64-token window (a 360-token
prompt reaches past it). The connector supports vLLM's hybrid KV-cache manager (SupportsHMA), so
vLLM keeps it on: two KV-cache groups of one layer each, the sliding group's blocks behind the
window null. Each group's part of a block has its own key (kv_groups.py). To show that a prefix
counts only where every group's part is stored, the test stops the first node and deletes one
group's parts from Redis (their keys rebuilt from the namespace the connector published in the
pool's manifest) before a second node asks for them.
"""

from __future__ import annotations

import re

import pytest
import redis

from kvtier.client import SyncClient
from kvtier.core.manifest import ManifestEntry, manifest_key
from kvtier.integrations.namespaced_keys import namespace_bytes
from kvtier.integrations.vllm.connector_config import KeyNamespace, namespace_id, rank_salt
from kvtier.store.redis_blocks import redis_block_key
from kvtier.tools.vllm_engine import (
    TINY,
    EngineProcess,
    make_eagle_draft,
    make_mla_model,
    make_model,
)
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, PROMPTS, connector_config, connector_counts, loaded, pool_toml

POOL_HYBRID = "tiny-hybrid"  # one layer per KV-cache group: a block is one group's page
POOL_EAGLE = "tiny-eagle"  # the target's 2 layers and the EAGLE drafter's 1, in one KV-cache group
POOL_MLA = "tiny-mla"  # 2 layers of one 576-float latent per token, 16-token blocks: head_dim 288 gives the bytes
MLA_BS = 16

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # four engine starts

P1, Q1, Q2 = PROMPTS["P1"], PROMPTS["Q1"], PROMPTS["Q2"]


def resident(node, pool: str, n: int) -> bool:
    """n blocks placed in the node's tiers (handed over, `puts`, is not yet findable)."""
    tiers = node.pool_stats(pool).get("tiers", {})
    return sum(tiers.get(t, {}).get("blocks", 0) for t in ("gpu", "cpu")) >= n


def namespaces(log: str) -> set[str]:
    """The namespaces the connector's halves logged: one, or every lookup would miss."""
    return set(re.findall(r"kvtier: (?:scheduler|worker) keys in namespace (\w+)", log))


def stored_in_redis(node, pool: str, n: int) -> bool:
    return node.pool_stats(pool).get("tiers", {}).get("redis", {}).get("copied_in", 0) >= n


def hybrid_namespace(r: redis.Redis) -> KeyNamespace:
    """The namespace the connector keyed the hybrid with, rebuilt from its manifest entry (and
    checked against the entry's id, so a wrong rebuild fails here, not as a silent no-op)."""
    entries = [ManifestEntry.from_json(v) for v in r.hgetall(manifest_key(POOL_HYBRID)).values()]
    [e] = [e for e in entries if e.engine == "vllm-connector"]
    weights = {k: v for k, v in e.weights.items() if k != "revision"}
    ns = KeyNamespace(model=e.model, weights=namespace_bytes(weights).decode(), engine_version=e.engine_version,
                      block_size=BS, layers=1, kv_heads=TINY["num_key_value_heads"],
                      head_size=TINY["hidden_size"] // TINY["num_attention_heads"], dtype=e.page["dtype"],
                      kv_layout=e.page["kv_layout"], device="cpu", groups=",".join(e.page["groups"]))
    assert namespace_id(ns) == e.namespace, (ns, e)
    return ns


def group_keys(client: SyncClient, ns: KeyNamespace, prompt: list[int], group: int) -> list[bytes]:
    blocks = (len(prompt) - 1) // BS
    return client.block_keys(POOL_HYBRID, prompt[:blocks * BS], salt=rank_salt(ns, (0, 1), (0, 1), None, group))


@pytest.fixture(scope="module")
def record(tmp_path_factory, node_factory, module_redis, tiny_model) -> dict:
    pools = pool_toml(POOL_HYBRID, layers=1) + pool_toml(POOL_EAGLE, layers=3)
    a, b = node_factory("vllm-kinds-a", pools=pools), node_factory("vllm-kinds-b", pools=pools)
    logs = tmp_path_factory.mktemp("engines")
    hybrid = make_model(tmp_path_factory.mktemp("hybrid"), seed=3,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    rec: dict = {}
    # vLLM's own prefix cache off: a repeat can only come from kvtier.
    with EngineProcess(hybrid, logs / "hybrid-a.log", connector_config(POOL_HYBRID, a.runtime_dir),
                       prefix_caching=False) as e:
        for name, prompt in (("p1", P1), ("q1", Q1), ("q2", Q2)):
            rec[f"hybrid_{name}"] = e.generate(prompt)  # computed: what this engine answers without kvtier
        wait_until(lambda: stored_in_redis(a, POOL_HYBRID, 3 * 2 * 11), timeout=30,
                   message="both groups' parts of the hybrid's 3 x 11 blocks in Redis")
        rec["hybrid_repeat"] = e.generate(P1)
    # Each log is read once its engine has stopped: the connector's halves log their counts then.
    rec["hybrid_log"] = (logs / "hybrid-a.log").read_text(errors="replace")
    r = redis.Redis.from_url(module_redis.url)
    ns = hybrid_namespace(r)
    with SyncClient(a.runtime_dir) as client:
        keys = {(name, g): group_keys(client, ns, prompt, g) for name, prompt in (("p1", P1), ("q1", Q1), ("q2", Q2))
                for g in (0, 1)}
    rec["groups"] = ns.groups
    rec["all_in_redis"] = all(r.exists(redis_block_key(POOL_HYBRID, k)) for ks in keys.values() for k in ks)
    a.stop()  # a running node puts back what Redis lost (its resync): this one is done
    # Q1: every part of group 0 gone; Q2: group 0's part of its last block gone.
    rec["deleted"] = r.delete(*(redis_block_key(POOL_HYBRID, k) for k in [*keys["q1", 0], keys["q2", 0][-1]]))
    b_before = b.pool_stats(POOL_HYBRID)
    with EngineProcess(hybrid, logs / "hybrid-b.log", connector_config(POOL_HYBRID, b.runtime_dir),
                       prefix_caching=False) as e:
        for name, prompt in (("p1", P1), ("q1", Q1), ("q2", Q2)):
            rec[f"hybrid_b_{name}"] = e.generate(prompt)
    rec["hybrid_b_log"] = (logs / "hybrid-b.log").read_text(errors="replace")
    # Hits reach the daemon as access reports on the bus, which may land after the engine has gone.
    rec["b_before"] = b_before
    rec["b_after"] = wait_until(lambda: (st := b.pool_stats(POOL_HYBRID)).get("hits", 0) - b_before.get("hits", 0)
                                >= 11 + 2 and st, timeout=30, message="node b's hits on the hybrid's blocks counted")
    eagle = {"method": "eagle", "model": str(make_eagle_draft(tmp_path_factory.mktemp("eagle"))),
             "num_speculative_tokens": 2}
    with EngineProcess(tiny_model, logs / "eagle.log", connector_config(POOL_EAGLE, b.runtime_dir),
                       prefix_caching=False, speculative_config=eagle) as e:
        rec["eagle_first"] = e.generate(P1)
        wait_until(lambda: resident(b, POOL_EAGLE, 11), timeout=30, message="the EAGLE engine's 11 blocks stored")
        rec["eagle_repeat"] = e.generate(P1)
    rec["eagle_log"] = (logs / "eagle.log").read_text(errors="replace")
    rec["eagle_stats"] = wait_until(lambda: (st := b.pool_stats(POOL_EAGLE)).get("hits", 0) >= 11 and st,
                                    timeout=30, message="the EAGLE engine's 11 hits counted")
    rec["eagle_manifest"] = [ManifestEntry.from_json(v) for v in r.hgetall(manifest_key(POOL_EAGLE)).values()]
    mla_node = node_factory("vllm-mla", pools=pool_toml(POOL_MLA, kv_heads=1, head_dim=288, block_tokens=MLA_BS))
    mla = make_mla_model(tmp_path_factory.mktemp("mla"))
    # vLLM's reference CPU MLA backend: where the CPU has AMX tiles vLLM picks its AMX backend,
    # which packs bf16 weights only, and this tiny model runs in float32.
    with EngineProcess(mla, logs / "mla.log", connector_config(POOL_MLA, mla_node.runtime_dir),
                       attention_backend="CPU_MLA") as e:
        rec["mla_first"] = e.generate(P1)
        wait_until(lambda: resident(mla_node, POOL_MLA, 22), timeout=30, message="the MLA model's 22 blocks stored")
        rec["mla_repeat"] = e.generate(P1)
    rec["mla_log"] = (logs / "mla.log").read_text(errors="replace")
    rec["mla_stats"] = wait_until(lambda: (st := mla_node.pool_stats(POOL_MLA)).get("hits", 0) >= 22 and st,
                                  timeout=30, message="the MLA model's 22 hits counted")
    return rec


def test_a_hybrid_runs_with_vllms_hybrid_manager_on_and_reuses_its_prefix_on_the_node(record):
    assert record["groups"] == "sliding:64:0,full"  # two groups: the hybrid manager is on
    assert "Hybrid KV cache manager is disabled" not in record["hybrid_log"]
    assert "kvtier: connector disabled" not in record["hybrid_log"]
    assert len(namespaces(record["hybrid_log"])) == 1
    assert record["hybrid_p1"]["cached"] == 0
    assert record["hybrid_repeat"]["cached"] == 11 * BS
    assert record["hybrid_repeat"]["tokens"] == record["hybrid_p1"]["tokens"]
    # The full group's 11 parts and the window's 2, loaded (vLLM's `cached` counts promises).
    assert loaded(connector_counts(record["hybrid_log"], "worker"), "local") == 11 + 2


def test_a_hybrid_model_loads_its_prefix_on_another_node_through_redis(record):
    assert record["hybrid_b_p1"]["cached"] == 11 * BS
    assert record["hybrid_b_p1"]["tokens"] == record["hybrid_p1"]["tokens"]
    # Both groups' parts were read (a sliding group only its window: 2 of 11 blocks).
    assert record["b_after"]["hits"] - record["b_before"].get("hits", 0) >= 11 + 2
    # P1's parts, then Q2's (below), all read through from Redis.
    assert loaded(connector_counts(record["hybrid_b_log"], "worker"), "remote") == (11 + 2) + (10 + 2)


def test_a_prefix_counts_only_where_every_groups_part_is_stored(record):
    """Group 0 (sliding) lost every part of Q1 and the last part of Q2 from Redis; group 1 (full)
    kept all of both. Q1 is a miss and Q2 a hit of 10 blocks (whose window, blocks 8 and 9, is
    whole), with the output of an engine that computed them."""
    assert record["all_in_redis"] and record["deleted"] == 12
    assert record["hybrid_b_q1"]["cached"] == 0
    assert record["hybrid_b_q1"]["tokens"] == record["hybrid_q1"]["tokens"]
    assert record["hybrid_b_q2"]["cached"] == 10 * BS
    assert record["hybrid_b_q2"]["tokens"] == record["hybrid_q2"]["tokens"]
    assert "loaded 0 of" not in record["hybrid_b_log"]  # planned loads were whole: nothing fell back


def test_eagle_speculation_reloads_the_prefix_with_the_output_of_no_speculation(record, baseline):
    """The drafter's layer is in the target's KV-cache group (3 layers a block) and its weights in
    the key; speculation is lossless, so every answer is the plain engine's (no kvtier, no
    speculation)."""
    assert "kvtier: 3 layers in 1 KV-cache group(s)" in record["eagle_log"]
    assert len(namespaces(record["eagle_log"])) == 1
    assert "kvtier: connector disabled" not in record["eagle_log"]
    assert record["eagle_first"]["cached"] == 0
    assert record["eagle_repeat"]["cached"] == 11 * BS
    assert record["eagle_first"]["tokens"] == record["eagle_repeat"]["tokens"] == baseline["P1"]
    assert record["eagle_stats"]["hits"] >= 11
    assert loaded(connector_counts(record["eagle_log"], "worker"), "local") == 11
    [entry] = record["eagle_manifest"]
    assert entry.weights["draft"]["weights"].startswith("content:")


def test_an_mla_model_saves_and_loads_its_latent_pages(record):
    """vLLM's CPU build turns its own prefix cache off for MLA, so the repeat's prefix can only
    come from kvtier: 22 blocks of 16 tokens."""
    assert "MLA is enabled on a non-GPU platform" in record["mla_log"]
    assert "kvtier: connector disabled" not in record["mla_log"]
    assert len(namespaces(record["mla_log"])) == 1
    assert record["mla_first"]["cached"] == 0
    assert record["mla_repeat"]["cached"] == 22 * MLA_BS
    assert record["mla_repeat"]["tokens"] == record["mla_first"]["tokens"]
    assert record["mla_stats"]["hits"] >= 22
    assert loaded(connector_counts(record["mla_log"], "worker"), "local") == 22
