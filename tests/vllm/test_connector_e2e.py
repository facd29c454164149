"""KvtierConnector on real vLLM engines (CPU build), two kvtier nodes sharing one Redis.

Every output is compared with a run of the same prompt on an engine without the connector:
greedy decoding on the same weights must give the same tokens whether the prefix's KV was
computed or loaded. `cached` is vLLM's own count of prompt tokens it did not compute, which
counts what the connector promised even when the load then fails and vLLM recomputes: the
connector worker's own counts (logged as it shuts down) say what was loaded, and from where.

The keys hold the weights' identity, not the served name (issue 27): the first engine serves the
tiny model as "m"; the second engine on the node serves a copy of the same weights from another
directory as "m-copy" (with n-gram speculative decoding) and reuses the prefix; a third serves
other random weights as "m" and shares no block. Before, keys followed the served name: the third
engine loaded the first model's KV (intact bytes, checksums pass, wrong answers).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from kvtier.tools.vllm_engine import EngineProcess, make_model
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS, SEPARATE_PROCESSES, connector_config, connector_counts, loaded

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # the module's fixtures start five engines

P1, P2, P3, Q1 = PROMPTS["P1"], PROMPTS["P2"], PROMPTS["P3"], PROMPTS["Q1"]
R = Q1[:10 * BS] + PROMPTS["Q2"][:40]  # Q1's first 10 blocks and another tail
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


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
    copy = tmp_path_factory.mktemp("copies") / "tiny-llama-copy"
    shutil.copytree(tiny_model, copy)
    other = make_model(tmp_path_factory.mktemp("other-weights"), seed=1)
    with EngineProcess(tiny_model, logs / "a1.log", connector_config(POOL, a.runtime_dir),
                       prefix_caching=False, served_model_name="m", env=SEPARATE_PROCESSES) as e:
        rec["a1_first"] = e.generate(P1)
        # Write-through: the 11 blocks are in the cpu arena and in Redis once the daemon says so.
        wait_until(lambda: a.pool_stats(POOL).get("tiers", {}).get("redis", {}).get("copied_in", 0) >= 11,
                   timeout=30, message="node A stored P1's blocks and wrote them to Redis")
        rec["a_after_save"] = a.pool_stats(POOL)
        rec["a1_repeat"] = e.generate(P1)
        rec["a1_other_salt"] = e.generate(P1, cache_salt="tenant-b")
        # Read your writes: R shares Q1's first 10 blocks and comes right after Q1, no wait.
        rec["a1_q1"] = e.generate(Q1)
        rec["a1_r_next"] = e.generate(R)
        rec["a1_r_computed"] = e.generate(R, cache_salt="tenant-c")  # what R is without kvtier's blocks
    # Read once the engine has stopped: the connector's halves log their counts as they shut down.
    rec["a1_log"] = (logs / "a1.log").read_text(errors="replace")
    # Node A, a second engine process: the shared prefix comes from the node's shared memory,
    # though this engine loads the weights from another directory, serves them under another
    # name, and drafts tokens by n-gram speculation.
    with EngineProcess(copy, logs / "a2.log", connector_config(POOL, a.runtime_dir), served_model_name="m-copy",
                       speculative_config=NGRAM, env=SEPARATE_PROCESSES) as e:
        rec["a2_p2"] = e.generate(P2)
    rec["a2_log"] = (logs / "a2.log").read_text(errors="replace")
    # Hits reach the daemon as access reports on the bus, which may land after the engine has gone.
    rec["a_stats"] = wait_until(lambda: (st := a.pool_stats(POOL)).get("hits", 0) >= 11 + 10 and st, timeout=30,
                                message="node A's hits from both engines counted")
    # Node A, other weights served under the first engine's name: nothing of its KV is loaded.
    with EngineProcess(other, logs / "other.log", connector_config(POOL, a.runtime_dir), prefix_caching=False,
                       served_model_name="m", env=SEPARATE_PROCESSES) as e:
        rec["other_p1"] = e.generate(P1)
        rec["other_log"] = e.log_text()
    # The pool's manifest, as `kvtier status` shows it: two namespaces (the copy shares the first's).
    rec["models"] = wait_until(lambda: (m := a.pool_stats(POOL).get("models")) and m["namespaces"] == 2
                               and all(x["stored_blocks"] >= 11 for x in m["models"]) and m,
                               timeout=30, message="both models in the manifest with what they stored")
    # Node B, another daemon on the same Redis, a cold engine: the prefix comes through Redis.
    b_before = b.pool_stats(POOL)
    # The connector's defaults (a 20 ms Redis lookup, asked again on the next step if it ran out):
    # the first request on a fresh engine on a fresh node loads the whole prefix from Redis.
    with EngineProcess(tiny_model, logs / "b.log", connector_config(POOL, b.runtime_dir),
                       env=SEPARATE_PROCESSES) as e:
        rec["b_p3"] = e.generate(P3)
    rec["b_log"] = (logs / "b.log").read_text(errors="replace")
    rec["b_before"] = b_before
    rec["b_stats"] = wait_until(lambda: (st := b.pool_stats(POOL))["remote_reads"] >= 10 and st, timeout=30,
                                message="node B's daemon heard of the blocks read through from Redis")
    return rec


def test_first_run_computes_and_saves_every_full_prompt_block(scenario, baseline):
    assert scenario["a1_first"]["cached"] == 0
    assert scenario["a1_first"]["tokens"] == baseline["P1"]
    assert scenario["a_after_save"]["puts"] >= 11
    tiers = scenario["a_after_save"]["tiers"]
    assert tiers["gpu"]["blocks"] + tiers["cpu"]["blocks"] >= 11


def test_these_engines_run_as_vllm_serve_does_the_connectors_halves_in_two_processes(scenario):
    """The rest of tests/vllm runs engines in one process (conftest.py); these keep vLLM's
    default, so the scheduler's metadata crosses to the worker as it does in a deployment."""
    for log in ("a1_log", "a2_log", "other_log", "b_log"):
        assert "(EngineCore pid=" in scenario[log] and "(Worker pid=" in scenario[log], log


def test_exact_prompt_is_reused_within_one_engine(scenario, baseline):
    # 359 tokens may come from cache (vLLM computes the last one): 11 whole blocks = 352.
    assert scenario["a1_repeat"]["cached"] == 11 * BS
    assert scenario["a1_repeat"]["tokens"] == baseline["P1"]
    # What this engine loaded in all: the repeat's 11 blocks and R's 10 (below), none recomputed.
    w = connector_counts(scenario["a1_log"], "worker")
    assert loaded(w, "local") == 11 + 10, w


def test_the_next_request_finds_what_the_engine_just_saved(scenario):
    """The engine's own saves are found by its next request, without a wait for the daemon (on this
    small model the daemon has usually placed them by then; tests/integration/
    test_connector_groups.py stops the daemon to show the worker then loads them from its own
    staging slots)."""
    assert scenario["a1_q1"]["cached"] == 0
    assert scenario["a1_r_next"]["cached"] == 10 * BS
    assert scenario["a1_r_computed"]["cached"] == 0
    assert scenario["a1_r_next"]["tokens"] == scenario["a1_r_computed"]["tokens"]


def test_a_different_cache_salt_hits_nothing(scenario, baseline):
    assert scenario["a1_other_salt"]["cached"] == 0
    assert scenario["a1_other_salt"]["tokens"] == baseline["P1"]


def test_prefix_is_reused_by_another_engine_process_on_the_node(scenario, baseline):
    assert scenario["a2_p2"]["cached"] == 10 * BS
    assert scenario["a2_p2"]["tokens"] == baseline["P2"]
    w = connector_counts(scenario["a2_log"], "worker")
    assert loaded(w, "local") == 10, w
    assert scenario["a_stats"]["hits"] >= 11 + 10  # the repeat's blocks and the prefix, read from shm


def test_node_b_loads_the_prefix_from_redis_instead_of_computing_it(scenario, baseline):
    """The first cross-node reuse: the first request of a fresh engine on a fresh node, with the
    default settings, loads the whole prefix, read straight from Redis (no prefetch round trip)."""
    assert scenario["b_p3"]["cached"] == 10 * BS
    assert scenario["b_p3"]["tokens"] == baseline["P3"]
    before, after = scenario["b_before"], scenario["b_stats"]
    assert after["remote_reads"] - before.get("remote_reads", 0) >= 10
    assert after["hits"] - before.get("hits", 0) >= 10
    assert "planned blocks" not in scenario["b_log"]  # no load fell short
    w = connector_counts(scenario["b_log"], "worker")
    assert loaded(w, "remote") == 10, w


def identity(log: str) -> str:
    line = next(x for x in log.splitlines() if "kvtier: weights identity content:" in x)
    return line.split("weights identity ")[1].split()[0]


def test_the_same_weights_elsewhere_with_speculative_decoding_share_the_prefix(scenario, baseline):
    """a2_p2 above loaded the prefix (10 blocks) although its weights' directory and served name
    differ; its greedy output, with n-gram drafts, is the baseline engine's."""
    assert scenario["a2_p2"]["cached"] == 10 * BS and scenario["a2_p2"]["tokens"] == baseline["P2"]
    assert "'speculative_config': {'method': 'ngram'" in scenario["a2_log"]
    assert identity(scenario["a2_log"]) == identity(scenario["a1_log"])


def test_other_weights_under_the_same_served_name_share_no_block(scenario, baseline):
    assert scenario["other_p1"]["cached"] == 0  # nothing of the first model's KV was loaded
    assert identity(scenario["other_log"]) != identity(scenario["a1_log"])


def test_status_lists_which_models_the_pool_holds(scenario):
    models = scenario["models"]["models"]
    assert sorted(m["model"] for m in models) == ["m", "m"]  # one served name, two sets of weights
    assert len({m["weights"]["weights"] for m in models}) == 2
    assert all(m["engine"] == "vllm-connector" and m["page"]["block_tokens"] == BS for m in models)


def test_a_salted_requests_blocks_count_for_its_salts_tenant(scenario):
    """Fair share (docs/operations.md, "Tenants and fair share"): the connector names a request's
    tenant by what separates its keys, here its cache salt, never the salt itself."""
    tenants = scenario["a_stats"]["tenants"]
    for salt in ("tenant-b", "tenant-c"):
        mine = tenants.get("salt:" + hashlib.sha256(salt.encode()).hexdigest()[:8], {})
        assert sum(v for k, v in mine.items() if k.endswith("_bytes")) + mine.get("evicted", 0) > 0, tenants
    assert not any(salt in name for name in tenants for salt in ("tenant-b", "tenant-c"))
    assert sum(v for k, v in tenants[""].items() if k.endswith("_bytes")) > 0  # the unsalted requests'
