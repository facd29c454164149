"""A cancellation that redis-py swallowed, honoured at the caller's next safe point.

On Python 3.11, `asyncio.wait_for` returns the inner result when the outer task is cancelled
just after the inner awaitable finished (CPython gh-86296, fixed in 3.12). redis-py's asyncio
`Connection.send_packed_command` wraps every write in `wait_for`, so a cancel landing in that
window is lost: the command completes and the task runs on, though `Task.cancelling()` still
counts the request (scripts/repro/xinfo_cancel_hang.py). Loops that are stopped by cancellation
call `raise_if_cancelling()` after each Redis round trip.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise CancelledError if the current task was asked to cancel and the request got lost."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancellation swallowed inside redis-py, re-raised")
