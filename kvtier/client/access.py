"""Read reports: which blocks a client read, batched for a few milliseconds and sent to the
daemon in one round trip. They only steer its LRU and promotions, so one that is lost costs
accuracy, not data (counted in ClientStats.event_errors)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.publisher import Publisher
from kvtier.client.results import ClientStats
from kvtier.core.events import Access, RemoteRead
from kvtier.keys import BlockKey
from kvtier.logs import LogThrottle

ACCESS_FLUSH_S = 0.02


class AccessReports:
    """The client's pending read reports, per pool, and the task that sends them."""

    def __init__(self, publisher: Publisher, stream: str, stats: ClientStats, quiet: LogThrottle) -> None:
        self._publisher = publisher
        self._stream = stream
        self._stats = stats
        self._quiet = quiet
        self._access: dict[str, tuple[list[BlockKey], list[int]]] = {}
        self._remote: list[RemoteRead] = []  # chains read straight from Redis
        self._flusher: asyncio.Task[None] | None = None
        self._sending: asyncio.Event | None = None  # set while no flush is publishing

    def note(self, pool: str, keys: Sequence[BlockKey], missed: int) -> None:
        got, miss = self._access.setdefault(pool, ([], [0]))
        got.extend(keys)
        miss[0] += missed
        self._flush_soon()

    def note_remote(self, pool: str, keys: Sequence[BlockKey], head_parent: BlockKey | None) -> None:
        """A chain read straight from Redis: the daemon may bring it up (core/policy.py)."""
        self._remote.append(RemoteRead(pool, tuple(keys), head_parent))
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(ACCESS_FLUSH_S)  # batch the reads of the next few milliseconds
        await self.flush()

    async def take_in_order(self) -> list[tuple[str, Access | RemoteRead]]:
        """`take`, once any flush already publishing has landed: the reports then go ahead of
        the caller's next event in order, whichever connection each travels on."""
        if self._sending is not None:
            await self._sending.wait()
        return self.take()

    def take(self) -> list[tuple[str, Access | RemoteRead]]:
        """The pending reports, taken to be sent now: by `flush`, or ahead of a prefetch in the
        same round trip, so that the daemon learns of these reads (which end their blocks'
        prefetch leases) before the new prefetch asks for leases of its own."""
        batches, self._access = self._access, {}
        remote, self._remote = self._remote, []
        items: list[tuple[str, Access | RemoteRead]] = [
            (self._stream, Access(pool, tuple(keys), miss[0])) for pool, (keys, miss) in batches.items()
            if keys or miss[0]]
        return items + [(self._stream, r) for r in remote]

    def lost(self, error: Exception) -> None:
        # Access reports only steer the LRU: losing one costs accuracy, not data. Counted.
        self._stats.event_errors += 1
        self._quiet.warning("client.access_report_failed", error=str(error))

    async def flush(self) -> None:
        items = self.take()
        if not items:
            return
        if self._sending is None:
            self._sending = asyncio.Event()
            self._sending.set()
        self._sending.clear()
        try:
            await self._publisher.publish_many(items)
        except REDIS_ERRORS as e:
            self.lost(e)
        finally:
            self._sending.set()

    async def close(self) -> None:
        """Send what is pending. Let an in-flight report finish rather than cancel it half-sent."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.wait([self._flusher], timeout=2.0)
            self._flusher.cancel()
        await self.flush()
