"""Faults during an asynchronous load, on real vLLM engines (CPU build): a load that misses its
deadline is given up, counted and recomputed; the daemon killed while a load is in flight
changes no output. The slow tier is the worker's test stall (KVTIER_TEST_LOAD_STALL_S: every
load waits that long before it reads); outputs must equal the no-connector engine's."""

from __future__ import annotations

import threading

import pytest

from kvtier.integrations.vllm.connector_worker import LOAD_STALL_ENV
from kvtier.tools.vllm_engine import EngineProcess
from tests.support.waiting import wait_until
from tests.vllm.conftest import POOL, PROMPTS, connector_config, connector_counts

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def record(tiny_model, tmp_path_factory, node_factory) -> dict:
    node = node_factory("vllm-lf")
    logs = tmp_path_factory.mktemp("engines")
    rec: dict = {}
    # The kill scenario's engine first saves P1 (on a fresh node its request loads nothing, and only
    # a load stalls), so no engine is started just to save it.
    with EngineProcess(tiny_model, logs / "kill.log", connector_config(POOL, node.runtime_dir),
                       prefix_caching=False, env={LOAD_STALL_ENV: "1.5"}) as k:
        k.generate(PROMPTS["P1"])
        wait_until(lambda: node.pool_stats(POOL).get("puts", 0) >= 11, timeout=30, message="P1's blocks stored")
        assert "stalled for" not in k.log_text(), "P1's request loaded nothing"
        # A load's deadline is call_timeout_ms until the cost model has figures: 1 s, and the load
        # stalls 2 s before it reads.
        with EngineProcess(tiny_model, logs / "deadline.log", connector_config(POOL, node.runtime_dir,
                                                                              call_timeout_ms=1000),
                           prefix_caching=False, env={LOAD_STALL_ENV: "2"}) as e:
            rec["deadline_p1"] = e.generate(PROMPTS["P1"])
        rec["deadline_log"] = (logs / "deadline.log").read_text(errors="replace")
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(k.generate(PROMPTS["P2"])))
        t.start()
        wait_until(lambda: "stalled for" in k.log_text(), timeout=60, message="the load is in flight")
        node.kill()
        t.join(120)
        rec["killed_p2"] = out
        rec["alive"] = k.proc.poll() is None
    rec["kill_log"] = (logs / "kill.log").read_text(errors="replace")
    return rec


def test_a_load_that_misses_its_deadline_is_recomputed_and_counted(record, baseline):
    assert record["deadline_p1"]["tokens"] == baseline["P1"]
    assert "(its deadline passed)" in record["deadline_log"]
    w = connector_counts(record["deadline_log"], "worker")
    assert w["load_deadline_missed"] == 1 and w["load_failed_blocks"] == 11 and "loaded_blocks" not in w


def test_the_daemon_killed_while_a_load_is_in_flight_changes_no_output(record, baseline):
    assert record["killed_p2"]["tokens"] == baseline["P2"]
    assert record["alive"]
    assert "stalled for" in record["kill_log"]
