"""CI runs a tiny `kvtier bench --quick`: every measured path returns exactly the bytes put in.
Speed is not judged here (docs/performance.md has the full run); only correctness and shape."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_quick_reads_back_exact_bytes_on_every_path(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # A temporary directory of the bench's own: other test sessions on this machine start daemons
    # (and their kvtier-notify-* directories) in the shared one meanwhile. Short, for sun_path.
    private_tmp = Path(tempfile.mkdtemp(prefix="kvtb-"))
    try:
        run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--quick", "--json", str(out)],
                             capture_output=True, text=True, timeout=240,
                             env={**os.environ, "TMPDIR": str(private_tmp)})
        leftovers = sorted(p.name for p in private_tmp.iterdir() if p.name.startswith("kvtier-"))
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["get"]["correct"] and res["get"]["all_resident"] and res["put"]["correct"] and res["redis"]["correct"]
    assert res["where"]["correct"] and res["where"]["answer_length"] > 0
    paths = [r["path"] for r in res["rows"]]
    assert any(p.startswith("get") for p in paths) and any(p.startswith("bus") for p in paths)
    assert all(r["ratio"] is None or r["ratio"] > 0 for r in res["rows"])
    assert "| path | figure | bound (same run) |" in run.stdout
    assert "need an otherwise idle machine (load average now" in run.stdout  # issue 25: say so in the output
    # Which block copy the shm rows ran (the compiled one, in this project's venvs).
    assert res["compiled_copy"] is True and "Block copies: compiled" in run.stdout
    assert res["hash_kernel"] in ("avx2", "baseline") and f"xxh3's {res['hash_kernel']} kernel" in run.stdout
    missed = sum(r["meets"] is False for r in res["rows"])
    assert (f"{missed} row(s) marked NO" in run.stdout) == bool(missed)
    assert not leftovers, f"the bench left {leftovers} (kvtier-notify-*, runtime or redis directories)"
    import numpy as np

    assert np.isfinite(res["memcpy_gbps"]) and res["memcpy_gbps"] > 0
    # Beside the bound, the same bytes copied a block at a time: a reference for the host, in
    # the report too (docs/performance.md, the ninth stop: glibc's non-temporal threshold).
    assert res["memcpy_block_gbps"] > 0 and all(x["memcpy_block_gbps"] > 0 for x in res["small_blocks"].values())
    assert f"(a block at a time: {res['memcpy_block_gbps']:.2f})" in run.stdout
    # Each put row's CPU a block, client and daemon: whether the copy or per-block work binds it.
    for put in [res["put"], *(x["put"] for x in res["small_blocks"].values())]:
        c, d = put["client_cpu_us_per_block"], put["daemon_cpu_us_per_block"]
        assert c > 0 and d > 0, put  # both processes did work for every put round
        assert f"CPU a block: client {c:.1f} us, daemon {d:.1f} us" in run.stdout


def test_put_phases_reports_each_phase_cpu_and_redis_commands() -> None:
    """benchmarks/put_phases.py on a small arena: a round's rate, both processes' CPU a block,
    the client's four phases, the Redis commands a put (of --per-put blocks), and
    one command's CPU three ways."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "put_phases.py"), "--mib", "8", "--rounds", "1",
                          "--per-put", "16", "--quick", "--redis-calls"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert re.search(r"round 0: [\d,]+ blocks/s, [\d.]+x memcpy; a block: wall [\d.]+ us, CPU client [\d.]+ us, "
                     r"daemon [\d.]+ us", out), out
    phases = re.search(r"phases \(us a block\): (.*)", out)
    assert phases and all(p in phases.group(1) for p in ("take slots", "fill (copy threads)", "publish",
                                                         "wait_resident")), out
    assert "128 blocks of 64 KiB, 16 a put" in out, out
    assert re.search(r"Redis commands a put of 16: .*xadd [\d.]+", out), out  # the client's put, at least
    assert len(re.findall(r"PING: [\d.]+ us of CPU a call", out)) == 3, out


def test_gpu_check_skips_cleanly_without_cuda() -> None:
    import torch

    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py")],
                         capture_output=True, text=True, timeout=240)
    if torch.cuda.is_available():
        assert run.returncode == 0, run.stdout + run.stderr
        assert "ALL CHECKS PASSED" in run.stdout
    else:
        assert run.returncode == 0 and "SKIP: no CUDA device" in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_prefill_scenario_replays_the_trace_and_accounts_for_every_block(tmp_path: Path) -> None:
    """A tiny `kvtier bench --prefill`: two client processes replay 8 requests over 2 shared
    prompts on 2 MiB blocks. Every block wanted is read from exactly one place or missed, no read
    returns wrong bytes, and the cost model's figures follow from the counts."""
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--prefill", "--clients", "2", "--requests", "8",
                          "--prefixes", "2", "--gpu-blocks", "8", "--cpu-blocks", "16", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    res = json.loads(out.read_text())
    assert res["requests"] == 8 and res["wrong_blocks"] == 0
    assert abs(sum(res["hit_rate"].values()) - 1.0) < 1e-9, res["hit_rate"]
    assert res["hit_rate"]["miss"] < 1.0, "a prompt asked for again is read from the cache"
    assert res["hit_tokens"] > 0 and res["recompute_avoided_s"] == res["hit_tokens"] / 25_000
    assert res["net_saved_s"] == res["recompute_avoided_s"] - res["fetch_s"]
    assert 0 < res["prefix_ms"]["p50"] <= res["prefix_ms"]["p99"]
    assert 0 <= res["redis_pulls"]["wait_s"] <= res["fetch_s"] and res["local"]["spent_s"] >= 0
    assert "prefill avoided:" in run.stdout and "cost model:" in run.stdout


@pytest.mark.slow
def test_cluster_bench_quick_reads_back_exact_bytes_on_1_and_3_masters(tmp_path: Path) -> None:
    """A tiny `kvtier bench --cluster`: real clusters of 1 and 3 masters; the redis tier's verified
    reads and node B's pull of node A's chain return exactly the bytes put in."""
    out = tmp_path / "cluster.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--cluster", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    res = json.loads(out.read_text())
    for m in (1, 3):
        r = res[f"masters_{m}"]
        assert r["correct"] and len(r["keys_per_master"]) == m and all(k > 0 for k in r["keys_per_master"])
        assert all(r[k] > 0 for k in ("put_gbps", "get_gbps", "pull_gbps", "raw_put_gbps", "raw_get_gbps"))
    assert "| cross-node pull | 3 |" in run.stdout


def test_bench_disk_quick_verifies_every_block_against_fio(tmp_path: Path) -> None:
    """`kvtier bench --disk --quick`: fio's bound and the block file's rows on a real ext4 directory;
    the run fails if a verified read returns other bytes (bench_disk raises)."""
    out = tmp_path / "disk.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--disk", "--quick", "--disk-dir", str(tmp_path),
                          "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    d = json.loads(out.read_text())["disk"]
    assert d["fio_write_gbps"] > 0 and d["fio_read_gbps"] > 0 and d["write_gbps"] > 0 and d["read_gbps"] > 0
    if d["fstype"] in ("ext4", "xfs"):
        assert d["direct"], "these filesystems take O_DIRECT: the block file must use it"
    assert d["adoption"]["100000"]["headers_per_s"] > 0
    assert "disk verified random read" in run.stdout
