"""What a new user met in the first hour (issue 25, items 3, 4 and 5): a stopped daemon reported
as running, logs too loud to tail, a client that floods an engine's stderr during an outage,
drops the daemon never counted, and the CLI's rough edges. Each test failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier.client import Client
from kvtier.runtime import STATS, write_json_atomic
from kvtier.shm.segment import SHM_DIR
from tests.support.blocks import SHAPE, make_kv
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

LIFECYCLE = {"daemon.ready", "daemon.stopping", "daemon.stopped", "daemon.signal", "daemon.metrics",
             "bus.consumer_started", "bus.consumer_stopped", "arena.created", "arena.reattached", "pool.gpu_ready"}


def kvtier(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def log_lines(d) -> list[dict]:
    return d.log_events()


# --- 3: kvtier status -----------------------------------------------------------------------------

def test_status_of_a_stopped_daemon_says_it_is_not_running_and_fails(daemon_factory):
    d = daemon_factory()
    wait_until(lambda: (d.runtime_dir / STATS).exists(), timeout=10, message="stats.json")
    live = kvtier("status", "--runtime-dir", str(d.runtime_dir))
    assert live.returncode == 0 and f"pid {d.proc.pid}" in live.stdout
    pid = d.proc.pid
    assert d.stop() == 0
    dead = kvtier("status", "--runtime-dir", str(d.runtime_dir))
    assert dead.returncode == 1 and dead.stdout == "", dead
    assert "daemon not running (last seen" in dead.stderr and f"pid {pid}" in dead.stderr, dead.stderr
    watch = kvtier("status", "--runtime-dir", str(d.runtime_dir), "--watch", "--interval", "0.05", "--count", "2")
    assert watch.stdout.count("daemon not running (last seen") == 2, watch.stdout


def test_status_of_a_live_daemon_that_stopped_writing_says_so(tmp_path):
    """A live pid whose stats are minutes old (hung, or a pid reused since)."""
    stats = {"node": "n", "pid": os.getpid(), "written_at": 1.0, "stats_interval_s": 1.0, "pools": {}}
    write_json_atomic(tmp_path / STATS, stats)
    run = kvtier("status", "--runtime-dir", str(tmp_path))
    assert run.returncode == 1 and "daemon not writing its stats" in run.stderr, run


def test_status_without_a_daemon_names_the_flag_and_the_variable(tmp_path, monkeypatch, capsys):
    import kvtier.runtime
    from kvtier.cli import main

    monkeypatch.delenv("KVTIER__NODE__RUNTIME_DIR", raising=False)
    monkeypatch.setattr(kvtier.runtime, "default_runtime_dir", lambda environ: tmp_path / "nothing")
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert "--runtime-dir" in err and "KVTIER__NODE__RUNTIME_DIR" in err, err


def test_status_into_a_pipe_that_closes_ends_quietly(daemon_factory):
    d = daemon_factory()
    wait_until(lambda: (d.runtime_dir / STATS).exists(), timeout=10, message="stats.json")
    run = subprocess.run(["bash", "-o", "pipefail", "-c",
                          f"{sys.executable} -m kvtier.cli status --runtime-dir {d.runtime_dir} --watch "
                          f"--interval 0.05 --count 40 | head -1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith(f"node {d.node}"), run
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr


def test_status_shows_small_blocks_in_a_unit_that_shows_them(daemon_factory):
    d = daemon_factory()
    wait_until(lambda: (d.runtime_dir / STATS).exists(), timeout=10, message="stats.json")
    out = kvtier("status", "--runtime-dir", str(d.runtime_dir)).stdout
    assert "block 8 KiB" in out and "0.0 MiB" not in out, out


# --- 4: what operators see -------------------------------------------------------------------------

async def test_the_daemon_at_info_logs_lifecycle_not_one_line_per_batch(daemon_factory):
    d = daemon_factory(gpu=16, cpu=64)
    async with await Client.connect(d.runtime_dir) as c:
        out = torch.empty((4, *SHAPE), dtype=torch.float16)
        for i in range(150):  # hundreds of batches: before, as many `bus.batch` lines at info
            keys = c.block_keys("t", list(range(i * 1000, i * 1000 + 64)))
            await c.put("t", keys, make_kv(4, seed=i))
            await c.get("t", keys, out, remote=True)
        await async_wait_until(lambda: d.pool_stats().get("puts", 0) >= 100, timeout=20, message="puts handled")
    assert d.stop() == 0
    lines = log_lines(d)
    assert sum(x["event"] == "bus.batch" for x in lines) == 0, "per-batch lines belong at debug"
    chatty = [x["event"] for x in lines if x["level"] != "debug" and x["event"] not in LIFECYCLE]
    assert len(chatty) <= 10, chatty


CLIENT_IN_AN_OUTAGE = textwrap.dedent("""
    import asyncio, json, sys
    import torch
    from kvtier.client import Client

    async def main():
        async with await Client.connect(sys.argv[1], socket_timeout=0.5) as c:
            p = c.pool("t")
            out = torch.empty((2, *p.layout.shape), dtype=p.dtype)
            for i in range(40):  # 40 requests while Redis is down
                keys = c.block_keys("t", list(range(i * 100, i * 100 + 32)))
                await c.get("t", keys, out, remote=True)
                await c.put("t", keys, out)
            print(json.dumps({"dropped": c.stats.put_dropped, "remote_failures": c.stats.remote_failures}))

    asyncio.run(main())
""")


def test_a_client_in_a_redis_outage_logs_a_line_and_a_count_not_a_line_per_request(daemon_factory, redis_server):
    d = daemon_factory()
    redis_server.stop()
    run = subprocess.run([sys.executable, "-c", CLIENT_IN_AN_OUTAGE, str(d.runtime_dir)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout)
    assert seen["dropped"] == 80 and seen["remote_failures"] == 40, seen
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    # Before: three warnings per request (remote_read_failed, put_failed, access_report_failed).
    assert len(lines) <= 8, "\n".join(lines)
    for event in ("client.remote_read_failed", "client.put_failed"):
        assert any(event in ln for ln in lines), f"{event} not logged at all"
    assert any("suppressed=" in ln and "suppressed=0" not in ln for ln in lines), "the count of lines held back"


async def test_blocks_a_client_could_not_hand_over_reach_the_daemons_counters(daemon_factory):
    d = daemon_factory(gpu=0, cpu=64, extra="grant_blocks = 0")  # staging alone: no granted slot takes a block
    c = await Client.connect(d.runtime_dir, staging_blocks=4)
    keys = c.block_keys("t", list(range(16 * 10)))
    assert (await c.put("t", keys, make_kv(10, seed=1))).dropped == 6  # staging holds 4
    await async_wait_until(lambda: d.pool_stats().get("client_puts_dropped") == 6, timeout=20,
                           message="the client's drops counted by the daemon")
    keys = c.block_keys("t", list(range(10**5, 10**5 + 16 * 10)))
    await async_wait_until(lambda: d.pool_stats().get("puts", 0) >= 4, timeout=20, message="the first put stored")
    assert (await c.put("t", keys, make_kv(10, seed=2))).dropped >= 6
    dropped = c.stats.put_dropped
    segment = next(SHM_DIR.glob(f"kvtier.{d.node}.stage.{os.getpid()}.*"))
    await c.close()  # at once: these drops are not counted yet, so the segment is left for the daemon
    await async_wait_until(lambda: d.pool_stats().get("client_puts_dropped") == dropped, timeout=20,
                           message="drops of a client that closed counted")
    wait_until(lambda: not segment.exists(), timeout=20, message="its segment unlinked once counted")


def test_where_says_when_the_prefix_index_is_off_on_this_daemon(daemon_factory):
    d = daemon_factory()
    run = kvtier("where", "--runtime-dir", str(d.runtime_dir), "--pool", "t", "--tokens", ",".join(map(str, range(32))))
    assert run.returncode == 0, run.stderr
    assert "[prefix_index] is not enabled on this daemon" in run.stderr, run.stderr
    as_json = kvtier("where", "--runtime-dir", str(d.runtime_dir), "--pool", "t", "--tokens", "1 2 3", "--json")
    assert json.loads(as_json.stdout)["prefix_index_enabled"] is False


# --- 5: the CLI's rough edges ----------------------------------------------------------------------

def test_the_cli_help_version_and_config_check_forms():
    help_text = kvtier("--help").stdout
    assert "SUPPRESS" not in help_text and "_demo-worker" not in help_text, help_text
    version = kvtier("--version")
    assert version.returncode == 0 and version.stdout.startswith("kvtier "), version
    from pathlib import Path

    example = str(Path(__file__).resolve().parents[2] / "config" / "kvtier.toml")
    assert "kvtier config check --config FILE" in Path(example).read_text()  # what the file says works
    for form in (["--config", example], [example]):
        run = kvtier("config", "check", *form)
        assert run.returncode == 0 and "is valid" in run.stderr, run
