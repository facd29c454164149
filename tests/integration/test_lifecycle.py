"""The daemon as systemd runs it: sd_notify READY/STOPPING, SIGTERM, exit codes, config errors."""

from __future__ import annotations

import os
import uuid
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.daemon.descriptor import DESCRIPTOR
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def test_ready_then_sigterm_gives_stopping_and_exit_zero(daemon_factory):
    d = daemon_factory(node="life")
    assert "READY=1" in d.messages
    assert any(m.startswith("MAINPID=") for m in d.messages)
    assert (d.runtime_dir / DESCRIPTOR).exists()
    assert oct(d.runtime_dir.stat().st_mode & 0o777) == "0o750"
    d.proc.send_signal(signal.SIGTERM)
    d.wait_for_message("STOPPING=1", timeout=5)
    assert d.proc.wait(timeout=10) == 0, d.log_tail()
    assert not (d.runtime_dir / DESCRIPTOR).exists(), "a stopped daemon withdraws its descriptor"
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvtier.{d.node}.")]


def test_watchdog_pings_flow_when_systemd_asks(tmp_path, redis_url):
    from tests.support.daemon_proc import DaemonProcess, write_config

    cfg = write_config(tmp_path, node=f"dog-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}", env={"WATCHDOG_USEC": "200000"}).start()
    try:
        d.wait_for_message("WATCHDOG=1", timeout=5)
    finally:
        assert d.stop() == 0


def test_embedded_redis_default_serves_and_cleans_up(tmp_path):
    """No Redis URL: the daemon starts its own redis-server on a unix socket in the runtime dir."""
    from tests.support.daemon_proc import DaemonProcess, write_config

    cfg = write_config(tmp_path, node=f"emb-{uuid.uuid4().hex[:8]}", redis_url="")
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start()
    try:
        sock = d.runtime_dir / "redis.sock"
        assert sock.exists()
        out = subprocess.run(["redis-cli", "-s", str(sock), "ping"], capture_output=True, text=True, timeout=5)
        assert out.stdout.strip() == "PONG"
    finally:
        assert d.stop() == 0
    assert not (d.runtime_dir / "redis.sock").exists()


def test_a_second_daemon_with_the_same_node_id_is_refused(daemon_factory, tmp_path, redis_url):
    from tests.support.daemon_proc import DaemonProcess, write_config

    first = daemon_factory(node="twin")
    other = tmp_path / "other"
    other.mkdir()
    cfg = write_config(other, node=first.node, redis_url=redis_url)
    second = DaemonProcess(cfg, other / f"rt-{first.node}").start(wait_ready=False)
    wait_until(lambda: second.proc.poll() is not None, timeout=30, message="the second daemon exits")
    assert second.proc.returncode == 1
    assert "another kvtier daemon is running" in second.log_tail()
    second.kill()
    assert first.alive and first.stop() == 0


def test_config_with_a_typo_is_refused_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nshutdown_grace = 3\n[policy]\nhigh_watermark = "lots"\n')
    env = {**os.environ}
    check = subprocess.run([sys.executable, "-m", "kvtier.cli", "config", "check", str(bad)],
                           capture_output=True, text=True, timeout=60, env=env)
    assert check.returncode == 2
    assert "daemon.shutdown_grace" in check.stderr and "shutdown_grace_s" in check.stderr
    assert "policy.high_watermark" in check.stderr
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "daemon", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2 and "daemon.shutdown_grace" in run.stderr


def test_unreachable_redis_fails_start_with_a_clear_error(tmp_path):
    from tests.support.daemon_proc import DaemonProcess, write_config

    cfg = write_config(tmp_path, node=f"nored-{uuid.uuid4().hex[:8]}", redis_url=f"unix://{tmp_path}/nothing-here.sock")
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start(wait_ready=False)
    wait_until(lambda: d.proc.poll() is not None, timeout=30, message="daemon exits")
    assert d.proc.returncode == 1
    assert "daemon.fatal" in d.log_tail() and "nothing-here.sock" in d.log_tail()
    d.kill()
