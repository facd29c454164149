"""Which models' KV each pool holds, for stats.json and `kvtier status`: the pools' manifests
(core/manifest.py), read from the bus Redis every `[daemon] manifest_interval_s`.

The integrations write the manifest; the daemon only reads it. Entries are untrusted bytes from
Redis: core/manifest.py drops the malformed ones, and they are counted here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.core.manifest import holdings, manifest_key, stored_key
from kvtier.logs import Log, LogThrottle

MODELS_SHOWN = 20  # per pool, the largest by bytes stored


class ManifestReader:
    def __init__(self, bus: AsyncRedis, pools: Iterable[str], interval_s: float, log: Log) -> None:
        self.bus = bus
        self.pools = list(pools)
        self.interval_s = interval_s
        self.quiet = LogThrottle(log)
        self.models: dict[str, dict[str, Any]] = {}  # per pool: what status shows
        self.errors = 0

    async def run(self) -> None:
        """Refresh every `interval_s` until cancelled. redis-py can swallow a cancel that lands
        mid-command (bus/cancel.py): then the loop went on to its sleep, and a daemon's stop
        waited out its chore budget and left this chore behind (seen under load). Hence the
        check after each round trip."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def refresh(self) -> None:
        for pool in self.pools:
            try:
                entries = await self.bus.hgetall(manifest_key(pool))
                stored = await self.bus.hgetall(stored_key(pool))
            except REDIS_ERRORS as e:  # the last answer stands; status says how old it is
                self.errors += 1
                self.quiet.warning("daemon.manifest_unreadable", pool=pool, error=f"{type(e).__name__}: {e}")
                continue
            finally:
                raise_if_cancelling()  # after each pool's round trips, failed ones included
            held, malformed = holdings(entries, stored)
            self.models[pool] = {
                "namespaces": len(held),
                "malformed": malformed,
                "models": [{**asdict(h.entry), "stored_blocks": h.stored_blocks, "stored_bytes": h.stored_bytes}
                           for h in held[:MODELS_SHOWN]],
            }

    def snapshot(self, pool: str) -> dict[str, Any] | None:
        """The pool's models as last read (None before the first answer)."""
        return self.models.get(pool)
