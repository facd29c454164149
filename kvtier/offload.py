"""Block copies off the event loop, in threads (the compiled copy, numpy copies and preads release the GIL).

A copy that has started writes into memory its caller is about to reuse or free (a tier slot,
a staging slot, the caller's tensor), so it is always waited for: a cancelled caller sees its
CancelledError only once every copy it started has finished.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
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
    try:
        await asyncio.wait(futs)
    except asyncio.CancelledError:
        while not all(f.done() for f in futs):
            try:
                await asyncio.wait(futs)
            except asyncio.CancelledError:
                continue
        raise


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
    futs = [loop.run_in_executor(executor, fn, share) for share in shares]
    await _finish(futs)
    out: list[Any] = [None] * len(items)
    for i, f in enumerate(futs):
        out[i::k] = f.result()
    return out
