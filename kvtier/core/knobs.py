"""The placement policy's knobs (config `[policy]`, documented in kvtier/core/policy.py)."""

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
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    promote_after_hits: int = 2
    prefetch_lease_s: float = 5.0
    transfer_timeout_s: float = 30.0
    redis_write: RedisWrite = RedisWrite.WRITE_BACK
    redis_admit_after_hits: int = 0  # 0: every block may go to Redis
    prefetch_to: Tier = Tier.CPU
    promote_remote_after_reads: int = 1  # 0: blocks read straight from Redis are never brought up
