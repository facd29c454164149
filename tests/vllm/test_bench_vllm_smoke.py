"""`kvtier bench --vllm --quick`: every measured path of the vLLM integrations moves the right bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_vllm_quick_checks_every_path(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--vllm", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["connector"]["correct"] and res["tier"]["correct"]
    assert {r["path"].split(":")[0] for r in res["rows"]} >= {"connector save", "connector load",
                                                              "secondary tier store", "secondary tier load"}
    assert all(r["ratio"] > 0 for r in res["rows"])
    assert "| connector save" in run.stdout
