"""A file squatting on a segment's name in /dev/shm, which no daemon may attach or replace."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SQUAT_BYTES = b"\0" * 65536


@contextmanager
def squatter(path: Path) -> Iterator[Path]:
    """Create `path` as a segment the daemon must refuse; removed on the way out."""
    path.write_bytes(SQUAT_BYTES)
    try:
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)  # root runs the suite: a segment owned by "nobody"
        else:
            path.chmod(0o666)  # one's own, but writable by anyone: refused just the same
        yield path
    finally:
        path.unlink(missing_ok=True)
