"""The descriptor: a JSON file in the runtime directory that tells clients how to reach the daemon.

Written atomically (temp file + rename) so a client never reads half of it. JSON, not pickle:
clients parse it with no code execution.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DESCRIPTOR = "kvtier.json"
STATS = "stats.json"
FORMAT_VERSION = 1


def write_json_atomic(path: Path, obj: dict, mode: int = 0o640) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return obj
