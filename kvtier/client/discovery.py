"""How a client finds its node's daemon, and how the client library logs."""

from __future__ import annotations

import logging
from pathlib import Path

import structlog

from kvtier.descriptor import Descriptor
from kvtier.errors import DaemonUnavailable
from kvtier.logs import Log
from kvtier.runtime import DESCRIPTOR, read_json


def read_descriptor(rdir: Path) -> tuple[Descriptor, int]:
    """The daemon's descriptor and the uid that owns it, from a directory only that uid controls.
    A runtime directory another user could write (say a pre-created /tmp/kvtier-<uid>) could
    point us at segments and a Redis full of forged blocks, so it is refused. DescriptorError for
    a descriptor of another kvtier release, or a malformed one."""
    path = rdir / DESCRIPTOR
    try:
        dst = rdir.stat()
        fst = path.stat()
        raw = read_json(path)
    except (OSError, ValueError) as e:
        raise DaemonUnavailable(f"no kvtier daemon descriptor at {path}: {e}") from e
    if dst.st_mode & 0o022 or fst.st_mode & 0o022 or fst.st_uid != dst.st_uid:
        raise DaemonUnavailable(f"{path} or its directory is writable by others, or owned by another user; refusing")
    return Descriptor.from_json(raw), fst.st_uid


def library_logger() -> Log:
    """The client library's logger. If the application configured structlog, log through it;
    otherwise through stdlib logging, which prints only warnings and errors (to stderr) unless
    the application sets logging up: a library must not write to an inference worker's stdout."""
    log: Log  # structlog types the loggers it makes as Any: whatever wrapper class is configured
    if structlog.is_configured():
        log = structlog.get_logger("kvtier.client")
        return log
    log = structlog.wrap_logger(
        logging.getLogger("kvtier.client"),
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.KeyValueRenderer(key_order=["event", "level", "timestamp"])],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return log
