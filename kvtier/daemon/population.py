"""Populating the cpu arenas in the background, after READY.

Chosen over holding READY back with EXTEND_TIMEOUT_USEC: a node serves (with the part of the
arena populated so far) within about a second whatever the arena's size, rather than keeping
its engines waiting for minutes; and systemd's start timeout stays meaningful.

Each chunk's slow part (page allocation, faulting in, a warm restart's checksums) runs in one of
`populate_threads` threads, which bounds the CPU it takes from the serving daemon; its result is
applied on the event loop, in slot order, so the index keeps one writer. Progress goes to the
log (`arena.progress`, every 10%), to stats.json (`kvtier status`) and to the metrics.
A chunk that fails to populate (the mount filled up meanwhile) stops the population: the arena
serves with the slots it has, and says so (`arena.populate_failed`, state "failed").
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.core.index import Entry
from kvtier.errors import SegmentError
from kvtier.shm.numa import NumaBinder
from kvtier.tiers.arena_fill import ArenaFill, Prepared
from kvtier.tiers.pool import PoolRuntime

PROGRESS_STEPS = 10  # log lines per population


def default_populate_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 4))


class ArenaPopulation:
    """Brings one pool's remaining arena chunks into service."""

    def __init__(self, rt: PoolRuntime, threads: int, log: Any,
                 on_restored: Callable[[str, list[Entry]], None] | None = None) -> None:
        assert rt.arena is not None
        self.rt = rt
        self.fill: ArenaFill = rt.arena
        self.threads = threads
        self.log = log.bind(pool=rt.name)
        self.on_restored = on_restored

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
                      threads=self.threads, backing=fill.backing.describe, numa_node=fill.numa_node)
        step = max(1, total // PROGRESS_STEPS)
        next_report = (fill.populated_bytes // step + 1) * step
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"populate-{self.rt.name}",
                                  initializer=self._bind_thread)
        inflight: list[asyncio.Future[Prepared]] = []
        try:
            while fill.chunks or inflight:
                while fill.chunks and len(inflight) < self.threads:
                    inflight.append(loop.run_in_executor(pool, fill.prepare, fill.chunks.pop(0)))
                prepared = await inflight.pop(0)  # in slot order: the lowest slots come first
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
                          in_service=self.rt.cpu.index.capacity)
        finally:
            # A stop mid-population: the chunks running now finish first (a blocking wait of at
            # most one chunk's time), as the pool's mapping is closed after this.
            pool.shutdown(wait=True, cancel_futures=True)
