"""The weights' identity in every key, on real vLLM engines (CPU build) and one kvtier node.

Before it, the connector keyed blocks by the served name: an engine serving other weights as the
same name loaded the first model's KV (checksums pass: the bytes are intact) and answered wrong.
Here two engines serve different random weights as "m" and share no block, and the first model's
weights copied to another directory and served under another name share every block.
"""

from __future__ import annotations

import shutil

import pytest

from kvtier.tools.vllm_engine import EngineProcess, connector_config, make_model
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS

pytestmark = pytest.mark.timeout(900)  # three engine starts

P1 = PROMPTS["P1"]


@pytest.fixture(scope="module")
def record(tiny_model, tmp_path_factory, node_factory) -> dict:
    node = node_factory("vllm-weights")
    logs = tmp_path_factory.mktemp("engines")
    other = make_model(tmp_path_factory.mktemp("other-weights"), seed=1)
    copy = tmp_path_factory.mktemp("copies") / "tiny-llama-copy"
    shutil.copytree(tiny_model, copy)
    rec: dict = {}
    with EngineProcess(tiny_model, logs / "first.log", connector_config(POOL, node.runtime_dir),
                       served_model_name="m") as e:
        rec["first"] = e.generate(P1)
        wait_until(lambda: node.pool_stats(POOL).get("puts", 0) >= 11, timeout=30, message="P1's blocks stored")
        rec["first_log"] = e.log_text()
    rec["after_first"] = node.pool_stats(POOL)
    with EngineProcess(other, logs / "other.log", connector_config(POOL, node.runtime_dir),
                       served_model_name="m") as e:
        rec["other"] = e.generate(P1)
        rec["other_log"] = e.log_text()
    rec["after_other"] = node.pool_stats(POOL)
    with EngineProcess(copy, logs / "copy.log", connector_config(POOL, node.runtime_dir),
                       served_model_name="m-copy") as e:
        rec["copy"] = e.generate(P1)
    rec["after_copy"] = node.pool_stats(POOL)
    # The pool's manifest, as `kvtier status` shows it: two namespaces (the copy shares the first's).
    rec["models"] = wait_until(lambda: (m := node.pool_stats(POOL).get("models")) and m["namespaces"] == 2
                               and all(x["stored_blocks"] >= 11 for x in m["models"]) and m,
                               timeout=30, message="both models in the manifest with what they stored")
    return rec


def identity(log: str) -> str:
    line = next(x for x in log.splitlines() if "kvtier: weights identity content:" in x)
    return line.split("weights identity ")[1].split()[0]


def test_other_weights_under_the_same_served_name_share_no_block(record, baseline):
    assert record["first"]["cached"] == 0 and record["first"]["tokens"] == baseline["P1"]
    assert record["other"]["cached"] == 0  # nothing of the first model's KV was loaded
    assert record["after_other"].get("hits", 0) == record["after_first"].get("hits", 0)
    assert identity(record["first_log"]) != identity(record["other_log"])


def test_the_same_weights_from_another_directory_share_every_block(record, baseline):
    assert record["copy"]["cached"] == 11 * BS
    assert record["copy"]["tokens"] == baseline["P1"]  # loaded, and the same greedy output
    assert record["after_copy"]["hits"] - record["after_other"].get("hits", 0) >= 11


def test_status_lists_which_models_the_pool_holds(record):
    models = record["models"]["models"]
    assert sorted(m["model"] for m in models) == ["m", "m"]  # one served name, two sets of weights
    assert len({m["weights"]["weights"] for m in models}) == 2
    assert all(m["engine"] == "vllm-connector" and m["page"]["block_tokens"] == BS for m in models)
