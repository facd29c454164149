"""The daemon's chores (stats, reaper, samplers, watchdog) and bounded teardown steps.

Chores run beside the work: they never end the daemon, and at the stop each gets a bounded
time to wind down, so one stuck in a Redis call cannot hold the stop up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

CHORE_STOP_S = 1.0  # how long the chores get to wind down at the stop


class Chores:
    def __init__(self, log: Any, stop_s: float = CHORE_STOP_S) -> None:
        self._log = log
        self._stop_s = stop_s
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self.tasks.append(asyncio.create_task(coro, name=name))

    def every(self, name: str, interval: float, fn: Callable[[], object]) -> None:
        self.start(name, self._every(interval, fn))

    async def _every(self, interval: float, fn: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                fn()
            except Exception:
                self._log.exception("daemon.chore_failed", chore=getattr(fn, "__name__", repr(fn)))

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel(msg="daemon stopping")
        if not self.tasks:
            return
        _done, stuck = await asyncio.wait(self.tasks, timeout=self._stop_s)
        if stuck:
            self._log.warning("daemon.chores_stuck", chores=sorted(t.get_name() for t in stuck))


async def bounded(log: Any, what: str, aw: Awaitable[object], timeout: float = 2.0) -> None:
    """A teardown step that may not hold the stop up for long; its failure is logged, not raised.

    asyncio.timeout rather than wait_for: on Python 3.11 wait_for can swallow a cancel of the
    caller (bus/cancel.py), and a second SIGTERM during the teardown must still be obeyed."""
    try:
        async with asyncio.timeout(timeout):
            await aw
    except Exception as e:  # TimeoutError included
        log.warning("daemon.teardown_step_failed", step=what, error=f"{type(e).__name__}: {e}")
