"""The daemon's chores (stats, reaper, samplers, watchdog, arena population) and bounded teardown steps.

Chores run beside the work: they never end the daemon, and at the stop each gets a bounded
time to wind down, so one stuck in a Redis call cannot hold the stop up.

They are tasks of one `asyncio.TaskGroup`, owned by the daemon's lifecycle: `startup()` opens it
(on its exit stack) and starts the chores before READY; `shutdown()` closes it, after `serve()`
has drained the consumers. So the group outlives `serve()` and its TaskGroup (the consumers'),
which ends at the drain: the stats, the reaper and the watchdog must keep going through the
drain, and the final stats are written only once the chores have stopped.

The group is held by a task of its own (`chores`), not by the daemon's main task, because:
- leaving a TaskGroup waits for every child without a bound: a chore whose cancel was lost
  (Python 3.11 and redis-py: bus/cancel.py) would hold the stop up until the process gives up
  (`daemon.stop_timeout`, exit status 1). `aclose()` waits `stop_s` for the holder instead, then
  names what is left (`daemon.chores_stuck`) and lets the teardown go on without it;
- a group entered by the main task in `startup()` and left in `shutdown()` would wrap a failed
  start's error in an ExceptionGroup (the CLI reports a `KvtierError` in one line), and could
  cancel the main task at any point of `serve()`.
A chore's exception is logged (`daemon.chore_failed`) and ends that chore alone; a periodic
chore (`every`) logs each failed round and carries on. No chore's Exception reaches the group, so
none cancels the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any

CHORE_STOP_S = 1.0  # how long the chores get to wind down at the stop


class Chores:
    """The chores' TaskGroup and its holder task. `async with Chores(log) as chores:` (or `open()`
    and `aclose()`); `start` and `every` add chores while it is open."""

    def __init__(self, log: Any, stop_s: float = CHORE_STOP_S) -> None:
        self._log = log
        self._stop_s = stop_s
        self._group: asyncio.TaskGroup | None = None
        self._holder: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []  # every chore started, in order

    async def __aenter__(self) -> Chores:
        await self.open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Start the holder task; return once its TaskGroup takes chores."""
        if self._holder is not None:
            raise RuntimeError("chores already open")
        entered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._holder = holder = asyncio.create_task(self._hold(entered), name="chores")
        try:
            await entered
        except BaseException:  # cancelled before the group was entered: leave no holder behind
            self._holder = None
            holder.cancel()
            raise

    async def _hold(self, entered: asyncio.Future[None]) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            entered.set_result(None)
            await self._stopping.wait()
        # Leaving the group waited for every chore: all have ended.

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as the chore `name` until it returns or the chores are closed."""
        if self._group is None or self._stopping.is_set():
            coro.close()
            raise RuntimeError(f"chore {name!r} started while the chores are not open")
        task = self._group.create_task(self._guarded(name, coro), name=name)
        # A chore cancelled before its first step never awaited `coro`: close it (a no-op once
        # it has run), or it would be reported as never awaited.
        task.add_done_callback(lambda _: coro.close())
        self.tasks.append(task)

    def every(self, name: str, interval: float, fn: Callable[[], object]) -> None:
        """Call `fn` every `interval` seconds (first after one interval)."""
        self.start(name, self._every(name, interval, fn))

    async def _guarded(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except Exception:
            self._log.exception("daemon.chore_failed", chore=name, ended=True)

    async def _every(self, name: str, interval: float, fn: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                fn()
            except Exception:
                self._log.exception("daemon.chore_failed", chore=name)

    async def aclose(self) -> None:
        """Cancel every chore and give them `stop_s` to end. Those still running then are logged
        (`daemon.chores_stuck`) and left behind with the holder. Idempotent."""
        holder, self._holder = self._holder, None
        if holder is None:
            return
        for t in self.tasks:
            t.cancel(msg="daemon stopping")
        self._stopping.set()
        await asyncio.wait([holder], timeout=self._stop_s)
        if not holder.done():
            self._log.warning("daemon.chores_stuck", chores=sorted(t.get_name() for t in self.tasks if not t.done()))
            return
        if not holder.cancelled() and (e := holder.exception()) is not None:  # not a chore's Exception
            errors = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
            self._log.error("daemon.chores_failed", errors=[f"{type(x).__name__}: {x}" for x in errors])


async def bounded(log: Any, what: str, aw: Awaitable[object], timeout: float = 2.0) -> None:
    """A teardown step that may not hold the stop up for long; its failure is logged, not raised.

    asyncio.timeout rather than wait_for: on Python 3.11 wait_for can swallow a cancel of the
    caller (bus/cancel.py), and a second SIGTERM during the teardown must still be obeyed."""
    try:
        async with asyncio.timeout(timeout):
            await aw
    except Exception as e:  # TimeoutError included
        log.warning("daemon.teardown_step_failed", step=what, error=f"{type(e).__name__}: {e}")
