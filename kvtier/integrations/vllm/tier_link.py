"""The vLLM secondary tier's link to kvtier: one event-loop thread that owns a kvtier Client.

vLLM calls a secondary tier on its scheduler thread and wants every call to return at once.
`TierLink` runs kvtier's asyncio `Client` on a private loop thread and hands the scheduler
`concurrent.futures.Future`s; the scheduler polls them (`done()`), it never waits on one.
A health task (every `health_interval_s`) notices a dead daemon (its pid), follows a restart,
and reconnects; a pool that no longer fits (another block size) takes the link down until it
fits again. The jobs that run on the link: tier_io.py. No vLLM import here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvtier.bus.failures import REDIS_ERRORS
from kvtier.client import Client
from kvtier.client.discovery import library_logger
from kvtier.errors import DaemonUnavailable, UnknownPool
from kvtier.integrations.vllm.tier_chunks import PoolMismatch, pool_help
from kvtier.integrations.vllm.tier_stats import Counters, LogThrottle
from kvtier.processes import pid_alive

CLOSE_S = 5.0
MISMATCH_RETRY_S = 5.0  # a daemon serving the pool at another size: look again this often

T = TypeVar("T")


class DaemonDown(Exception):
    """The daemon is not reachable right now (raised inside jobs, turned into failed chunks)."""


class TierLink:
    def __init__(self, rows: np.ndarray, runtime_dir: str | None, pool: str, *, staging_chunks: int = 32,
                 connect_timeout_s: float = 5.0, health_interval_s: float = 0.25,
                 counters: Counters | None = None) -> None:
        self._rows = rows
        self.chunk_bytes = int(rows.shape[1])
        self.pool = pool
        self._rdir = None if runtime_dir is None else Path(runtime_dir)
        self._staging = staging_chunks
        self._connect_timeout = connect_timeout_s
        self._health_s = health_interval_s
        self.counters = counters or Counters()
        self.log = library_logger().bind(component="vllm_tier", pool=pool)
        self.warn = LogThrottle(self.log)
        self.up = False  # read by the scheduler thread; written by the loop thread only
        self._client: Client | None = None
        self._mismatch = ""
        self._retry_at = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-vllm-tier", daemon=True)
        self._thread.start()
        self._health: concurrent.futures.Future[None] | None = None
        try:
            self.call(self._reconnect(first=True), connect_timeout_s + CLOSE_S)
        except BaseException:
            self._stop_loop()
            raise
        self._health = asyncio.run_coroutine_threadsafe(self._health_loop(), self._loop)

    # --- for the scheduler thread ------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def local_has(self, key: bytes) -> bool:
        """Whether `key` is resident on this node, from the shared-memory directory, on the
        caller's thread (no I/O). Reads only; any trouble (a restart remapping the pool right
        now) answers False and leaves the question to `exists` on the loop."""
        client = self._client
        if not self.up or client is None:
            return False
        try:
            p = client.pools.get(self.pool)
            return p is not None and p.locate(key) is not None
        except Exception:
            return False

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        if self._health is not None:
            self._health.cancel()
        with contextlib.suppress(Exception):
            self.call(self._drop_client(), CLOSE_S + 1)
        self._stop_loop()
        self._rows = None  # vLLM releases the primary memoryview next: hold no buffer export on it

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_S)
        if not self._thread.is_alive():
            self._loop.close()

    # --- connection and health (loop thread) -------------------------------------------------

    async def _reconnect(self, first: bool = False) -> None:
        try:
            client = await asyncio.wait_for(Client.connect(self._rdir, staging_blocks=self._staging),
                                            self._connect_timeout)
        except (DaemonUnavailable, OSError, TimeoutError, *REDIS_ERRORS) as e:
            self.up = False
            if first:
                self.log.warning("vllm_tier.daemon_unavailable", error=str(e),
                                 detail="every lookup misses and every job fails until it is back")
            return
        try:
            self._check_pool(client)
        except PoolMismatch as e:
            await self._close_quietly(client)
            if first:
                raise
            if str(e) != self._mismatch:
                self.log.error("vllm_tier.pool_mismatch", error=str(e))
            self._mismatch = str(e)
            self._retry_at = time.monotonic() + MISMATCH_RETRY_S  # mapping every pool is not free
            self.up = False
            return
        old, self._client, self._mismatch = self._client, client, ""
        self.up = True
        self.log.info("vllm_tier.connected", node=client.node, daemon_pid=client.desc.get("pid"),
                      chunk_bytes=self.chunk_bytes)
        if old is not None:
            await self._close_quietly(old)

    def _check_pool(self, client: Client) -> None:
        try:
            p = client.pool(self.pool)
        except UnknownPool as e:
            raise PoolMismatch(f"kvtier pool {self.pool!r} is not served by the daemon ({e}). "
                               + pool_help(self.pool, self.chunk_bytes)) from e
        if p.block_bytes != self.chunk_bytes:
            raise PoolMismatch(f"kvtier pool {self.pool!r} holds blocks of {p.block_bytes} bytes, but vLLM's "
                               f"offload chunks are {self.chunk_bytes} bytes; they must be equal. "
                               + pool_help(self.pool, self.chunk_bytes))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_s)
            try:
                await self._check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the health task must outlive any surprise
                self.up = False
                self.warn.warning("vllm_tier.health_check_failed", error=repr(e))

    async def _check(self) -> None:
        client = self._client
        if client is not None and pid_alive(client.desc.get("pid")):
            try:
                self._check_pool(client)  # client.pool() follows a daemon restart (a new epoch)
            except PoolMismatch as e:
                if self.up:
                    self.log.error("vllm_tier.pool_mismatch", error=str(e))
                self.up = False
                return
            self.up = True
            return
        if self.up:
            self.log.warning("vllm_tier.daemon_lost", pid=client.desc.get("pid") if client else None)
        self.up = False
        if time.monotonic() >= self._retry_at:
            await self._reconnect()

    async def _drop_client(self) -> None:
        client, self._client, self.up = self._client, None, False
        if client is not None:
            await self._close_quietly(client)

    async def _close_quietly(self, client: Client) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), CLOSE_S)

    def _require(self, current: Client | None = None) -> Client:
        """The live client; with `current`, also that no reconnect replaced it (a job that
        started on a client the health task has since closed gives up)."""
        client = self._client
        if not self.up or client is None or (current is not None and client is not current):
            raise DaemonDown("the kvtier daemon is not reachable")
        return client
