"""The SGLang backend's link to the kvtier daemon: one SyncClient, reconnected when it is lost.

SGLang calls its storage backend from its prefetch and backup threads and must never fail a
request because the backend is down. So `client()` answers with the live client, or None
while the daemon is unreachable (every call is then a miss or False). A lost daemon is noticed
by its pid (checked at most every HEALTH_S); a reconnect is tried at most every `retry_s`, by
one thread at a time (it waits up to `connect_timeout_s`), the others answering None meanwhile.
`check` is the backend's pool check, run on every new connection: a pool of the wrong size
keeps the link down (PoolMismatch). No SGLang import here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.client.sync import SyncClient
from kvtier.errors import UnknownPool
from kvtier.integrations.counters import Counters, LogThrottle
from kvtier.integrations.sglang.hicache_config import HiCacheSettings

HEALTH_S = 0.5


class PoolMismatch(ValueError):
    """The daemon's pool cannot hold SGLang's pages (absent, or another page size or byte size)."""


def pool_help(pool: str, page_size: int | None, page_bytes: int | None) -> str:
    want = f"block_tokens = {page_size}" if page_size else "block_tokens = SGLang's --page-size"
    size = f" and blocks of {page_bytes} bytes" if page_bytes else ""
    return (f"Serve a pool [pools.{pool}] with {want}{size}: for MHA, layers, kv_heads (per TP rank), "
            f"head_dim and dtype as SGLang's KV cache (block bytes = 2 x layers x kv_heads x block_tokens x "
            f"head_dim x dtype size), or any shape of the same bytes. docs/integrations/sglang.md")


def check_pool(client: SyncClient, pool: str, page_size: int | None, page_bytes: int | None) -> None:
    """PoolMismatch unless the daemon serves `pool` with SGLang's page size and bytes (those known)."""
    try:
        p = client.pool(pool)
    except UnknownPool as e:
        raise PoolMismatch(f"kvtier pool {pool!r} is not served by the daemon ({e}). "
                           + pool_help(pool, page_size, page_bytes)) from e
    if page_size is not None and p.layout.block_tokens != page_size:
        raise PoolMismatch(f"SGLang's page size is {page_size} tokens but kvtier pool {pool!r} has block_tokens = "
                           f"{p.layout.block_tokens}; they must be equal. " + pool_help(pool, page_size, page_bytes))
    if page_bytes is not None and p.block_bytes != page_bytes:
        raise PoolMismatch(f"SGLang's pages are {page_bytes} bytes but kvtier pool {pool!r} holds blocks of "
                           f"{p.block_bytes} bytes; they must be equal. " + pool_help(pool, page_size, page_bytes))


class HiCacheLink:
    def __init__(self, settings: HiCacheSettings, log: Any, counters: Counters,
                 check: Callable[[SyncClient], None]) -> None:
        self.s = settings
        self.log = log
        self.warn = LogThrottle(log)
        self.counters = counters
        self._check = check
        self._lock = threading.Lock()
        self._client: SyncClient | None = None
        self._checked_at = 0.0
        self._next_try = 0.0
        self._connecting = False
        self.mismatch = ""  # the last PoolMismatch, while it keeps the link down

    def client(self) -> SyncClient | None:
        now = time.monotonic()
        with self._lock:
            c = self._client
            if c is not None and now - self._checked_at < HEALTH_S:
                return c
            if c is None and (self._connecting or now < self._next_try):
                return None
            self._checked_at = now
        if c is not None:
            if self._alive(c):
                return c
            self.warn.warning("sglang_hicache.daemon_lost", detail="pages miss until it is back")
            self._drop(c)
        return self.connect()

    def connect(self, *, first: bool = False) -> SyncClient | None:
        """One attempt; on `first` a PoolMismatch propagates (SGLang's attach fails with it)."""
        with self._lock:
            if self._connecting:
                return None
            self._connecting = True
            self._next_try = time.monotonic() + self.s.retry_s
        try:
            try:
                c = SyncClient(self.s.runtime_dir, staging_blocks=self.s.staging_blocks,
                               timeout=self.s.connect_timeout_s, socket_timeout=self.s.call_timeout_s,
                               remote_timeout=self.s.remote_timeout_s)
            except Exception as e:  # DaemonUnavailable, OSError, a Redis error, a timeout
                self.counters.add("daemon_unavailable")
                self.warn.warning("sglang_hicache.daemon_unavailable", error=f"{type(e).__name__}: {e}",
                                  detail=f"every page misses; trying again every {self.s.retry_s:g} s")
                return None
            try:
                self._check(c)
            except PoolMismatch as e:
                self._close_quietly(c)
                if first:
                    raise
                if str(e) != self.mismatch:
                    self.log.error("sglang_hicache.pool_mismatch", error=str(e))
                self.mismatch = str(e)
                return None
            self.mismatch = ""
            with self._lock:
                old, self._client, self._checked_at = self._client, c, time.monotonic()
            if old is not None:
                self._close_quietly(old)
            self.log.info("sglang_hicache.connected", node=c.node, pool=self.s.pool)
            return c
        finally:
            with self._lock:
                self._connecting = False

    def _alive(self, c: SyncClient) -> bool:
        try:
            return c.daemon_alive()
        except Exception:
            return False

    def _drop(self, c: SyncClient) -> None:
        with self._lock:
            if self._client is c:
                self._client = None
                self._next_try = 0.0  # try at once: a restarted daemon is usually back already
        self._close_quietly(c)

    def lost(self, c: SyncClient) -> None:
        """A call on `c` failed as if the daemon were gone: look again on the next call."""
        with self._lock:
            if self._client is c:
                self._checked_at = 0.0

    def _close_quietly(self, c: SyncClient) -> None:
        with contextlib.suppress(Exception):
            c.close()

    def close(self) -> None:
        with self._lock:
            c, self._client = self._client, None
            self._next_try = float("inf")
        if c is not None:
            self._close_quietly(c)
