"""KvtierConnector under faults, on real vLLM engines: kvtier failing never fails a request and
never feeds vLLM wrong KV. Each output must equal the no-connector engine's (`baseline`)."""

from __future__ import annotations

import pytest

from kvtier.runtime import DESCRIPTOR, read_json
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable
from kvtier.tools.vllm_engine import EngineProcess
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS, connector_config, connector_counts, pool_toml

pytestmark = pytest.mark.timeout(900)

P1, P2, Q1, Q2 = PROMPTS["P1"], PROMPTS["P2"], PROMPTS["Q1"], PROMPTS["Q2"]


def corrupt_every_block(runtime_dir, pool: str) -> int:
    """Flip one payload byte of every slot in the node's gpu and cpu arenas, leaving headers and
    checksums as they were: a reader that verifies sees a bad block, one that does not reads garbage."""
    desc = read_json(runtime_dir / DESCRIPTOR)["pools"][pool]
    flipped = 0
    for seg_name in (desc["gpu"]["segment"], desc["cpu"]["segment"]):
        table = SlotTable.open(ShmSegment.attach(seg_name, writable=True), Kind.ARENA)
        for slot in range(table.n):
            table.payload(slot)[table.block_bytes // 2] ^= 0x5A
            flipped += 1
        table.seg.close()
    return flipped


@pytest.fixture(scope="module")
def faults(tiny_model, tmp_path_factory, node_factory, module_redis) -> dict:
    node = node_factory("vllm-f")
    logs = tmp_path_factory.mktemp("engines")
    rec: dict = {}
    with EngineProcess(tiny_model, logs / "f.log", connector_config(POOL, node.runtime_dir),
                       prefix_caching=False) as e:
        rec["first"] = e.generate(P1)
        wait_until(lambda: node.pool_stats(POOL).get("puts", 0) >= 11, timeout=30,
                   message="the node stored P1's blocks")
        # Redis down: the shared-memory tiers still serve what the node holds.
        module_redis.stop()
        rec["redis_down_repeat"] = e.generate(P1)
        rec["redis_down_log"] = e.log_text()  # a load that fell short has said so by now
        rec["redis_down_new"] = e.generate(Q1)
        module_redis.start()
        # Every stored byte corrupted under the daemon's feet: verification turns each into a miss.
        before = node.pool_stats(POOL).get("misses", 0)
        rec["flipped"] = corrupt_every_block(node.runtime_dir, POOL)
        rec["corrupt_repeat"] = e.generate(P1)
        wait_until(lambda: node.pool_stats(POOL).get("misses", 0) > before, timeout=10,
                   message="the client reported its verification misses to the daemon")
        # The daemon killed mid-run: the engine goes on serving.
        node.kill()
        rec["killed_p2"] = e.generate(P2)
        rec["killed_q2"] = e.generate(Q2)
        rec["alive"] = e.proc.poll() is None
        rec["log"] = e.log_text()
    rec["worker"] = connector_counts((logs / "f.log").read_text(errors="replace"), "worker")  # logged at its stop
    # An engine started while no daemon runs at its runtime directory.
    with EngineProcess(tiny_model, logs / "nodaemon.log",
                       connector_config(POOL, tmp_path_factory.mktemp("no-daemon-here"))) as e:
        rec["no_daemon"] = e.generate(P1)
        rec["no_daemon_log"] = e.log_text()
    # A pool whose blocks are not vLLM's: refused with a clear message, and the engine serves.
    wrong = node_factory("vllm-w", pools=pool_toml(block_tokens=16))
    with EngineProcess(tiny_model, logs / "wrong.log", connector_config(POOL, wrong.runtime_dir)) as e:
        rec["wrong_pool"] = e.generate(P1)
        rec["wrong_pool_log"] = e.log_text()
    rec["wrong_pool_puts"] = wrong.pool_stats(POOL).get("puts", 0)
    return rec


def test_redis_down_local_hits_still_work(faults, baseline):
    assert faults["first"]["tokens"] == baseline["P1"]
    assert faults["redis_down_repeat"]["cached"] == 11 * BS
    assert faults["redis_down_repeat"]["tokens"] == baseline["P1"]
    # ... and were loaded, not recomputed: vLLM's `cached` counts what was promised. (The
    # engine's later loads fail on purpose: its total counts the repeat's 11 and no more.)
    assert "planned blocks" not in faults["redis_down_log"]
    assert faults["worker"].get("load_local_blocks") == faults["worker"].get("loaded_blocks") == 11
    assert faults["redis_down_new"]["tokens"] == baseline["Q1"]


def test_blocks_that_fail_verification_are_recomputed_never_used(faults, baseline):
    assert faults["flipped"] > 0
    assert faults["corrupt_repeat"]["tokens"] == baseline["P1"]
    assert "loaded 0 of 11 planned blocks; vLLM recomputes the rest" in faults["log"]


def test_daemon_killed_mid_run_the_engine_keeps_serving(faults, baseline):
    assert faults["alive"]
    assert faults["killed_p2"]["tokens"] == baseline["P2"]
    assert faults["killed_q2"]["tokens"] == baseline["Q2"]


def test_no_daemon_at_start_is_all_misses(faults, baseline):
    assert faults["no_daemon"]["cached"] == 0
    assert faults["no_daemon"]["tokens"] == baseline["P1"]
    assert "kvtier: connect failed" in faults["no_daemon_log"]


def test_a_pool_that_does_not_fit_is_refused_with_the_fix(faults, baseline):
    assert faults["wrong_pool"]["tokens"] == baseline["P1"]
    assert "block_tokens 16 != vLLM block_size 32" in faults["wrong_pool_log"]
    assert "Configure it as layers = 2, kv_heads = 2, head_dim = 32, block_tokens = 32" in faults["wrong_pool_log"]
    assert faults["wrong_pool_puts"] == 0
