"""Everything the workers need about one pool: its layout, tiers, directory, policy and counters."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.events import Tier
from kvtier.tiers.stats import PoolCounters
from kvtier.layout import BlockLayout
from kvtier.shm.directory import DirectoryWriter
from kvtier.tiers.local import LocalTier
from kvtier.core.policy import Placement
from kvtier.store.redis_blocks import RedisBlocks


@dataclass(slots=True)
class PoolRuntime:
    name: str
    layout: BlockLayout
    gpu: LocalTier | None
    cpu: LocalTier
    redis: RedisBlocks
    directory: DirectoryWriter
    placement: Placement
    counters: PoolCounters
    gpu_ipc: dict | None = None

    @property
    def local_blocks(self) -> int:
        return self.cpu.capacity + (self.gpu.capacity if self.gpu is not None else 0)

    def local(self, tier: Tier) -> LocalTier | None:
        return self.gpu if tier == Tier.GPU else self.cpu if tier == Tier.CPU else None

    def descriptor(self) -> dict:
        def part(t: LocalTier | None) -> dict | None:
            if t is None:
                return None
            return {"segment": t.table.seg.name, "capacity": t.capacity}

        gpu = part(self.gpu)
        if gpu is not None:
            gpu["device"] = "cpu" if self.gpu_ipc is None else "cuda"
            gpu["ipc"] = self.gpu_ipc
        return {
            "layout": self.layout.to_dict(),
            "fingerprint": self.layout.fingerprint.hex(),
            "block_bytes": self.layout.block_bytes,
            "gpu": gpu,
            "cpu": part(self.cpu),
            "directory": {"segment": self.directory.seg.name, "capacity": self.directory.capacity},
        }
