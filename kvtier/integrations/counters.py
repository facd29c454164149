"""Thread-safe counters and a log throttle for the engine integrations (no engine import).

Engines call their storage backends from several threads (scheduler, prefetch, backup), and a
kvtier that is down must not turn every call into a log line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any


class Counters:
    """Monotonic counters by name (the subclass or the caller names them; others are refused)."""

    NAMES: tuple[str, ...] = ()

    def __init__(self, names: Iterable[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES if names is None else tuple(names), 0)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class LogThrottle:
    """At most one log line per event name per `every_s`; the lines skipped are counted in the next."""

    def __init__(self, log: Any, every_s: float = 5.0) -> None:
        self._log, self._every = log, every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def _emit(self, level: str, event: str, **kw: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(event, -1e9) < self._every:
                self._skipped[event] = self._skipped.get(event, 0) + 1
                return
            self._last[event] = now
            skipped = self._skipped.pop(event, 0)
        getattr(self._log, level)(event, suppressed=skipped, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, **kw)
