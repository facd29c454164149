"""Event-loop lag: how late a short sleep wakes up. A blocked loop stalls every worker, the
watchdog and the stats, so this is the first number to look at when the daemon seems slow.
The garbage collector's pauses stall it too: the collector is set for serving when `run` is
called (at the end of start-up, before the other chores: its one full collection then stalls
none of them), and its pauses are reported beside the lag (daemon/collector.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from kvtier.daemon.collector import Collector


class LoopLag:
    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.last_ms = 0.0
        self.max_ms = 0.0  # since start
        self.samples = 0
        self.collector = Collector()

    def run(self) -> Coroutine[Any, Any, None]:
        """Set the collector for serving now, and return the sampling loop to run as a chore."""
        self.collector.start()
        return self._sample()

    async def _sample(self) -> None:
        try:
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(self.interval_s)
                lag = max(0.0, (time.monotonic() - t0 - self.interval_s) * 1000)
                self.last_ms = lag
                self.max_ms = max(self.max_ms, lag)
                self.samples += 1
        finally:
            self.collector.stop()

    def as_dict(self) -> dict:
        return {"lag_ms": round(self.last_ms, 3), "lag_max_ms": round(self.max_ms, 3), "samples": self.samples,
                **self.collector.as_dict()}
