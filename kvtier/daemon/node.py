"""What makes a daemon the one for its node: the node lock, the runtime directory, the descriptor."""

from __future__ import annotations

import contextlib
import grp
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.runtime import DESCRIPTOR, write_json_atomic


def ensure_runtime_dir(path: Path) -> None:
    path.mkdir(mode=0o750, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        # Someone else made it (e.g. pre-created /tmp/kvtier-<uid>): clients would trust it.
        raise KvtierError(f"runtime directory {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
    if st.st_mode & 0o027:
        path.chmod(0o750)  # never writable by the group or open to others


def shm_gid(group: str | None) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid if group else None
    except KeyError:
        raise KvtierError(f"node.shm_group: no group named {group!r}") from None


@contextlib.contextmanager
def node_lock(node: str) -> Iterator[None]:
    """One live daemon per node id: its segments' names carry the id, so a second daemon would
    replace the first one's segments under its clients. An abstract unix socket is the lock:
    the kernel releases it when we die, and it leaves no file behind in /dev/shm."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.bind(f"\0kvtier.{node}.lock")
        except OSError:
            raise KvtierError(f"another kvtier daemon is running with node id {node!r}") from None
        yield
    finally:
        sock.close()


@contextlib.contextmanager
def descriptor(runtime_dir: Path, desc: dict[str, Any]) -> Iterator[Path]:
    """Published for clients while the block runs; withdrawn first thing at the stop."""
    path = runtime_dir / DESCRIPTOR
    try:
        write_json_atomic(path, desc)
        yield path
    finally:
        path.unlink(missing_ok=True)
