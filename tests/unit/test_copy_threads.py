"""The client's copy threads (kvtier/offload.py `CopyThreads`): a copy's shares run in its threads,
results come back in the items' order, a failure is raised only once every share has finished,
and a caller cancelled mid-copy sees its CancelledError only after the copy stopped writing (a
copy writes into memory its caller is about to reuse). Still an Executor for run_in_executor."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier.offload import CopyThreads


@pytest.fixture
def pool():
    p = CopyThreads(3)
    yield p
    p.shutdown(wait=True)


def test_shares_run_in_the_threads_and_come_back_in_order(pool: CopyThreads) -> None:
    seen: set[str] = set()

    def square(share):
        seen.add(threading.current_thread().name)
        return [x * x for x in share]

    got = asyncio.run(pool.map_shares(square, list(range(10)), 3))
    assert got == [x * x for x in range(10)]
    assert seen and all(name.startswith("kvtier-copy_") for name in seen), seen
    assert asyncio.run(pool.map_shares(square, [], 3)) == []


def test_a_failure_is_raised_once_every_share_has_finished(pool: CopyThreads) -> None:
    slow_done = threading.Event()
    release = threading.Event()

    def share(items):
        if items[0] == 0:
            raise ValueError("share 0 failed")
        release.wait(5)
        slow_done.set()
        return items

    async def run():
        asyncio.get_running_loop().call_later(0.05, release.set)
        with pytest.raises(ValueError, match="share 0 failed"):
            await pool.map_shares(share, [0, 1], 2)
        assert slow_done.is_set(), "raised before the other share finished"

    asyncio.run(run())


def test_a_cancelled_caller_waits_for_the_copy_to_stop_writing(pool: CopyThreads) -> None:
    started, release = threading.Event(), threading.Event()
    writing = []

    def copy(items):
        started.set()
        release.wait(5)
        writing.append("done")
        return items

    async def run():
        task = asyncio.ensure_future(pool.map_shares(copy, [1], 1))
        assert await asyncio.to_thread(started.wait, 5), "the copy never started"
        task.cancel()
        for _ in range(20):  # loop turns enough for the cancel to reach the task; the copy is held
            await asyncio.sleep(0)
        assert not task.done(), "the caller was let go while its copy still ran"
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert writing == ["done"]

    asyncio.run(run())


def test_it_is_an_executor_for_run_in_executor(pool: CopyThreads) -> None:
    async def run():
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(pool, sum, [1, 2, 3]) == 6
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(pool, divmod, 1, 0)

    asyncio.run(run())


def test_start_shares_hands_the_shares_over_before_the_caller_awaits(pool: CopyThreads) -> None:
    running, release = threading.Event(), threading.Event()

    def copy(items):
        running.set()
        assert release.wait(5)
        return items

    async def run():
        done = pool.start_shares(copy, [1, 2], 1)
        assert await asyncio.to_thread(running.wait, 5), "the share started before it was awaited"
        release.set()  # the caller's own work, meanwhile
        assert await done == [1, 2]

    asyncio.run(run())
