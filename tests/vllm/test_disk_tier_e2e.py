"""KvtierConnector on real vLLM engines over a node with a disk tier (issue 30): a prompt's blocks
are shed from a small cpu arena into the disk tier, and a fresh engine loads the whole prefix,
its tail from there (the connector reads disk-resident blocks through the client, with no change of its
own). Outputs are compared with an engine without the connector, as in test_connector_e2e.py.
"""

from __future__ import annotations

import pytest

from kvtier.tools.vllm_engine import EngineProcess
from tests.support.waiting import wait_until
from tests.vllm.conftest import BS, POOL, PROMPTS, connector_config, connector_counts, loaded, pool_toml

pytestmark = pytest.mark.timeout(600)


def disk(node) -> dict:
    return node.pool_stats(POOL).get("tiers", {}).get("disk", {})


def tiers(node) -> dict:
    """Each tier's blocks, hits and stores, for a failure's message."""
    return {t: {k: v.get(k) for k in ("blocks", "hits", "stored", "demoted_in", "promoted_in", "evicted", "failed")}
            for t, v in node.pool_stats(POOL).get("tiers", {}).items()}


def kvtier_lines(log: str) -> str:
    return "\n".join(x for x in log.splitlines() if "kvtier" in x)[-4000:]


def test_a_fresh_engine_loads_a_prefix_the_cpu_tier_shed_to_disk(node_factory, tiny_model, baseline, tmp_path):
    # gpu 0 and 16 cpu blocks with low watermarks: P1's 11 blocks fit, and then cpu sheds them
    # (a chain's tail first, a block a round while above 4) into the disk tier (admission off);
    # nothing is written to Redis.
    node = node_factory("vllm-disk", pools=pool_toml(cpu_blocks=16, gpu_blocks=0) + 'disk_bytes = "64MiB"\n',
                        policy='redis_write = "write-back"\ndisk_admit_after = 0\nhigh_watermark = 0.25\n'
                               'low_watermark = 0.125',
                        extra=f'[disk]\ndir = "{tmp_path / "disk"}"\nreserve_bytes = 0\n')
    logs = tmp_path / "engines"
    logs.mkdir()
    with EngineProcess(tiny_model, logs / "save.log", connector_config(POOL, node.runtime_dir),
                       prefix_caching=False) as e:
        assert e.generate(PROMPTS["P1"])["cached"] == 0
        wait_until(lambda: disk(node).get("blocks", 0) >= 7, timeout=60, message="P1's tail shed to disk")
    assert node.pool_stats(POOL)["tiers"]["redis"]["blocks"] == 0, "Redis holds none of P1"
    before = disk(node)["hits"]
    with EngineProcess(tiny_model, logs / "load.log", connector_config(POOL, node.runtime_dir)) as e:
        out = e.generate(PROMPTS["P1"])
    # vLLM counts as cached what the connector promised, even when the load then fails and vLLM
    # recomputes: the worker's own counts say whether it loaded.
    log = (logs / "load.log").read_text(errors="replace")
    w = connector_counts(log, "worker")
    assert out["cached"] == 11 * BS, "the whole prefix promised"
    assert loaded(w, "local") == 11, \
        f"the whole prefix loaded from this node, not recomputed: {w}\n{kvtier_lines(log)}"
    assert out["tokens"] == baseline["P1"]
    # P1's tail was read from the block file (its head from the cpu arena).
    wait_until(lambda: disk(node)["hits"] - before >= 7, timeout=30,
               message=lambda: f"the loads counted as disk hits (from {before}): {tiers(node)}\n{node.log_tail()}")
    assert node.pool_stats(POOL)["disk"]["state"] == "on"
