"""configure_logging: structlog events and stdlib records come out as the same JSON lines."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from kvtier.logs import configure_logging


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_structlog_and_stdlib_records_are_json() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    structlog.get_logger().info("block_stored", pool="llama", tier="cpu")
    logging.getLogger("redis").warning("connection %s lost", "r1")

    ours, theirs = lines(out)
    assert ours["event"] == "block_stored" and ours["pool"] == "llama"
    assert theirs["event"] == "connection r1 lost" and theirs["logger"] == "redis"
    for record, level in ((ours, "info"), (theirs, "warning")):
        assert record["level"] == level
        assert record["timestamp"].endswith("Z")


def test_level_filters_both_paths() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    structlog.get_logger().info("dropped")
    logging.getLogger("redis").info("dropped too")
    structlog.get_logger().error("kept")
    assert [r["event"] for r in lines(out)] == ["kept"]


def test_bound_context_and_exceptions() -> None:
    out = io.StringIO()
    configure_logging("info", "auto", stream=out)  # not a TTY: JSON
    structlog.contextvars.bind_contextvars(node="n1")
    try:
        try:
            raise RuntimeError("nope")
        except RuntimeError:
            structlog.get_logger().exception("transfer_failed")
    finally:
        structlog.contextvars.clear_contextvars()
    (record,) = lines(out)
    assert record["node"] == "n1"
    assert record["exception"][0]["exc_type"] == "RuntimeError"
    assert "locals" not in record["exception"][0]["frames"][0]


def test_idempotent() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    configure_logging("info", "json", stream=out)
    logging.getLogger("redis").warning("once")
    assert len(lines(out)) == 1


def test_console_on_tty() -> None:
    out = _Tty()
    configure_logging("info", "auto", stream=out)
    structlog.get_logger().info("hello", answer=42)
    text = out.getvalue()
    assert "hello" in text and "answer" in text and not text.startswith("{")


def test_rejects_unknown_level_and_format() -> None:
    with pytest.raises(ValueError):
        configure_logging("verbose")
    with pytest.raises(ValueError):
        configure_logging("info", "xml")
