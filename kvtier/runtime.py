"""The runtime directory and the files the daemon publishes there.

- `kvtier.json`, the descriptor: tells clients how to reach the daemon (pools, segments, streams);
- `stats.json`: the counters `kvtier status` and the tools read;
- `daemon.lock`: held (flock) by the one daemon that owns the directory.

Both are written atomically (temp file + rename), so a reader never sees half of one, and are
JSON, not pickle: readers parse them with no code execution. The directory itself is resolved
here and only here (the daemon's default, and where clients and `kvtier status` look).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DESCRIPTOR = "kvtier.json"
STATS = "stats.json"
LOCK = "daemon.lock"  # flocked by the daemon that owns the directory (daemon/node.py)
RUNTIME_DIR_ENV = "KVTIER__NODE__RUNTIME_DIR"


def runtime_dir_for(explicit: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path:
    """The runtime directory a client or `kvtier status` looks in: the one given, else
    $KVTIER__NODE__RUNTIME_DIR, else the daemon's default."""
    return Path(explicit or environ.get(RUNTIME_DIR_ENV) or default_runtime_dir(environ))


def default_runtime_dir(environ: Mapping[str, str]) -> Path:
    """Where the daemon publishes its descriptor when [node] runtime_dir is not set."""
    if os.geteuid() == 0:
        return Path("/run/kvtier")
    if environ.get("XDG_RUNTIME_DIR", "").startswith("/"):  # the XDG spec ignores relative ones
        return Path(environ["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.geteuid()}")


def write_json_atomic(path: Path, obj: Mapping[str, Any], mode: int = 0o640) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return obj
