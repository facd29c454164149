"""Fixtures shared by the whole suite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.redis_proc import RedisProcess


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a test marked slow first, the order otherwise kept: `make test` hands whole
    files to two xdist workers in this order (--dist loadfile --no-loadscope-reorder), so the
    longest start first and the workers finish together rather than one waiting on a late one."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A redis-server private to this test session, on a unix socket; killed at session end."""
    with RedisProcess.serving(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> str:
    """The session server's url, emptied first. FLUSHALL is safe: the server is ours alone."""
    if not redis_server.running:  # a fault test stopped it and did not bring it back
        redis_server.start()
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def daemon_factory(tmp_path, redis_url):
    """Start real daemons on the session's Redis; every one is stopped (or killed) at teardown."""
    from kvtier.tools.daemon_process import DaemonProcess
    from tests.support.daemon_proc import stop_all, write_config

    started: list[DaemonProcess] = []
    counter = iter(range(1000))

    def make(node: str | None = None, start: bool = True, **kw) -> DaemonProcess:
        # Node ids name /dev/shm segments: keep them unique across concurrent test sessions.
        node = f"{node or 'n'}-{next(counter)}-{uuid.uuid4().hex[:8]}"
        cfg = write_config(tmp_path, node=node, redis_url=kw.pop("redis_url", redis_url), **kw)
        d = DaemonProcess(cfg, tmp_path / f"rt-{node}")
        started.append(d)
        return d.start() if start else d

    yield make
    stop_all(started, unlink_segments=True)  # a kept arena, or what a killed daemon left
