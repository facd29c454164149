"""The placement policy's knobs, as the core takes them (what each does: kvtier/core/policy.py,
shedding.py and promotion.py).

The operator sets them in config `[policy]` (kvtier/config/schema.py `PolicyConfig`), which
declares each one's check and default; the daemon builds these from that section knob by knob,
by name (kvtier/daemon/pools.py `policy_knobs`), so the defaults live in the config alone. Here
they get the types the core decides with: the policy's choices are enums, not strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.core.events import Tier


class RedisWrite(enum.Enum):
    """When blocks go to Redis (config `[policy] redis_write`)."""

    WRITE_BACK = "write-back"  # when the cpu tier sheds them
    WRITE_THROUGH = "write-through"  # as soon as they are stored locally


@dataclass(frozen=True, slots=True)
class PolicyKnobs:
    high_watermark: float
    low_watermark: float
    promote_after_hits: int
    prefetch_lease_s: float
    transfer_timeout_s: float
    redis_write: RedisWrite
    redis_admit_after_hits: int  # 0: every block may go to Redis
    prefetch_to: Tier
    promote_remote_after_reads: int  # 0: blocks read straight from Redis are never brought up
    disk_admit_after: int  # 0: every block cpu sheds goes to the disk tier (when the pool has one)
