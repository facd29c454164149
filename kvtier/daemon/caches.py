"""The daemon's own bounded memory, beside the policy's (`pools.<pool>.caches`): what the
redelivery dedup, the tier workers' command fences and the consumers' outage ledgers hold, each
against its bound, for stats.json (`caches`) and the soak test (docs/operations.md, "What the
daemon keeps in memory")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.bus.consumer import Consumer
from kvtier.daemon.coordinator import Coordinator
from kvtier.tiers.worker import TierWorker


def daemon_caches(handlers: Mapping[str, Coordinator | TierWorker], consumers: Sequence[Consumer]
                  ) -> dict[str, dict[str, int]]:
    """`handlers` by role, in the order of the `consumers` that feed them."""
    out = {}
    for (role, h), c in zip(handlers.items(), consumers):
        out[f"{role}.applied"] = {"entries": len(h.applied), "bound": h.applied.capacity}
        if isinstance(h, TierWorker):
            out[f"{role}.fence"] = {"entries": len(h.fence), "bound": h.fence.capacity}
        out[f"{role}.outages"] = {"entries": len(c.outages), "bound": c.outages.cap}
    return out
