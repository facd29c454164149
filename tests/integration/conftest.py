"""Fixtures the integration tests share (tests/conftest.py has the redis-server ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvtier.bus.connect import make_redis


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator:
    """An asyncio client of the test's own redis-server, as the bus makes them."""
    client = make_redis(redis_url, socket_timeout=2.0, connect_timeout=2.0, retries=2)
    try:
        yield client
    finally:
        await client.aclose()
