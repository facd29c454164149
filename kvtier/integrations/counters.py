"""Thread-safe counters for the engine integrations (no engine import), and the log throttle.

Engines call their storage backends from several threads (scheduler, prefetch, backup), and a
kvtier that is down must not turn every call into a log line.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvtier.logs import LogThrottle

__all__ = ["Counters", "LogThrottle"]


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
