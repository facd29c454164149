"""What a KvtierConnector logs about itself in an engine's log: each half's count line, written
as it shuts down. vLLM's `num_cached_tokens` counts what the connector promised at scheduling,
even when the load then fails and vLLM recomputes; the worker's `loaded_blocks` and
`load_failed_blocks` say which happened. For the engine tests and `kvtier bench --vllm`."""

from __future__ import annotations

import re
from pathlib import Path


def connector_count_lines(log: str, half: str = "worker") -> list[dict[str, int]]:
    """Each count line a connector half ("worker": one a rank; "scheduler") logged, in order; a
    half that counted nothing logs an empty line ({})."""
    line = re.compile(rf"kvtier: {half}((?: \w+=\d+)*)\s*$")
    return [{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
            for m in map(line.search, log.splitlines()) if m]


def worker_loads(log: Path) -> dict[str, int] | None:
    """What an engine's connector worker loaded in all, and failed to load (then recomputed), from
    its log once it has stopped; None without such a line."""
    lines = connector_count_lines(log.read_text(errors="replace")) if log.exists() else []
    return {k: lines[-1].get(k, 0) for k in ("loaded_blocks", "load_failed_blocks")} if lines else None
