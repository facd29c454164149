"""Trimming what every consumer group has read: the floor below which a stream's entries may go.

XADD's MAXLEN caps a stream by count only, so a busy node's streams sit at their cap, and at
about 840 bytes an entry five full streams take some 400 MB of the Redis that also holds the
blocks (and streams carry no TTL, so `volatile-lru` evicts blocks, never them). The bus is a
queue, not a log: once every group has been handed an entry and none holds it pending, the
entry is history, kept only `keep_ms` for whoever inspects the stream. Age is measured from the
newest entry handed to any group (ids are the server's milliseconds), not from a clock: no
clock skew to mind, and no TIME command, which a cluster pipeline refuses. Pure: the sampler
(kvtier/daemon/sampler.py) asks Redis and sends the XTRIM MINID.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

EntryId = tuple[int, int]  # "ms-seq", as a pair that orders as Redis orders ids


def entry_id(raw: bytes | str) -> EntryId:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, slots=True)
class GroupMark:
    """Where one consumer group stands on a stream: the last entry handed to it, and the
    oldest it holds unacked (None: none pending)."""

    delivered: EntryId
    oldest_pending: EntryId | None = None


def trim_floor(keep_ms: int, groups: Iterable[GroupMark]) -> str | None:
    """The MINID for XTRIM: entries below it were handed to every group, acked by all, and are
    more than `keep_ms` older than the newest entry any group was handed. None when no group
    reads the stream: nothing is known to be read, so only MAXLEN bounds it."""
    marks = list(groups)
    if not marks:
        return None
    floor: EntryId = (max(0, max(g.delivered for g in marks)[0] - keep_ms), 0)
    for g in marks:
        floor = min(floor, g.delivered, g.oldest_pending or g.delivered)
    return None if floor == (0, 0) else f"{floor[0]}-{floor[1]}"
