"""Deadline-bounded polling: tests wait for a condition, never for a fixed amount of time."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


def wait_until(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01,
    message: str | Callable[[], str] = "",
) -> Any:
    """Poll `predicate` until it returns something truthy (returned), or fail at the deadline.
    `message` may be a callable, called at the deadline to say what was found then."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            try:
                said = message() if callable(message) else message
            except Exception as e:  # noqa: BLE001 - the timeout is the failure to report
                said = f"(its message failed: {type(e).__name__}: {e})"
            raise AssertionError(f"timed out after {timeout} s waiting for: {said or predicate!r}")
        time.sleep(interval)


async def async_wait_until(
    predicate: Callable[[], Any | Awaitable[Any]],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str = "",
) -> Any:
    """Like `wait_until`, without blocking the loop; `predicate` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {message or predicate!r}")
        await asyncio.sleep(interval)
