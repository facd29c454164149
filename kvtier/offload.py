"""Block copies off the event loop, in threads (the compiled copy, numpy copies and preads release the GIL).

A copy that has started writes into memory its caller is about to reuse or free (a tier slot,
a staging slot, the caller's tensor), so it is always waited for: a cancelled caller sees its
CancelledError only once every copy it started has finished.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar, cast

R = TypeVar("R")
S = TypeVar("S", bound=Sequence[Any])


# Without the compiled copy, a get's blocks smaller than this are copied in one thread, however
# many there are: per block, some microseconds of Python (slicing, the tag and hash calls) hold
# the GIL, and at 64 KiB two threads contending for it ran a get at 0.31-0.41x memcpy against
# 0.45-0.47x in one; at 256 KiB two threads won (11.0 against 8.9 GB/s), at 128 KiB one did,
# slightly (docs/performance.md). A put's fills are held to it, compiled or not: at 64 KiB two
# threads cost more CPU for no gain (the eighth stop: 35,000-43,000 blocks/s in one, 27,000-41,000
# in two; the eleventh, compiled: 0.175-0.188x memcpy in two against 0.188-0.194x in one).
SHARED_MIN_BLOCK = 256 << 10
# Where the copy is compiled (kvtier/shm/onepass.py), a get's share of a batch is one call with
# the GIL released, so small blocks no longer take turns at it: at 64 KiB two threads read at
# 0.68-0.74x memcpy against 0.47x in one (docs/performance.md, the eleventh stop).
SHARED_MIN_BLOCK_BATCHED = 64 << 10


def share_threads(threads: int, items: int, nbytes: int, min_block: int = SHARED_MIN_BLOCK) -> int:
    """Threads to share a copy of `items` blocks (`nbytes` in all) among: one for blocks under
    `min_block`."""
    return threads if items and nbytes // items >= min_block else 1


def default_copy_threads() -> int:
    """Copy threads when none are configured: a few, never more than the cores."""
    return min(4, os.cpu_count() or 1)


async def _finish(futs: Sequence[asyncio.Future[Any]]) -> None:
    """Every future done, a cancelled caller's included (its CancelledError comes after): a copy
    still running writes into memory its caller is about to reuse. Failures are the caller's to
    read from the futures."""
    cancelled = False
    for fut in futs:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                cancelled = True
            except BaseException:
                break  # this one failed: done
    if cancelled:
        raise asyncio.CancelledError


async def _gathered(futs: Sequence[asyncio.Future[Any]], n: int) -> list[Any]:
    """The results of `len(futs)` interleaved shares of `n` items, in the items' order, once every
    share has finished (the first failure raised then)."""
    await _finish(futs)
    k = len(futs)
    out: list[Any] = [None] * n
    for i, f in enumerate(futs):
        out[i::k] = f.result()
    return out


async def run_off_loop(executor: Executor | None, fn: Callable[..., R], *args: Any) -> R:
    """fn(*args) in a thread of `executor` (None: the loop's default), waited for even if cancelled."""
    fut = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    await _finish([fut])
    return fut.result()


async def map_shares(executor: Executor | None, fn: Callable[[S], list[R]], items: S, threads: int) -> list[R]:
    """fn over `threads` interleaved shares of `items` side by side; results in the items' order.
    fn(share) returns one result per item of its share. Every share is finished before this
    returns or raises (the first failure is raised then)."""
    k = max(1, min(threads, len(items)))
    # A slice of a list, tuple, range or array is of the same type; mypy only knows Sequence.
    shares = [cast(S, items[i::k]) for i in range(k)]
    loop = asyncio.get_running_loop()
    return await _gathered([loop.run_in_executor(executor, fn, share) for share in shares], len(items))


class CopyThreads(ThreadPoolExecutor):
    """A client's copy threads (the stdlib's pool: its threads end, joined, before the interpreter
    does). `map_shares` hands a share to a thread with one `submit`, and its result back with one
    `call_soon_threadsafe`: 49 us of CPU a hop here, where the module's `map_shares` (its futures
    chained to the loop's by `run_in_executor`, waited for then with `asyncio.wait`) took 61, about
    0.2 us a block on a put of 64 small blocks (docs/performance.md, the thirteenth stop)."""

    def __init__(self, threads: int) -> None:
        super().__init__(max(1, threads), thread_name_prefix="kvtier-copy")
        self.threads = max(1, threads)

    async def map_shares(self, fn: Callable[[S], list[R]], items: S, threads: int) -> list[R]:
        """The module's `map_shares` over these threads: fn over `threads` interleaved shares of
        `items`, results in the items' order, every share finished before this returns or raises
        (a cancelled caller's CancelledError included; the first failure is raised then)."""
        return await self.start_shares(fn, items, threads)

    def start_shares(self, fn: Callable[[S], list[R]], items: S, threads: int) -> Coroutine[Any, Any, list[R]]:
        """`map_shares`, its shares handed to the threads now: the caller may work meanwhile, then
        must await what this returns (it waits for every share, as `map_shares` does)."""
        k = max(1, min(threads, len(items), self.threads))
        shares = [cast(S, items[i::k]) for i in range(k)]
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[list[R]]] = [loop.create_future() for _ in shares]
        for share, fut in zip(shares, futs):
            self.submit(_run_share, fn, share, loop, fut)
        return _gathered(futs, len(items))


def _run_share(fn: Callable[[Any], Any], share: Any, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any]) -> None:
    """In a copy thread: fn(share), its result or failure handed back to the waiting loop."""
    try:
        res, err = fn(share), None
    except BaseException as e:  # handed to the waiter, whatever it is
        res, err = None, e

    def settle() -> None:
        if not fut.done():
            fut.set_exception(err) if err is not None else fut.set_result(res)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed meanwhile: nobody waits
        pass
