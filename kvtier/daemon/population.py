"""Populating the cpu arenas in the background, after READY.

Chosen over holding READY back with EXTEND_TIMEOUT_USEC: a node serves (with the part of the
arena populated so far) within about a second whatever the arena's size, rather than keeping
its engines waiting for minutes; and systemd's start timeout stays meaningful.

Each chunk's slow part (page allocation, faulting in, a warm restart's checksums) runs in a
thread; its result is applied on the event loop, in slot order, so the index keeps one writer.
How many chunks run at once is decided before each chunk: `populate_threads` while the daemon
serves (bus events handled within the last QUIET_S), which bounds the CPU it takes from serving;
`populate_threads_idle` (every core by default) while nothing uses the node's cache yet, the
usual case right after a boot, so that the arena is whole sooner. Progress goes to the
log (`arena.progress`, every 10%), to stats.json (`kvtier status`) and to the metrics.
A chunk that fails to populate (the mount filled up meanwhile) stops the population: the arena
serves with the slots it has, and says so (`arena.populate_failed`, state "failed").
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.config import ArenaConfig
from kvtier.core.index import Entry
from kvtier.errors import SegmentError
from kvtier.shm.numa import NumaBinder
from kvtier.tiers.arena_fill import ArenaFill, Prepared
from kvtier.tiers.pool import PoolRuntime

PROGRESS_STEPS = 10  # log lines per population
QUIET_S = 2.0  # a daemon that handled no bus event for this long is idle


def default_populate_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def populate_widths(cfg: ArenaConfig) -> tuple[int, int]:
    """Threads while serving, and while idle (at least as many), from [arena]; 0s are defaults."""
    threads = cfg.populate_threads or default_populate_threads()
    return threads, max(threads, cfg.populate_threads_idle or max(1, min(8, os.cpu_count() or 1)))


class Activity:
    """Whether the daemon serves: a counter of handled events (the bus's `delivered`) moved within
    the last `quiet_s`. Polled once a chunk, so a quiet spell is seen within one chunk's time."""

    def __init__(self, count: Callable[[], int], quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._count = count
        self._quiet_s = quiet_s
        self._clock = clock
        self._last = count()
        self._moved = -float("inf")  # no event seen yet: idle from the start

    def busy(self) -> bool:
        now, n = self._clock(), self._count()
        if n != self._last:
            self._last, self._moved = n, now
        return now - self._moved < self._quiet_s


class ArenaPopulation:
    """Brings one pool's remaining arena chunks into service."""

    def __init__(self, rt: PoolRuntime, cfg: ArenaConfig, log: Any,
                 on_restored: Callable[[str, list[Entry]], None] | None = None,
                 activity: Activity | None = None) -> None:
        """`activity`: whether the daemon serves (None: always, so never wider than populate_threads)."""
        assert rt.arena is not None
        self.rt = rt
        self.fill: ArenaFill = rt.arena
        self.threads, self.idle_threads = populate_widths(cfg)  # chunks at once while serving, and while idle
        self.activity = activity
        self.widest = 0  # the most chunks in flight at once (the `arena.populated` line)
        self.log = log.bind(pool=rt.name)
        self.on_restored = on_restored

    def width(self) -> int:
        """Chunks to have in flight now."""
        idle = self.activity is not None and not self.activity.busy()
        return self.idle_threads if idle else self.threads

    def _bind_thread(self) -> None:
        if self.fill.numa_node is not None:  # hugetlbfs allocates by the thread's own policy
            NumaBinder(self.fill.numa_node).bind_thread()

    async def run(self) -> None:
        fill = self.fill
        if not fill.chunks:
            return
        loop = asyncio.get_running_loop()
        total = fill.total_bytes
        self.log.info("arena.populating", bytes=total, populated_bytes=fill.populated_bytes, chunks=len(fill.chunks),
                      threads=self.threads, idle_threads=self.idle_threads, backing=fill.backing.describe,
                      numa_node=fill.numa_node)
        step = max(1, total // PROGRESS_STEPS)
        next_report = (fill.populated_bytes // step + 1) * step
        pool = ThreadPoolExecutor(self.idle_threads, thread_name_prefix=f"populate-{self.rt.name}",
                                  initializer=self._bind_thread)
        queue: list[asyncio.Future[Prepared]] = []  # in slot order; those not done are running
        try:
            while fill.chunks or queue:
                running, width = sum(not f.done() for f in queue), self.width()
                # A thread that finished a later chunk starts the next at once (the queue ahead
                # of the oldest is bounded): slots still come into service in slot order. None
                # starts once one has failed: the population stops there.
                failed = any(f.done() and not f.cancelled() and f.exception() is not None for f in queue)
                while fill.chunks and running < width and len(queue) < 4 * width and not failed:
                    fut = loop.run_in_executor(pool, fill.prepare, fill.chunks.pop(0))
                    fut.add_done_callback(_seen)
                    queue.append(fut)
                    running += 1
                self.widest = max(self.widest, running)
                if not queue[0].done():
                    await asyncio.wait([f for f in queue if not f.done()], return_when=asyncio.FIRST_COMPLETED)
                    continue
                prepared = queue.pop(0).result()  # the lowest slots first
                for restored in fill.apply(prepared, self.rt.placement):
                    if restored and self.on_restored is not None:
                        self.on_restored(self.rt.name, restored)
                    await asyncio.sleep(0)  # a warm chunk of small blocks restores thousands
                if fill.populated_bytes >= next_report and fill.chunks:
                    next_report += step
                    self.log.info("arena.progress", populated_bytes=fill.populated_bytes, bytes=total,
                                  percent=round(100 * fill.populated_bytes / total, 1),
                                  in_service=self.rt.cpu.index.capacity)
        except SegmentError as e:
            fill.chunks.clear()
            fill.done(str(e))
            self.log.error("arena.populate_failed", error=str(e), populated_bytes=fill.populated_bytes, bytes=total,
                           in_service=self.rt.cpu.index.capacity)
        else:
            fill.done()
            secs = (fill.finished or 0) - fill.started
            self.log.info("arena.populated", bytes=total, seconds=round(secs, 3),
                          s_per_gib=round(secs / (total / (1 << 30)), 3), kept=fill.kept, discarded=fill.discarded,
                          torn=fill.torn,
                          in_service=self.rt.cpu.index.capacity, widest=self.widest)
        finally:
            # A stop mid-population: the chunks running now finish first (a blocking wait of at
            # most one chunk's time), as the pool's mapping is closed after this.
            pool.shutdown(wait=True, cancel_futures=True)


def _seen(fut: asyncio.Future[Prepared]) -> None:
    """Mark a chunk's failure as retrieved: the population stops at the oldest failed chunk, and
    a later one's error, never applied, need not be logged by asyncio at exit as well."""
    if not fut.cancelled():
        fut.exception()
