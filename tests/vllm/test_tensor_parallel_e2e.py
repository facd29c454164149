"""Tensor parallel 2 on vLLM's CPU build with the connector: two worker processes, each keying
its own heads (a kvtier block holds one rank's pages), the scheduler counting a block as cached
only when both ranks hold it.

This machine has two cores and one NUMA node: vLLM's CPU workers bind one node each by default,
so each rank gets one core (VLLM_CPU_OMP_THREADS_BIND) and the KV cache an explicit size.
"""

from __future__ import annotations

import pytest

from kvtier.tools.engine_logs import connector_count_lines
from kvtier.tools.vllm_engine import EngineProcess
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, PROMPTS, connector_config, loaded, pool_toml

pytestmark = pytest.mark.timeout(900)

POOL_TP2 = "tiny-tp2"  # the tiny model's per-rank layout at TP 2: one of its two KV heads
P1 = PROMPTS["P1"]


@pytest.fixture(scope="module")
def record(tiny_model, tmp_path_factory, node_factory) -> dict:
    node = node_factory("vllm-tp2", pools=pool_toml(POOL_TP2, kv_heads=1))
    logs = tmp_path_factory.mktemp("engines")
    rec: dict = {}
    with EngineProcess(tiny_model, logs / "tp2.log", connector_config(POOL_TP2, node.runtime_dir),
                       prefix_caching=False, tensor_parallel_size=2,
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                            # vLLM kills a worker 5 s into its stop by default, before a busy
                            # host's has logged its counts (asserted below)
                            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}) as e:
        rec["first"] = e.generate(P1)
        wait_until(lambda: node.pool_stats(POOL_TP2).get("puts", 0) >= 22, timeout=30,
                   message="both ranks' 11 blocks stored")
        rec["repeat"] = e.generate(P1)
    rec["log"] = (logs / "tp2.log").read_text(errors="replace")  # with the counts the halves log at their stop
    # Each rank reports its reads to the daemon on its own, and the daemon writes its stats on an
    # interval: read once, a run saw one rank's 11 hits. Both ranks' within a deadline.
    rec["stats"] = wait_until(lambda: (st := node.pool_stats(POOL_TP2)).get("hits", 0) >= 22 and st, timeout=30,
                              message="the daemon counted both ranks' reads")
    return rec


def test_two_ranks_save_and_load_their_own_heads(record):
    assert record["first"]["cached"] == 0
    assert record["repeat"]["cached"] == 11 * BS
    assert record["repeat"]["tokens"] == record["first"]["tokens"]
    assert record["stats"]["hits"] >= 22  # each rank read its own 11 blocks
    ranks = connector_count_lines(record["log"], "worker")
    assert len(ranks) == 2 and all(loaded(w, "local") == 11 for w in ranks), ranks
    assert "tensor_parallel_size=2" in record["log"]
