"""What makes a daemon the one for its node: the node lock, the runtime directory, the descriptor."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.runtime import DESCRIPTOR, LOCK, read_json, write_json_atomic


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
def runtime_dir_lock(path: Path, node: str) -> Iterator[None]:
    """One daemon per runtime directory, whatever its node id: two would overwrite each other's
    descriptor and stats, share one embedded Redis socket, and the first to stop would delete the
    descriptor the other's clients need. An flock on `daemon.lock`, held for the daemon's life
    and released by the kernel when it dies; the file names the holder, for the error. The
    file is left in place: unlinking a lock file races with the next daemon taking it."""
    lock = path / LOCK
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            raise KvtierError(f"another kvtier daemon ({holder}) holds the runtime directory {path}; give each daemon "
                              f"its own [node] runtime_dir (KVTIER__NODE__RUNTIME_DIR)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, node {node}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def descriptor(runtime_dir: Path, desc: dict[str, Any]) -> Iterator[Path]:
    """Published for clients while the block runs; withdrawn first thing at the stop, and only
    if it is still ours (never another daemon's descriptor)."""
    path = runtime_dir / DESCRIPTOR
    try:
        write_json_atomic(path, desc)
        yield path
    finally:
        with contextlib.suppress(OSError, ValueError):
            now = read_json(path)
            if (now.get("pid"), now.get("epoch")) == (desc["pid"], desc["epoch"]):
                path.unlink()
