"""Shared-memory segments made for a test, each closed and unlinked after it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvtier.shm.segment import ShmSegment


@contextmanager
def segment_factory(prefix: str) -> Iterator[Callable[..., ShmSegment]]:
    """make(size, suffix="", **kw): a segment named `prefix` + a unique part + `suffix`; every
    one made is closed and unlinked on leaving."""
    made: list[ShmSegment] = []

    def make(size: int, suffix: str = "", **kw) -> ShmSegment:
        seg = ShmSegment.create(f"{prefix}{uuid.uuid4().hex[:6]}{suffix}", size, **kw)
        made.append(seg)
        return seg

    try:
        yield make
    finally:
        for seg in made:
            seg.close()
            seg.unlink()
