"""Which blocks the cpu tier sheds are worth a disk write. Pure: no I/O.

A disk write costs device bandwidth and wears the device; a block read once and never again does
not repay it. So with `admit_after = N > 0` a block shed from cpu is admitted to disk when it was
read at least N times, or when its parent was (the prefix is hot: its later blocks are read
with it even if this one has not been yet). `admit_after = 0` admits every block. Each decision
has a reason, and the daemon counts them (`kvtier_disk_admissions_total{reason}`).
"""

from __future__ import annotations

import enum
from collections import Counter


class DiskAdmit(enum.StrEnum):
    ALL = "all"  # admit_after = 0
    REUSED = "reused"  # read admit_after times
    HOT_PREFIX = "hot_prefix"  # its parent was read admit_after times
    COLD = "cold"  # refused: neither

    @property
    def admitted(self) -> bool:
        return self is not DiskAdmit.COLD


def disk_admission(admit_after: int, hits: int, parent_hits: int | None) -> DiskAdmit:
    """The verdict for one block: its reads, and its parent's (None: a chain head, or a parent no
    local tier holds any more)."""
    if admit_after <= 0:
        return DiskAdmit.ALL
    if hits >= admit_after:
        return DiskAdmit.REUSED
    if parent_hits is not None and parent_hits >= admit_after:
        return DiskAdmit.HOT_PREFIX
    return DiskAdmit.COLD


class AdmissionCounts:
    """How many blocks each reason admitted or refused, for stats and metrics."""

    def __init__(self) -> None:
        self.counts: Counter[DiskAdmit] = Counter()

    def decide(self, admit_after: int, hits: int, parent_hits: int | None) -> bool:
        verdict = disk_admission(admit_after, hits, parent_hits)
        self.counts[verdict] += 1
        return verdict.admitted

    def snapshot(self) -> dict[str, int]:
        return {r.value: self.counts[r] for r in DiskAdmit}
