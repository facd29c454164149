"""structlog setup: one JSON object per line on stdout (journald keeps it), or a console view.

Records from the stdlib `logging` module (redis-py logs that way) go through a
`ProcessorFormatter` on a root handler, so they come out in the same format as our own events.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Protocol, TextIO

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
FORMATS = ("auto", "json", "console")


class Log(Protocol):
    """What kvtier calls on a structlog logger, whichever wrapper class made it (the daemon's
    filtering logger, or the client library's stdlib-backed one): bind and log an event."""

    def bind(self, **new_values: Any) -> Log: ...
    def debug(self, event: str, **kw: Any) -> Any: ...
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...
    def error(self, event: str, **kw: Any) -> Any: ...
    def exception(self, event: str, **kw: Any) -> Any: ...


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the root handler that `configure_logging` owns, so a second call replaces it."""


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to `stream` (default: stdout) in one format.

    `fmt` "auto" picks the console renderer on a TTY and JSON otherwise. Calling this again
    replaces the previous setup instead of adding to it.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = sys.stdout if stream is None else stream
    console = fmt == "console" or (fmt == "auto" and _isatty(out))
    renderer: list[Any] = (
        [structlog.dev.ConsoleRenderer(colors=_isatty(out))] if console
        else [_exceptions_as_dicts(), structlog.processors.JSONRenderer()]
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]

    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        # Not cached: a reconfiguration (and structlog.testing.capture_logs in tests) must
        # reach loggers that modules created at import time. The lookup costs little at one
        # line per unit of work.
        cache_logger_on_first_use=False,
    )

    handler = _Handler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])


def _exceptions_as_dicts() -> Any:
    # Without locals: they would copy key bytes and buffers into the logs.
    transformer = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    return structlog.processors.ExceptionRenderer(transformer)


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LogThrottle:
    """At most one line per event name (and `per` value) per `every_s`: the first at once, then
    the lines skipped meanwhile are counted (`suppressed`) in the next one. For what would
    otherwise log on every call while something it needs is down: a client in an engine during a
    Redis outage, a tier worker whose every transfer fails. The log gets a line and a count, not a
    line per request. Thread-safe."""

    def __init__(self, log: Any, every_s: float = 5.0) -> None:
        self._log, self._every = log, every_s
        self._last: dict[tuple[str, object], float] = {}
        self._skipped: dict[tuple[str, object], tuple[str, int]] = {}  # -> (level, lines skipped)
        self._lock = threading.Lock()

    def _emit(self, level: str, event: str, per: object, kw: dict[str, Any]) -> None:
        now = time.monotonic()
        k = (event, per)
        with self._lock:
            if now - self._last.get(k, -1e9) < self._every:
                self._skipped[k] = (level, self._skipped.get(k, (level, 0))[1] + 1)
                return
            self._last[k] = now
            skipped = self._skipped.pop(k, (level, 0))[1]
        getattr(self._log, level)(event, suppressed=skipped, **kw)

    def info(self, event: str, *, per: object = None, **kw: Any) -> None:
        self._emit("info", event, per, kw)

    def warning(self, event: str, *, per: object = None, **kw: Any) -> None:
        self._emit("warning", event, per, kw)

    def error(self, event: str, *, per: object = None, **kw: Any) -> None:
        self._emit("error", event, per, kw)

    def flush(self) -> None:
        """Log the counts still held back (at close), one line per event."""
        with self._lock:
            skipped, self._skipped = self._skipped, {}
        for (event, _), (level, n) in skipped.items():
            getattr(self._log, level)(event, suppressed=n, note="lines held back since the last one")
