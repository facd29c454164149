"""`kvtier bench --vllm --quick`: every measured path of the vLLM integrations moves the right bytes,
and every TTFT cell runs on real engines with the prefix coming from where the cell says (no
figure is judged: speed lives in the full run, docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def test_bench_vllm_quick_checks_every_path(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--vllm", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=880)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["connector"]["correct"] and res["tier"]["correct"]
    assert {r["path"].split(":")[0] for r in res["rows"]} >= {"connector save", "connector load",
                                                              "secondary tier store", "secondary tier load"}
    assert all(r["ratio"] > 0 for r in res["rows"])
    assert "| connector save" in run.stdout
    # TTFT cells: a 256-token prefix and a 32-token tail, two samples each; what vLLM reports as
    # cached is what kvtier (or, for the floor, vLLM's own cache) supplied.
    cells = res["ttft_cells"]["cells"]
    loaded = {c: cells[c]["256"]["loaded_tokens"] for c in cells}
    assert loaded == {"cold": [0, 0], "floor": [256, 256], "kvtier_local": [256, 256], "kvtier_next": [256, 256],
                      "kvtier_redis": [256, 256], "kvtier_miss": [0, 0]}
    # vLLM's `cached` counts what the connector promised: each engine's worker loaded it all (two
    # 8-block prefixes each: the next request's own saves, the node's, Redis's) and none failed.
    assert res["ttft_cells"]["worker_loads"] == {name: {"loaded_blocks": 16, "load_failed_blocks": 0}
                                                 for name in ("kvtier-a-save", "kvtier-a-fresh", "kvtier-b-fresh")}
    assert "| TTFT kvtier_redis, 256-token prefix" in run.stdout
    # The burst beside decoders: every placement ran, every prefix loaded whole, the decoders'
    # gaps while the burst was served were seen.
    burst = res["burst"]["cells"]
    assert set(burst) == {"floor", "kvtier_local", "kvtier_half_redis"}
    assert all(c["runs"] == 1 and c["not_fully_loaded"] == 0 and c["itl_samples"] > 0 for c in burst.values())
    # Node A's engine loaded its burst's four 8-block prefixes, node B's its half-Redis burst's.
    assert res["burst"]["worker_loads"] == {name: {"loaded_blocks": 32, "load_failed_blocks": 0} for name in "ab"}
