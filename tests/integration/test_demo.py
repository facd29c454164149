"""`kvtier demo`, the README's run command, end to end: blocks move between tiers, no wrong bytes,
and Ctrl-C stops everything cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _leftovers(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvtier.demo-{pid}.")]


def _processes_of(pid: int) -> list[int]:
    """Processes started by demo `pid`: they carry its node id in their environment."""
    tag = f"KVTIER__NODE__ID=demo-{pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _summary_row(out: str, tier: str) -> list[int]:
    m = re.search(rf"^\s+{tier}\s+([\d.\s]+)$", out, re.M)
    assert m, out
    return [int(float(x)) for x in m.group(1).split()]


SMALL = """
[pools.demo]
model = "demo"
layers = 4
kv_heads = 2
head_dim = 64
dtype = "float16"
device = "cpu"
gpu_blocks = 8
cpu_blocks = 24
"""


@pytest.mark.slow
def test_demo_moves_blocks_between_tiers_and_reads_no_wrong_bytes(tmp_path):
    # Small tiers, so that even a slow (loaded) machine pushes blocks all the way down in 12 s
    # (client start-up and torch imports included).
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    tmp = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # the demo's own temp files (short: socket paths)
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--duration", "12", "--clients", "2",
                          "--config", str(cfg)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "wrong blocks read: 0" in out.stdout
    assert out.stdout.count("t=") >= 3, "progress is printed while it runs"
    # Issue 25: no all-zero lines while the clients start, the log's removal announced, nothing
    # left behind, and a summary whose columns and counts say what they count.
    assert "waiting for the clients to start" in out.stdout
    first = next(ln for ln in out.stdout.splitlines() if ln.startswith("t="))
    counts = re.findall(r"(?:gpu|cpu|redis) (\d+)(?:/\d+)? blk|(?:hit|up|down|ev|miss) (\d+)", first)
    assert counts and any(int(a or b) for a, b in counts), f"an all-zero progress line: {first}"
    assert "removed at exit, --keep keeps it" in out.stdout
    left = list(tmp.iterdir())
    tmp.rmdir() if not left else None
    assert left == [], "the demo left temporary files (kvtier-notify-*, its runtime dir)"
    assert "block 32 KiB" in out.stdout and "redis: read straight through from Redis" in out.stdout
    m = re.search(r"(\d+) read \(\d+%\): (\d+) from shared memory .*?, (\d+) from Redis", out.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) + int(m.group(3)), out.stdout
    # columns: blocks MiB hits stored promoted demoted evicted failed
    gpu, cpu, rds = (_summary_row(out.stdout, t) for t in ("gpu", "cpu", "redis"))
    assert gpu[3] > 0 and cpu[5] > 0 and rds[5] > 0, "blocks were stored, demoted gpu->cpu and cpu->redis"
    assert cpu[4] > 0, "blocks were promoted back from redis"


def test_demo_stops_cleanly_on_ctrl_c():
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "demo", "--duration", "120", "--clients", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # bounded: the demo prints a progress line every second
        lines.append(line)
        if line.startswith("t="):
            break
    assert _processes_of(proc.pid), "the demo's daemon and client are running"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 0, out
    assert "=== kvtier demo summary ===" in out and "wrong blocks read: 0" in out
    assert _leftovers(proc.pid) == [], "no shared memory left behind"
    assert _processes_of(proc.pid) == [], "no process of the demo is left running"


def test_demo_with_a_disk_tier_shows_it_and_reads_no_wrong_bytes(tmp_path):
    """The demo's tiers with a disk tier under cpu: blocks shed into it, shown in the progress
    lines and the summary, and every block the clients read is exact."""
    cfg = tmp_path / "disk.toml"
    cfg.write_text(f'[disk]\ndir = "{tmp_path / "disk"}"\nreserve_bytes = 0\n[policy]\ndisk_admit_after = 0\n'
                   + SMALL + 'disk_bytes = "4MiB"\n')
    tmp = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--duration", "12", "--clients", "2",
                          "--config", str(cfg)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "wrong blocks read: 0" in out.stdout
    assert re.search(r"disk \d+/\d+ blk", out.stdout), "the progress lines show the disk tier"
    disk = _summary_row(out.stdout, "disk")
    assert disk[5] > 0, "blocks were demoted cpu -> disk"


def test_demo_disk_mib_gives_the_built_in_pool_a_disk_tier(tmp_path):
    from kvtier.config import DEMO_POOL, load_config
    from kvtier.tools.demo_config import demo_disk_config

    cfg = load_config(demo_disk_config(tmp_path, 64), {})
    (pool,) = cfg.pools
    assert pool.disk_bytes == 64 << 20 and cfg.disk.dir == str(tmp_path / "disk")
    assert (pool.model, pool.layers, pool.cpu_blocks, pool.dtype) == \
        (DEMO_POOL.model, DEMO_POOL.layers, DEMO_POOL.cpu_blocks, DEMO_POOL.dtype)
