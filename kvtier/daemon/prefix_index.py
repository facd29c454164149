"""The daemon's side of the cluster prefix index (core/where.py): it records what its tiers hold.

The coordinator hands over each applied batch's facts; they are turned into HSET/EXPIRE/HDEL
commands and queued, and one task sends them to the blocks Redis in pipelines (per master on a
cluster), never holding up the bus. A chore re-writes every block the local tiers hold every
`refresh_s`, which renews the TTLs (an entry lives `ttl_s` past its last write). A Redis error
costs that batch of index updates (counted, logged); the refresh repairs it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.config import PrefixIndexConfig
from kvtier.core.events import Reason, Removed, Stored, Tier
from kvtier.core.where import index_commands
from kvtier.store.batches import batches_for

QUEUE_MAX = 1_000_000  # commands waiting; past it, updates are dropped (counted) until the refresh


class PrefixIndexWriter:
    def __init__(self, blocks_redis: Any, node: str, pools: dict[str, Any], cfg: PrefixIndexConfig, log: Any) -> None:
        self._batches = batches_for(blocks_redis)
        self.node = node
        self.pools = pools
        self.cfg = cfg
        self.log = log.bind(component="prefix_index")
        self._queue: collections.deque[tuple[object, ...]] = collections.deque()
        self._wake = asyncio.Event()
        self.written = 0
        self.dropped = 0
        self.failed = 0

    def on_facts(self, pool: str, facts: list[Stored | Removed]) -> None:
        # Local tiers only: readers ask Redis itself whether it holds a block (never stale).
        local = [f for f in facts if f.tier != Tier.REDIS]
        stored = [(f.key, f.tier.label) for f in local if isinstance(f, Stored)]
        removed = [(f.key, f.tier.label) for f in local if isinstance(f, Removed) and isinstance(f.why, Reason)]
        self.enqueue(index_commands(pool, self.node, stored, removed, self.cfg.ttl_s))

    def enqueue(self, cmds: list[tuple[object, ...]]) -> None:
        if len(self._queue) + len(cmds) > QUEUE_MAX:
            self.dropped += len(cmds)
            return
        self._queue.extend(cmds)
        self._wake.set()

    async def run(self) -> None:
        """Send what is queued, batch after batch, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                n = min(len(self._queue), self.cfg.batch_commands)
                cmds = [self._queue.popleft() for _ in range(n)]
                out = await self._batches.run(cmds)
                raise_if_cancelling()  # redis-py can swallow a cancel mid-command (bus/cancel.py)
                errors = [o for o in out if isinstance(o, Exception)]
                self.written += n - len(errors)
                if errors:
                    self.failed += len(errors)
                    self.log.warning("prefix_index.write_failed", commands=len(errors),
                                     error=f"{type(errors[0]).__name__}: {errors[0]}",
                                     detail=f"repaired by the next refresh (every {self.cfg.refresh_s:g} s)")

    def add_blocks(self, pool: str, tier_label: str, keys: list) -> None:
        """List blocks that appeared without a fact (a warm arena's, as they are restored)."""
        self.enqueue(index_commands(pool, self.node, [(k, tier_label) for k in keys], [], self.cfg.ttl_s))

    def refresh(self) -> None:
        """Re-write every block a local tier holds: renews the TTLs, repairs lost updates."""
        for name, rt in self.pools.items():
            for tier in (Tier.GPU, Tier.CPU, Tier.DISK):
                index = rt.placement.tiers.get(tier)
                if index is None:
                    continue
                self.enqueue(index_commands(name, self.node, [(e.key, tier.label) for e in index.ready()], [],
                                             self.cfg.ttl_s))

    def stats(self) -> dict[str, int]:
        return {"written": self.written, "dropped": self.dropped, "failed": self.failed, "queued": len(self._queue)}
