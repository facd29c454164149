"""Placements for the policy's unit tests: small tier indices and blocks named by number."""

from __future__ import annotations

from dataclasses import replace

from kvtier.config import PolicyConfig
from kvtier.core.events import Tier
from kvtier.core.index import TierIndex
from kvtier.core.knobs import PolicyKnobs
from kvtier.core.policy import Placement
from kvtier.daemon.pools import policy_knobs
from kvtier.keys import BlockKey

POOL = "llama-8b"
NOW = 1000.0  # the policy never reads the clock; tests pass time in
TIMEOUT = 30.0  # [policy] transfer_timeout_s default


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "big"))


def knobs(**changed) -> PolicyKnobs:
    """The daemon's knobs for the default `[policy]`, with `changed` ones (in the core's types)."""
    return replace(policy_knobs(PolicyConfig()), **changed)


def placement(gpu: int = 10, cpu: int = 10, disk: int = 0, **changed) -> Placement:
    tiers = {Tier.GPU: TierIndex(gpu), Tier.CPU: TierIndex(cpu), Tier.DISK: TierIndex(disk),
             Tier.REDIS: TierIndex(None)}
    return Placement(POOL, tiers, knobs(**changed))


def put(p: Placement, tier: Tier, ids, chain: bool = False) -> None:
    """Add READY blocks to `tier`, oldest first; as one chain when `chain`."""
    parent = None
    for i in ids:
        assert p.tiers[tier].add(k(i), parent if chain else None) is not None
        parent = k(i)
