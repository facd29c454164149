"""The connector's tie to the node's daemon: connected lazily, retried after failures, never raising.

vLLM must keep serving while kvtier is down, so every call here turns a failure into None (a
miss), one log line and a counter. After a failure the link waits `retry_s` before connecting
again, so a dead daemon costs the scheduler nothing but a clock read per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.client.sync import SyncClient

T = TypeVar("T")
ALIVE_CHECK_S = 0.5  # how often a connected link checks that the daemon still runs
log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format


@dataclass(slots=True)
class LinkCounters:
    """Monotonic counts, reported through vLLM's connector stats and the worker's log."""

    lookups: int = 0  # requests the scheduler looked up
    hit_blocks: int = 0  # blocks the scheduler promised vLLM it could load
    redis_blocks: int = 0  # of those, blocks that were first prefetched from Redis
    loaded_blocks: int = 0
    load_failed_blocks: int = 0  # promised but not read (evicted meanwhile, failed verification, daemon gone)
    saved_blocks: int = 0
    save_skipped_blocks: int = 0  # already resident on this node
    save_dropped_blocks: int = 0  # staging full or the daemon unreachable
    failures: int = 0  # calls that failed: daemon unreachable, Redis down, timeouts
    by_reason: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "by_reason"}
        d.update({f"failures_{k}": v for k, v in self.by_reason.items()})
        return d


class DaemonLink:
    def __init__(self, runtime_dir: str | None, staging_blocks: int, retry_s: float,
                 connect: Callable[..., SyncClient] = SyncClient) -> None:
        self._runtime_dir = runtime_dir
        self._staging_blocks = staging_blocks
        self._retry_s = retry_s
        self._connect = connect
        self._client: SyncClient | None = None
        self._next_try = 0.0
        self._next_alive_check = 0.0
        self.counters = LinkCounters()

    def client(self) -> SyncClient | None:
        """The connected client, or None while the daemon is unreachable (retried every retry_s)."""
        now = time.monotonic()
        if self._client is not None:
            if now < self._next_alive_check:
                return self._client
            self._next_alive_check = now + ALIVE_CHECK_S
            if self._client.daemon_alive():
                return self._client
            # Its arenas are still mapped, but nothing drains staging or answers prefetches: off.
            self.failed("daemon", ConnectionError("the node's kvtier daemon is not running"))
            self.close()
            self._next_try = now + self._retry_s
        if now < self._next_try:
            return None
        self._next_try = now + self._retry_s
        try:
            self._client = self._connect(self._runtime_dir, staging_blocks=self._staging_blocks, timeout=10.0)
            log.info("kvtier: connected to the node daemon (runtime dir %s)", self._runtime_dir or "default")
        except Exception as e:  # noqa: BLE001 - anything here means "no kvtier for now"
            self.failed("connect", e)
        return self._client

    def call(self, what: str, fn: Callable[[SyncClient], T]) -> T | None:
        """fn(client), or None (counted and logged) when there is no client or the call fails."""
        client = self.client()
        if client is None:
            return None
        try:
            return fn(client)
        except Exception as e:  # noqa: BLE001 - a kvtier failure must never fail a vLLM request
            self.failed(what, e)
            return None

    def failed(self, what: str, error: BaseException) -> None:
        c = self.counters
        c.failures += 1
        c.by_reason[what] = c.by_reason.get(what, 0) + 1
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        log.warning("kvtier: %s failed (%s); treating as a miss", what, detail)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001
                log.warning("kvtier: close failed: %s", e)
