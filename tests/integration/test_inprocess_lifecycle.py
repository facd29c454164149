"""The daemon's lifecycle in the test's own event loop: startup, serve, shutdown through the stop
event, and a startup that fails halfway. No subprocess, so what the teardown left is seen directly."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvtier.config import load_config
from kvtier.daemon.app import Daemon
from kvtier.daemon.node import node_lock
from kvtier.errors import KvtierError
from kvtier.runtime import DESCRIPTOR, STATS
from tests.support.daemon_proc import POOL_TOML, write_config
from tests.support.redis_proc import RedisProcess
from tests.support.squatter import SQUAT_BYTES, squatter
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

CHORES = {"stats", "reaper", "loop-lag", "stream-sampler", "redis-resync"}


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A server of this module's own, so its client count is the daemon's connections alone."""
    with RedisProcess.serving(tmp_path_factory.mktemp("redis-inproc")) as server:
        yield server


def redis_clients(server: RedisProcess) -> int:
    """Connections to the server other than the one asking."""
    c = server.client()
    try:
        return len(c.client_list()) - 1
    finally:
        c.close()


def segments(node: str) -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvtier.{node}.")}


def lock_is_free(node: str) -> bool:
    try:
        with node_lock(node):
            return True
    except KvtierError:
        return False


def chore_tasks() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t.get_name() in CHORES}


def chore_holders() -> set[asyncio.Task[object]]:
    """The task that holds the chores' TaskGroup (daemon/chores.py)."""
    return {t for t in asyncio.all_tasks() if t.get_name() == "chores"}


async def test_started_in_the_loop_and_stopped_by_the_event_leaves_nothing_behind(tmp_path, own_redis) -> None:
    from tests.support.workload import put_get_roundtrip

    node = f"inproc-{uuid.uuid4().hex[:8]}"
    cfg = load_config(write_config(tmp_path, node=node, redis_url=own_redis.url), environ={})
    before, holders_before = chore_tasks(), chore_holders()
    with capture_logs() as logs:
        daemon = Daemon(cfg, environ={})
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        await async_wait_until(lambda: daemon.ready.is_set() or task.done(), timeout=30, message="daemon ready")
        assert not task.done(), task.exception()
        assert (daemon.runtime_dir / DESCRIPTOR).exists()
        assert {f"kvtier.{node}.t.{part}" for part in ("dir", "gpu", "cpu")} <= segments(node)
        assert not lock_is_free(node)
        await put_get_roundtrip(daemon.runtime_dir)
        chores = chore_tasks() - before
        assert {t.get_name() for t in chores} == CHORES
        [holder] = chore_holders() - holders_before  # one TaskGroup holds them all

        stop.set()
        async with asyncio.timeout(15):
            await task
    assert not (daemon.runtime_dir / DESCRIPTOR).exists(), "the descriptor outlived the daemon"
    assert segments(node) == set(), "segments left in /dev/shm"
    assert lock_is_free(node)
    assert all(t.done() for t in chores), f"chores still running: {[t for t in chores if not t.done()]}"
    stuck = [e for e in logs if e["event"] == "daemon.chores_stuck"]
    assert holder.done() and not holder.cancelled() and holder.exception() is None, (holder, stuck)
    events = [e["event"] for e in logs]
    assert "daemon.chores_stuck" not in events
    assert "daemon.chore_failed" not in events
    assert events[-1] == "daemon.stopped"
    await async_wait_until(lambda: redis_clients(own_redis) == 0, timeout=10, message="redis clients closed")


async def test_a_failing_chore_is_logged_and_the_daemon_serves_on(tmp_path, own_redis) -> None:
    """stats.json is a directory when the daemon starts, so every round of the stats chore fails
    (os.replace onto a directory). Each is logged, the daemon serves and its other chores run; once
    the directory is gone the same chore writes the file, and the stop is clean."""
    from tests.support.workload import put_get_roundtrip

    node = f"inproc-chore-{uuid.uuid4().hex[:8]}"
    cfg = load_config(write_config(tmp_path, node=node, redis_url=own_redis.url), environ={})
    blocker = cfg.node.runtime_dir / STATS
    blocker.mkdir(mode=0o750, parents=True)
    (blocker / "keep").write_text("a directory os.replace cannot replace")
    before = chore_tasks()
    with capture_logs() as logs:
        daemon = Daemon(cfg, environ={})
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        await async_wait_until(lambda: daemon.ready.is_set() or task.done(), timeout=30, message="daemon ready")
        assert not task.done(), task.exception()

        def stats_failures() -> int:
            return sum(e["event"] == "daemon.chore_failed" and e["chore"] == "stats" for e in logs)

        await async_wait_until(lambda: stats_failures() >= 3, timeout=10, message="stats rounds failing, logged")
        await put_get_roundtrip(daemon.runtime_dir)
        chores = chore_tasks() - before
        assert {t.get_name() for t in chores} == CHORES and not any(t.done() for t in chores)
        assert not task.done()

        (blocker / "keep").unlink()
        blocker.rmdir()
        await async_wait_until(blocker.is_file, timeout=10, message="the stats chore writes again")
        stop.set()
        async with asyncio.timeout(15):
            await task  # the stop raises nothing
    events = [e["event"] for e in logs]
    assert "daemon.chores_stuck" not in events
    assert events[-1] == "daemon.stopped"
    assert segments(node) == set() and lock_is_free(node)


async def test_a_startup_that_fails_halfway_releases_what_it_had_acquired(tmp_path, own_redis) -> None:
    """Pool "a" opens (its segments, the Redis clients, the lock are all held), then pool "b"
    finds a squatter's file under its directory segment's name: the start fails, and everything
    acquired before is released; the squatter's file is left as it was."""
    node = f"inproc-bad-{uuid.uuid4().hex[:8]}"
    pools = POOL_TOML.format(name="a", gpu=4, cpu=8) + POOL_TOML.format(name="b", gpu=4, cpu=8)
    cfg = load_config(write_config(tmp_path, node=node, redis_url=own_redis.url, pools_toml=pools), environ={})
    squat = Path("/dev/shm") / f"kvtier.{node}.b.dir"
    with squatter(squat):
        before, holders_before = chore_tasks(), chore_holders()
        daemon = Daemon(cfg, environ={})
        with pytest.raises(Exception, match="refusing"):
            await daemon.run(asyncio.Event())
        assert "a" in daemon.pools, "the failure came before pool a: not halfway"
        assert segments(node) == {squat.name}, "the failed start leaked segments"
        assert squat.read_bytes() == SQUAT_BYTES
        assert not (daemon.runtime_dir / DESCRIPTOR).exists()
        assert lock_is_free(node)
        assert chore_tasks() == before
        assert not chore_holders() - holders_before, "the chores' TaskGroup was opened"
        await async_wait_until(lambda: redis_clients(own_redis) == 0, timeout=10, message="redis clients closed")
        await daemon.shutdown()  # nothing left to release: a no-op
