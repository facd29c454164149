"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_proc import RedisProcess


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A redis-server private to this test session, on a unix socket; killed at session end."""
    server = RedisProcess.spawn(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop(kill=True)


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
