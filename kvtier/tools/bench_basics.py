"""What every `kvtier bench` module shares: the block layouts, the run's sizes, progress lines on
stderr, best-of timing, and the memcpy bound the local paths are measured against."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

LLAMA = dict(model="llama3-8b", layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")
TINY = dict(model="bench-tiny", layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")
GB = 1e9


def say(msg: str) -> None:
    print(f"kvtier bench: {msg}", file=sys.stderr, flush=True)


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Best of `repeat` timings of fn(), in seconds: the least disturbed by the neighbours."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    """The bound: one memcpy of all the bytes, best of `repeat`."""
    return memcpy_gbps_by_block(nbytes, repeat, 0)[0]


def memcpy_gbps_by_block(nbytes: int, repeat: int, block: int) -> tuple[float, float | None]:
    """The bound, and (`block` > 0) the same bytes copied a block at a time, over one pair of
    buffers: a reference, not a bound. glibc copies with non-temporal stores only from its
    `x86_non_temporal_threshold` (190 MiB on a host with a 480 MiB L3), so there one call can
    run near twice as fast as any block-sized copy (docs/performance.md, the ninth stop)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    whole = nbytes / best_time(lambda: np.copyto(dst, src), repeat) / GB
    if not block:
        return whole, None
    rows, d = src.reshape(-1, block), dst.reshape(-1, block)

    def by_block() -> None:
        for i in range(len(rows)):
            np.copyto(d[i], rows[i])
    return whole, nbytes / best_time(by_block, repeat) / GB


def sizes(args, least: int) -> tuple[dict, int, int, int]:
    """The layout, block bytes, block count (`--gib` of them, at least `least`) and repeats."""
    from kvtier.layout import BlockLayout

    layout = TINY if args.quick else LLAMA
    bb = BlockLayout(**layout).block_bytes
    n = least if args.quick else max(least, int(args.gib * (1 << 30)) // bb)
    return layout, bb, n, 1 if args.quick else 3
