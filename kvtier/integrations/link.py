"""The engine seam: how every integration reaches the node's daemon (engine -> integration -> link
-> client -> daemon).

An engine must keep serving while kvtier is down, and calls its cache from several threads. So
the link:
- finds the daemon lazily: `client()` answers at once with the live `SyncClient`, or None while
  the daemon is unreachable; a reconnect is tried at most every `retry_s`, by one thread at a
  time, the others answering None meanwhile;
- notices a daemon that died by its pid (at most every HEALTH_S), and follows a restart;
- checks the engine's pool on every new connection (`PoolSpec`): a pool that cannot hold the
  engine's blocks keeps the link down (`PoolMismatch`, raised at the first connection so that the
  engine's start fails with the reason, logged later);
- guards every call (`guard`): any kvtier failure is the caller's miss value, a counter and a
  throttled log line, never an exception in the engine.

It is synchronous, on `SyncClient` (whose one loop thread runs every call; `submit` overlaps
jobs). No engine import here; integrations map the link's counters (`LINK_COUNTERS`, plus their
own) to their engine's metric names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.client import SyncClient
from kvtier.client.pools import ClientPool
from kvtier.errors import CallTimeout, KvtierError, RedisUnavailable, UnknownPool
from kvtier.integrations.counters import Counters
from kvtier.logs import LogThrottle

T = TypeVar("T")
HEALTH_S = 0.5  # how often a connected link checks that its daemon still runs

# What the link itself counts; integrations add their own names to the same Counters.
LINK_COUNTERS = (
    "daemon_unavailable",  # connection attempts that failed, and calls refused while the daemon was down
    "timeouts",  # calls cut short by their timeout
    "redis_errors",  # calls that failed on Redis (unreachable, refused)
    "errors",  # calls that failed otherwise (answered as misses)
)


class PoolMismatch(ValueError):
    """The daemon's pool cannot hold the engine's blocks (absent, or another size or layout); the
    message says how to configure it."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What an engine needs of its kvtier pool: its name, and (when known) the block's bytes,
    tokens and dtype. The wording of each mismatch is the integration's, in its engine's terms
    (`{name}`, `{have}`: the pool's value, `{want}`: the engine's); `howto()` says how to
    configure a pool that fits."""

    name: str
    block_bytes: int | None = None
    block_tokens: int | None = None
    dtype: str | None = None
    howto: Callable[[], str] = lambda: ""
    tokens_msg: str = "the engine's blocks hold {want} tokens but kvtier pool {name!r} has block_tokens = {have}"
    bytes_msg: str = "the engine's blocks are {want} bytes but kvtier pool {name!r} holds blocks of {have} bytes"
    dtype_msg: str = "the engine's KV dtype is {want} but kvtier pool {name!r} has dtype {have}"

    def check(self, client: SyncClient) -> ClientPool:
        """The pool; PoolMismatch unless it holds the engine's blocks."""
        try:
            p = client.pool(self.name)
        except UnknownPool as e:
            raise PoolMismatch(f"kvtier pool {self.name!r} is not served by the daemon ({e}). {self.howto()}") from e
        problems = [msg.format(name=self.name, have=have, want=want) for msg, have, want in (
            (self.tokens_msg, p.layout.block_tokens, self.block_tokens),
            (self.dtype_msg, p.layout.dtype, self.dtype),
            (self.bytes_msg, p.block_bytes, self.block_bytes)) if want is not None and have != want]
        if problems:
            raise PoolMismatch(f"kvtier pool {self.name!r} does not fit: {'; '.join(problems)}; they must be "
                               f"equal. {self.howto()}")
        return p


class EngineLink:
    def __init__(self, *, runtime_dir: str | None, spec: PoolSpec, counters: Counters, log: Any,
                 retry_s: float = 1.0, staging_blocks: int = 32, connect_timeout_s: float = 5.0,
                 call_timeout_s: float = 5.0, remote_timeout_s: float | None = None, component: str = "kvtier") -> None:
        self.spec = spec
        self.counters = counters
        self.log = log
        self.quiet = LogThrottle(log)
        self.call_timeout_s = call_timeout_s
        self._component = component
        self._connect_kw = {"staging_blocks": staging_blocks, "timeout": connect_timeout_s,
                            "socket_timeout": call_timeout_s, "remote_timeout": remote_timeout_s}
        self._runtime_dir = runtime_dir
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._client: SyncClient | None = None
        self._checked_at = 0.0
        self._next_try = 0.0
        self._connecting = False
        self.mismatch = ""  # the last PoolMismatch, while it keeps the link down

    # --- the connection ------------------------------------------------------------------------

    def client(self) -> SyncClient | None:
        """The live client, or None while the daemon is unreachable (or its pool does not fit)."""
        now = time.monotonic()
        with self._lock:
            c = self._client
            if c is not None and now - self._checked_at < HEALTH_S:
                return c
            if c is None and (self._connecting or now < self._next_try):
                return None
            self._checked_at = now
        if c is not None:
            if self._fits(c):
                return c
            self._drop(c)
        return self.connect()

    def _fits(self, c: SyncClient) -> bool:
        """The daemon still runs (its pid), and its pool (perhaps restarted) still fits."""
        try:
            alive = c.daemon_alive()
        except Exception:  # noqa: BLE001 - anything here means "look again"
            alive = False
        if not alive:
            self.quiet.warning(f"{self._component}.daemon_lost", detail="every lookup misses until it is back")
            return False
        try:
            self.spec.check(c)
        except PoolMismatch as e:
            self._mismatched(e)
            return False
        return True

    def connect(self, *, first: bool = False) -> SyncClient | None:
        """One attempt; with `first` a PoolMismatch propagates (the engine's start fails with it)."""
        with self._lock:
            if self._connecting:
                return None
            self._connecting = True
            self._next_try = time.monotonic() + self._retry_s
        try:
            try:
                c = SyncClient(self._runtime_dir, **self._connect_kw)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - DaemonUnavailable, OSError, a Redis error, a timeout
                self.counters.add("daemon_unavailable")
                self.quiet.warning(f"{self._component}.call_failed", per=("connect", "daemon_unavailable"),
                                   op="connect", kind="daemon_unavailable", error=f"{type(e).__name__}: {e}",
                                   detail=f"every lookup misses; trying again every {self._retry_s:g} s")
                return None
            try:
                self.spec.check(c)
            except PoolMismatch as e:
                self._close_quietly(c)
                if first:
                    raise
                self._mismatched(e)
                return None
            self.mismatch = ""
            with self._lock:
                old, self._client, self._checked_at = self._client, c, time.monotonic()
            if old is not None:
                self._close_quietly(old)
            self.log.info(f"{self._component}.connected", node=c.node, pool=self.spec.name)
            return c
        finally:
            with self._lock:
                self._connecting = False

    def _mismatched(self, e: PoolMismatch) -> None:
        if str(e) != self.mismatch:
            self.log.error(f"{self._component}.pool_mismatch", error=str(e))
        self.mismatch = str(e)

    def _drop(self, c: SyncClient) -> None:
        with self._lock:
            if self._client is c:
                self._client = None
                self._next_try = 0.0  # try at once: a restarted daemon is usually back already
        self._close_quietly(c)

    @property
    def current(self) -> SyncClient | None:
        """The client as it stands, without a health check or a connection attempt (for jobs on
        the client's own loop thread, which must not connect)."""
        return self._client

    def lost(self, c: SyncClient) -> None:
        """A call on `c` failed as if the daemon were gone: look again on the next call."""
        with self._lock:
            if self._client is c:
                self._checked_at = 0.0

    @staticmethod
    def _close_quietly(c: SyncClient) -> None:
        with contextlib.suppress(Exception):
            c.close()

    def close(self) -> None:
        with self._lock:
            c, self._client = self._client, None
            self._next_try = float("inf")
        if c is not None:
            self._close_quietly(c)

    # --- the guard -----------------------------------------------------------------------------

    def guard(self, op: str, miss: T, fn: Callable[[SyncClient], T],
              expected: tuple[type[BaseException], ...] = ()) -> T:
        """fn(client), or `miss` when the daemon is down or anything goes wrong: counted, logged
        (throttled), never raised into the engine. Errors of the `expected` types are re-raised
        for the integration to map (e.g. to its own counters) before the guard sees them."""
        try:
            client = self.client()
        except Exception as e:  # noqa: BLE001 - a PoolMismatch is raised only by connect(first=True)
            self.failed(op, e)
            return miss
        if client is None:
            return miss
        try:
            return fn(client)
        except expected:
            raise
        except Exception as e:  # noqa: BLE001 - the engine must never fail because of its cache
            self.failed(op, e)
            if not isinstance(e, (KvtierError, ValueError, TypeError)) or isinstance(e, (CallTimeout,
                                                                                         RedisUnavailable)):
                self.lost(client)
            return miss

    def failed(self, op: str, error: BaseException) -> None:
        """Count and log (throttled, per operation and kind) a failure the caller turns into a miss."""
        kind = ("timeouts" if isinstance(error, TimeoutError) else
                "redis_errors" if isinstance(error, RedisUnavailable) else
                "daemon_unavailable" if isinstance(error, ConnectionError) else "errors")
        self.counters.add(kind)
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self.quiet.warning(f"{self._component}.call_failed", per=(op, kind), op=op, kind=kind, error=detail,
                           detail="treated as a miss")

    def put_with(self, client: SyncClient, keys: list[bytes], fill: Callable[[int, Any], object], *,
                 parent: bytes | None, wait_s: float, token_ids: list[int] | None = None) -> int:
        """Hand blocks to the daemon, waiting up to `wait_s` for staging room; how many leading
        blocks were taken. The engine's bytes are staged when this returns."""
        res = client.put_with(self.spec.name, keys, fill, parent=parent, token_ids=token_ids, wait_s=wait_s,
                              timeout=wait_s + self.call_timeout_s)
        return res.staged
