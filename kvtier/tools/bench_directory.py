"""`kvtier bench`'s directory row: a lookup in the shared-memory directory clients probe, with a
million blocks indexed against a thousand (target: at most 1.5x)."""

from __future__ import annotations

import hashlib
import uuid

from kvtier.tools.bench_basics import best_time


def directory_row(repeat: int, out: dict) -> None:
    """Lookup of 500 resident keys with 1M blocks indexed, against 1k (the shm directory clients probe)."""
    from kvtier.shm.directory import DirectoryWriter, directory_bytes, directory_capacity
    from kvtier.shm.segment import ShmSegment

    probe = [hashlib.sha256(b"p" + i.to_bytes(4, "little")).digest() for i in range(500)]
    times = {}
    for n in (1_000, 1_000_000):
        cap = directory_capacity(n)
        seg = ShmSegment.create(f"kvtier.bench-{uuid.uuid4().hex[:8]}.dir", directory_bytes(cap))
        try:
            d = DirectoryWriter.create(seg, cap, b"\0" * 32)
            for i in range(n - len(probe)):
                d.set_slot(hashlib.sha256(i.to_bytes(4, "little")).digest(), 1, i % 1024)
            for i, k in enumerate(probe):
                d.set_slot(k, 1, i)
            times[n] = best_time(lambda d=d: [d.find(k) for k in probe], repeat * 3)
        finally:
            seg.unlink()
    out["directory"] = {"ratio": times[1_000_000] / times[1_000],
                        "us_per_probe_1m": times[1_000_000] / len(probe) * 1e6}
