"""The daemon's chores (kvtier/daemon/chores.py): tasks of one TaskGroup held by a task of its own,
guarded so that a failing chore is logged and ends alone, and closed within a bound."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog
from structlog.testing import capture_logs

from kvtier.daemon.chores import Chores
from kvtier.errors import KvtierError
from tests.support.waiting import async_wait_until

LOG = structlog.get_logger("test")


class Fatal(BaseException):
    """Not an Exception: what a chore's guard does not catch."""


def holders() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t.get_name() == "chores"}


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_failing_chore_is_logged_and_ends_alone_while_the_others_run_on() -> None:
    ticks = {"steady": 0, "flaky": 0}

    def steady() -> None:
        ticks["steady"] += 1

    def flaky() -> None:
        ticks["flaky"] += 1
        if ticks["flaky"] <= 2:
            raise OSError("disk full")

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad state")

    with capture_logs() as logs:
        async with Chores(LOG) as chores:
            chores.every("steady", 0.001, steady)
            chores.every("flaky", 0.001, flaky)
            chores.start("broken", broken())
            chores.start("sampler", forever())
            await async_wait_until(lambda: ticks["flaky"] >= 5 and ticks["steady"] >= 5, message="rounds go on")
            by_name = {t.get_name(): t for t in chores.tasks}
            assert by_name["broken"].done() and not by_name["broken"].cancelled()
            assert not any(by_name[n].done() for n in ("steady", "flaky", "sampler"))
    failed = [(e["chore"], e.get("ended", False)) for e in logs if e["event"] == "daemon.chore_failed"]
    assert failed.count(("flaky", False)) == 2, "a periodic chore logs each failed round and carries on"
    assert failed.count(("broken", True)) == 1
    assert all(t.done() for t in chores.tasks)
    assert not [e for e in logs if e["event"] in ("daemon.chores_stuck", "daemon.chores_failed")]


async def test_close_cancels_every_chore_waits_for_its_cleanup_and_ends_the_group() -> None:
    cleaned: list[str] = []

    async def tidy(name: str) -> None:
        try:
            await forever()
        finally:
            await asyncio.sleep(0.01)  # a cleanup that awaits: the close waits for it
            cleaned.append(name)

    with capture_logs() as logs:
        chores = Chores(LOG)
        await chores.open()
        [holder] = holders()
        for name in ("a", "b", "c"):
            chores.start(name, tidy(name))
        await asyncio.sleep(0)  # let them start
        await chores.aclose()
    assert sorted(cleaned) == ["a", "b", "c"]
    assert all(t.cancelled() for t in chores.tasks)
    assert holder.done() and not holder.cancelled() and holder.exception() is None
    assert not logs
    await chores.aclose()  # idempotent


async def test_a_chore_that_will_not_stop_is_named_and_left_behind_within_the_bound() -> None:
    """A chore that loses its cancel (as redis-py can make one on Python 3.11) must not hold the
    stop up: the close returns after stop_s, names it, and the group ends once it does."""
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    with capture_logs() as logs:
        chores = Chores(LOG, stop_s=0.2)
        await chores.open()
        [holder] = holders()
        chores.start("stubborn", stubborn())
        chores.start("sampler", forever())
        await asyncio.sleep(0)
        async with asyncio.timeout(10):  # were the close unbounded, it would wait for `release`
            await chores.aclose()
    stuck = [e for e in logs if e["event"] == "daemon.chores_stuck"]
    assert [e["chores"] for e in stuck] == [["stubborn"]]
    by_name = {t.get_name(): t for t in chores.tasks}
    assert by_name["sampler"].cancelled() and not by_name["stubborn"].done() and not holder.done()
    release.set()
    await async_wait_until(holder.done, timeout=5, message="the group ends once the stuck chore does")
    assert holder.exception() is None


async def test_a_fatal_chore_error_cancels_its_siblings_but_not_the_caller() -> None:
    """The chores are one TaskGroup: an error the guard lets through (not an Exception) takes
    the group down, and is reported at the close; the task that opened the group runs on."""
    fatal = asyncio.Event()

    async def doomed() -> None:
        await fatal.wait()
        raise Fatal("gone")

    with capture_logs() as logs:
        chores = Chores(LOG)
        await chores.open()
        [holder] = holders()
        chores.start("sampler", forever())
        chores.start("doomed", doomed())
        fatal.set()
        await async_wait_until(holder.done, timeout=5, message="the group ended")
        await chores.aclose()
    by_name = {t.get_name(): t for t in chores.tasks}
    assert by_name["sampler"].cancelled(), "a sibling in the same TaskGroup is cancelled"
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]
    assert [e["event"] for e in logs] == ["daemon.chores_failed"]
    assert logs[0]["errors"] == ["Fatal: gone"]


async def test_a_start_failing_after_the_chores_began_cancels_them_and_raises_its_own_error() -> None:
    """As in Daemon.startup: the chores are on the exit stack; a later step's error unwinds it and
    comes out as itself (the CLI reports a KvtierError in one line), not in an ExceptionGroup."""
    with pytest.raises(KvtierError, match="no room") as raised:
        async with contextlib.AsyncExitStack() as stack:
            chores = await stack.enter_async_context(Chores(LOG))
            chores.start("sampler", forever())
            [holder] = holders()
            raise KvtierError("no room")
    assert type(raised.value) is KvtierError
    assert all(t.cancelled() for t in chores.tasks) and holder.done()
    with pytest.raises(RuntimeError, match="not open"):
        chores.start("late", forever())  # closed: refused, and the coroutine is closed, not leaked
    assert not holders() - {holder}
