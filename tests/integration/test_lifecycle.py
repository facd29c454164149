"""The daemon as systemd runs it: sd_notify READY/STOPPING, SIGTERM, exit codes, config errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvtier.runtime import DESCRIPTOR
from tests.support.squatter import SQUAT_BYTES, squatter
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
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

    cfg = write_config(tmp_path, node=f"dog-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}", env={"WATCHDOG_USEC": "200000"}).start()
    try:
        d.wait_for_message("WATCHDOG=1", timeout=5)
    finally:
        assert d.stop() == 0


def test_embedded_redis_default_serves_and_cleans_up(tmp_path):
    """No Redis URL: the daemon starts its own redis-server on a unix socket in the runtime dir."""
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

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
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

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


def test_a_second_daemon_on_the_same_runtime_directory_is_refused_whatever_its_node_id(daemon_factory, tmp_path,
                                                                                          redis_url):
    """Issue 25: a different node id used to start, overwrite kvtier.json and stats.json, and
    delete the descriptor when it stopped, so new clients of the first daemon got
    DaemonUnavailable. The runtime directory is locked now; the first daemon is untouched."""
    from kvtier.client import SyncClient
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

    first = daemon_factory(node="owner")
    before = (first.runtime_dir / "kvtier.json").read_bytes()
    cfg = write_config(tmp_path, node=f"intruder-{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                       runtime_dir=first.runtime_dir)
    second = DaemonProcess(cfg, first.runtime_dir)
    try:
        second.start(wait_ready=False)
        wait_until(lambda: second.proc.poll() is not None, timeout=30, message="the second daemon exits")
    finally:
        second.kill()
    assert second.proc.returncode == 1
    tail = second.log_tail()
    assert "holds the runtime directory" in tail and f"pid {first.proc.pid}, node {first.node}" in tail, tail
    assert "Traceback" not in tail
    assert (first.runtime_dir / "kvtier.json").read_bytes() == before
    assert first.stats()["pid"] == first.proc.pid
    with SyncClient(first.runtime_dir) as c:  # new clients still find the first daemon
        assert c.lookup("t", [bytes(32)]).length == 0
    assert first.alive and first.stop() == 0
    assert not (first.runtime_dir / "kvtier.json").exists()


def test_a_stopping_daemon_leaves_a_descriptor_it_did_not_write(tmp_path):
    from kvtier.daemon.node import descriptor
    from kvtier.runtime import write_json_atomic

    mine = {"pid": os.getpid(), "epoch": 1}
    with descriptor(tmp_path, mine) as path:
        write_json_atomic(path, {"pid": os.getpid() + 1, "epoch": 2})  # another daemon's, somehow
    assert path.exists(), "deleted a descriptor this process did not write"
    with descriptor(tmp_path, mine) as path:
        pass
    assert not path.exists()


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
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

    cfg = write_config(tmp_path, node=f"nored-{uuid.uuid4().hex[:8]}", redis_url=f"unix://{tmp_path}/nothing-here.sock")
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start(wait_ready=False)
    wait_until(lambda: d.proc.poll() is not None, timeout=30, message="daemon exits")
    assert d.proc.returncode == 1
    assert "daemon.start_failed" in d.log_tail() and "nothing-here.sock" in d.log_tail()
    d.kill()


@pytest.mark.parametrize("setting", ["url", "bus_url"])
def test_a_bad_redis_url_at_start_is_one_line_that_names_the_setting(tmp_path, redis_url, setting):
    """Issue 25: `ConnectionError: Error 111 connecting to 127.0.0.1:1` named no setting and, on a
    terminal, came with a 708-line traceback of redis-py internals. Now: one line, no traceback,
    in the console format a terminal gets too."""
    bad = "redis://127.0.0.1:1"
    env = {**os.environ, "KVTIER__LOG__FORMAT": "console", "KVTIER__REDIS__" + setting.upper(): bad}
    if setting == "bus_url":
        env["KVTIER__REDIS__URL"] = redis_url
    env["KVTIER__NODE__RUNTIME_DIR"] = str(tmp_path / "rt")
    env["KVTIER__METRICS__LISTEN"] = ""
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "daemon"], capture_output=True, text=True,
                         timeout=60, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    failed = [ln for ln in lines if "daemon.start_failed" in ln]
    assert len(failed) == 1 and f"[redis] {setting} = '{bad}'" in failed[0], out
    assert "Traceback" not in out and len(lines) <= 6, out


def test_redis_acl_user_and_password_from_the_url(tmp_path, redis_server):
    """An ACL user that may only touch kvtier's keys: the daemon and its clients work with it;
    a wrong password stops the start with a clear error that does not print the password."""
    import asyncio

    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config
    from tests.support.workload import put_get_roundtrip

    admin = redis_server.client()
    admin.acl_setuser("kvtier-node", enabled=True, passwords=["+s3cret-pw"], keys=["kvtier:*"],
                      channels=["*"], commands=["+@all", "-@dangerous"])
    try:
        url = f"unix://kvtier-node:s3cret-pw@{redis_server.socket_path}"
        cfg = write_config(tmp_path, node=f"acl-{uuid.uuid4().hex[:8]}", redis_url=url)
        d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start()
        asyncio.run(put_get_roundtrip(d.runtime_dir))
        assert d.stop() == 0

        bad = write_config(tmp_path, node=f"acl-bad-{uuid.uuid4().hex[:8]}",
                           redis_url=url.replace("s3cret-pw", "wrong-pw"))
        b = DaemonProcess(bad, bad.parent / f"rt-{bad.stem}").start(wait_ready=False)
        wait_until(lambda: b.proc.poll() is not None, timeout=30, message="daemon exits")
        assert b.proc.returncode == 1
        tail = b.log_tail()
        assert "daemon.start_failed" in tail and ("WRONGPASS" in tail or "invalid" in tail.lower()), tail
        assert "wrong-pw" not in tail, "the password leaked into the log"
        b.kill()
    finally:
        admin.acl_deluser("kvtier-node")
        admin.close()


@pytest.mark.parametrize("part", ["dir", "cpu"])
def test_a_squatter_segment_under_our_name_is_refused_never_attached(tmp_path, redis_url, part):
    """Someone else pre-created the segment the daemon is about to create (the directory, or the
    cpu arena it would re-attach): the start fails with the reason, and the squatter's file is
    left untouched (neither attached, nor unlinked and replaced)."""
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

    cfg = write_config(tmp_path, node=f"squat-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
    path = Path("/dev/shm") / f"kvtier.{cfg.stem}.t.{part}"
    with squatter(path):
        d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}").start(wait_ready=False)
        wait_until(lambda: d.proc.poll() is not None, timeout=30, message="daemon exits")
        assert d.proc.returncode == 1
        assert "refusing" in d.log_tail(), d.log_tail()
        assert path.exists() and path.read_bytes() == SQUAT_BYTES, "the squatter's file was touched"
        left = {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvtier.{cfg.stem}.")}
        assert left == {path.name}, f"the failed start leaked {left - {path.name}}"
        d.kill()


def test_watchdog_pings_stop_while_the_event_loop_is_blocked(tmp_path, redis_url):
    """The pings come from the event loop itself: a loop blocked for 3 s (failpoint block_loop)
    sends none meanwhile, so systemd's watchdog would fire; afterwards they resume."""
    import time

    from kvtier.failpoints import BLOCK_S
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import write_config

    cfg = write_config(tmp_path, node=f"stall-{uuid.uuid4().hex[:8]}", redis_url=redis_url)
    d = DaemonProcess(cfg, cfg.parent / f"rt-{cfg.stem}",
                      env={"WATCHDOG_USEC": "200000", "KVTIER__DAEMON__FAILPOINT": "block_loop:15"}).start()
    try:
        pings: list[float] = []
        gaps: list[float] = []
        deadline = time.monotonic() + 15
        # Until the long gap has two pings after it (whenever the block came), or the deadline.
        while time.monotonic() < deadline and not any(g >= BLOCK_S * 0.8 for g in gaps[:-1]):
            if "WATCHDOG=1" in d.next_messages(timeout=0.5):  # blocks until a notification comes
                pings.append(time.monotonic())
                gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert gaps and max(gaps) >= BLOCK_S * 0.8, f"pings kept coming while the loop was blocked: {gaps}"
        assert sorted(gaps)[len(gaps) // 2] < 0.5, f"pings were not regular otherwise: {gaps}"
        assert gaps.index(max(gaps)) < len(gaps) - 1, "and they resumed afterwards"
    finally:
        assert d.stop() == 0
