"""CI runs a tiny `kvtier bench --quick`: every measured path returns exactly the bytes put in.
Speed is not judged here (docs/performance.md has the full run); only correctness and shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_bench_quick_reads_back_exact_bytes_on_every_path(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["get"]["correct"] and res["get"]["all_resident"] and res["put"]["correct"] and res["redis"]["correct"]
    paths = [r["path"] for r in res["rows"]]
    assert any(p.startswith("get") for p in paths) and any(p.startswith("bus") for p in paths)
    assert all(r["ratio"] is None or r["ratio"] > 0 for r in res["rows"])
    assert "| path | figure | bound (same run) |" in run.stdout
    import numpy as np

    assert np.isfinite(res["memcpy_gbps"]) and res["memcpy_gbps"] > 0


def test_gpu_check_skips_cleanly_without_cuda() -> None:
    import torch

    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py")],
                         capture_output=True, text=True, timeout=240)
    if torch.cuda.is_available():
        assert run.returncode == 0, run.stdout + run.stderr
        assert "ALL CHECKS PASSED" in run.stdout
    else:
        assert run.returncode == 0 and "SKIP: no CUDA device" in run.stdout, run.stdout + run.stderr
