"""Python's garbage collector, set for a daemon that holds a large, long-lived index.

With the default thresholds a full collection runs each time the objects that survived grow by
a quarter, and it walks every object the process holds: the imported libraries (torch alone is
hundreds of thousands) and every block the index lists. During a sustained 64 KiB put into a
32,768-block arena that was 20-30 % of the daemon's CPU, in stalls of 40-75 ms of the event
loop (docs/performance.md). So once start-up is done, what it built (modules, a warm restart's
index) is frozen out of collections for good; it is still freed by reference counting as
usual. And the youngest generation is collected every YOUNG allocations rather than 700: the
daemon's short-lived objects (events, outcomes) die by reference count long before that, so
the collections left are fewer and each no longer. Each collection is timed, per generation,
for the stats and the metrics.
"""

from __future__ import annotations

import gc
import time
from typing import Any

YOUNG = 10_000  # measured: 700 gave 4 full collections in a 32,768-block put, 10,000 none; 50,000 made young ones slow


class Collector:
    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation, since start
        self.seconds = [0.0, 0.0, 0.0]
        self.pause_max_s = 0.0
        self._t0 = 0.0
        self.frozen = 0  # objects start-up left, frozen (counted once: gc.get_freeze_count() walks them all)
        self._before: tuple[int, int, int] | None = None

    def start(self, young: int = YOUNG) -> None:
        """Freeze what start-up built, collect the young generation every `young` allocations,
        and time every collection from now on."""
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self._before = gc.get_threshold()
        gc.set_threshold(young, *self._before[1:])
        gc.callbacks.append(self._timed)

    def stop(self) -> None:
        """Back as it was (a daemon run inside a test process leaves that process's collector
        as it found it)."""
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        if self._before is not None:
            gc.set_threshold(*self._before)
            gc.unfreeze()
            self._before = None

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        g = info["generation"]
        self.collections[g] += 1
        self.seconds[g] += took
        self.pause_max_s = max(self.pause_max_s, took)

    def as_dict(self) -> dict[str, Any]:
        return {"gc_collections": list(self.collections), "gc_s": [round(s, 4) for s in self.seconds],
                "gc_pause_max_ms": round(self.pause_max_s * 1000, 3), "gc_frozen": self.frozen}
