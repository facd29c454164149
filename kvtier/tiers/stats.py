"""Counters the daemon keeps per pool and tier. Plain per-instance dataclasses: no globals."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.core.outcomes import Count

# Upper bounds of the transfer-latency histogram buckets, in seconds.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0  # blocks clients read from this tier
    stored: int = 0  # new blocks admitted from clients
    promoted_in: int = 0  # blocks copied up into this tier
    demoted_in: int = 0  # blocks written back into this tier
    copied_in: int = 0  # blocks written through into this tier (copies; the source keeps its own)
    evicted: int = 0  # blocks dropped from this tier
    bytes_in: int = 0  # payload bytes written into this tier
    failed: int = 0  # transfers into this tier that did not complete (counted misses)
    refused: int = 0  # evictions refused because no lower tier held the block
    stale: int = 0  # commands skipped as late or redelivered (fenced, or no longer chosen)
    transfers: int = 0  # completed stores, promotions and demotions into this tier
    transfer_s: float = 0.0  # their total time, from command receipt to visible
    transfer_max_s: float = 0.0
    # Transfer times per bucket of LATENCY_BUCKETS_S (the last: slower than all of them).
    transfer_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def add(self, what: Count, n: int = 1) -> None:
        """n more of what an outcome counts (kvtier/core/outcomes.py: each Count names a field)."""
        setattr(self, what.value, getattr(self, what.value) + n)

    def timed(self, seconds: float, n: int = 1) -> None:
        """n transfers that took `seconds` each (a batch's blocks, made visible together)."""
        self.transfers += n
        self.transfer_s += n * seconds
        self.transfer_max_s = max(self.transfer_max_s, seconds)
        self.transfer_buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += n


@dataclass(slots=True)
class PoolCounters:
    hits: int = 0  # blocks clients read (their tier is counted per tier when still known)
    misses: int = 0  # blocks clients asked for past their hit prefix
    puts: int = 0  # blocks clients handed over
    puts_dropped: int = 0  # of those, dropped for want of room or bad staging
    # Blocks clients could not hand over at all (staging full, the bus down): counted by the
    # clients in their staging segments, collected by the staging reaper.
    client_puts_dropped: int = 0
    granted_puts: int = 0  # of the puts, blocks clients wrote into granted cpu slots themselves (one pass)
    grants_reclaimed: int = 0  # granted cpu slots taken back unused: client gone, expired, a duplicate, a bad header
    remote_reads: int = 0  # blocks clients read straight from Redis (read-through)
    resync_missing: int = 0  # local blocks the re-replication sweep found missing in Redis
    resync_copies: int = 0  # of those, copied to Redis again (write-through)
    pins_retained: int = 0  # Redis copies of session-pinned blocks whose time to live was lengthened (asked)
    pin_retain_errors: int = 0  # ... where Redis failed the ask (the copy may expire before the pin)
    tiers: dict[str, TierCounters] = field(
        default_factory=lambda: {t: TierCounters() for t in ("gpu", "cpu", "disk", "redis")}
    )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
