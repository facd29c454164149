"""Redis clients configured the one way kvtier wants them.

Everything that matters for the bus is explicit rather than left to redis-py defaults, which
changed between majors (reliability.md §0.5): socket and connect timeouts, a small capped
exponential retry on connection and timeout errors, and a periodic health check so an idle
pooled connection is verified before use. Replies stay bytes (`decode_responses=False`): event
payloads are msgpack, not text.

URLs: `redis://[user:pass@]host:port/db`, `rediss://...` (TLS) and `unix:///path/to/sock[?db=n]`.

Retries can duplicate a non-idempotent XADD whose reply was lost; consumers are idempotent, so
that is accepted (reliability.md §1.7). A blocking XREADGROUP must use BLOCK < socket_timeout.
"""

from __future__ import annotations

from typing import TypedDict

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry as SyncRetry

HEALTH_CHECK_INTERVAL_S = 30
BACKOFF_CAP_S = 1.0
BACKOFF_BASE_S = 0.01
SCHEMES = ("redis://", "rediss://", "unix://")


def _check(url: str, socket_timeout: float, connect_timeout: float, retries: int) -> None:
    if not url.startswith(SCHEMES):
        raise ValueError(f"redis url must start with one of {', '.join(SCHEMES)}")
    if socket_timeout <= 0 or connect_timeout <= 0:
        raise ValueError("socket_timeout and connect_timeout must be > 0")
    if retries < 0:
        raise ValueError("retries must be >= 0")


class _Options(TypedDict):
    """The keyword arguments both clients get (typed, so `**` cannot reach another parameter)."""

    decode_responses: bool
    socket_timeout: float
    socket_connect_timeout: float
    health_check_interval: int


def _kwargs(socket_timeout: float, connect_timeout: float) -> _Options:
    return {
        "decode_responses": False,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


def make_redis(
    url: str, *, socket_timeout: float, connect_timeout: float, retries: int
) -> redis.asyncio.Redis:
    """An asyncio client; the caller owns it and must `await client.aclose()`."""
    _check(url, socket_timeout, connect_timeout, retries)
    retry = AsyncRetry(
        ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        retries,
        supported_errors=(ConnectionError, TimeoutError),
    )
    return redis.asyncio.Redis.from_url(url, retry=retry, **_kwargs(socket_timeout, connect_timeout))


def make_sync_redis(url: str, *, socket_timeout: float, connect_timeout: float, retries: int) -> redis.Redis:
    """The synchronous twin of `make_redis`, for callers without an event loop."""
    _check(url, socket_timeout, connect_timeout, retries)
    retry = SyncRetry(
        ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
        retries,
        supported_errors=(ConnectionError, TimeoutError),
    )
    return redis.Redis.from_url(url, retry=retry, **_kwargs(socket_timeout, connect_timeout))
