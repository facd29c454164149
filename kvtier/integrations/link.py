"""The engine seam: how every integration reaches the node's daemon (engine -> integration -> link
-> client -> daemon).

An engine must keep serving while kvtier is down, and calls its cache from several threads that
must not wait. So the link:
- keeps the connection up in a watcher thread of its own: every `watch_s` it checks that the
  daemon still runs (its pid) and that its pool still fits the engine (`PoolSpec`; a restarted
  daemon may serve another one), drops a client that fails either, and while there is none tries
  to connect every `retry_s` (`mismatch_retry_s` after a pool that did not fit: mapping every
  pool is not free). The engine's threads only read `client()`: the live `SyncClient`, or None;
- raises `PoolMismatch` from the first connection (`start(first=True)`), so that the engine's
  start fails with the reason; later mismatches keep the link down and are logged once. Or
  (`start(wait_s=...)`) lets the watcher make that first try and waits for it, bounded: an
  engine's first request, which may come the moment the engine is ready, finds the link up;
- guards every call (`guard`): any kvtier failure is the caller's miss value, a counter and a
  line throttled per operation and kind, never an exception in the engine.

It is synchronous, on `SyncClient` (whose one loop thread runs every call; `submit` overlaps
jobs). Closing a dropped client cancels what still runs on it: those calls are misses. No
engine import here; integrations add their own counter names to the link's (`LINK_COUNTERS`) and
report them under their engine's metric names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.client import ManifestEntry, NamespaceConflict, SyncClient
from kvtier.errors import RedisUnavailable
from kvtier.integrations.counters import Counters
from kvtier.integrations.pool_spec import PoolMismatch, PoolSpec
from kvtier.logs import LogThrottle

T = TypeVar("T")
WATCH_S = 0.5  # how often the watcher checks a live daemon (its pid, its pool)
MISMATCH_RETRY_S = 5.0  # after a pool that did not fit: the next try
STORED_FLUSH_S = 5.0  # how often the manifest's stored counts are added to Redis

# What the link itself counts; integrations add their own names to the same Counters.
LINK_COUNTERS = (
    "connect_failures",  # connection attempts that failed (no daemon, Redis unreachable, ...)
    "daemon_lost",  # times a connected daemon was found gone (its pid)
    "pool_mismatches",  # pools found not to fit the engine's blocks (each distinct finding once)
    "namespace_conflicts",  # the manifest says the namespace is another page's (each finding once)
    "manifest_errors",  # manifest writes that failed (Redis unreachable): tried again
    "timeouts",  # calls cut short by their timeout
    "redis_errors",  # calls that failed on Redis (unreachable, refused)
    "errors",  # calls that failed otherwise (answered as misses)
)


class EngineLink:
    def __init__(self, *, runtime_dir: str | None, spec: PoolSpec, counters: Counters, log: Any,
                 retry_s: float = 1.0, staging_blocks: int = 32, connect_timeout_s: float = 5.0,
                 socket_timeout_s: float = 2.0, call_timeout_s: float = 5.0, remote_timeout_s: float | None = None,
                 watch_s: float = WATCH_S, mismatch_retry_s: float = MISMATCH_RETRY_S,
                 stored_flush_s: float = STORED_FLUSH_S, component: str = "kvtier", puts: bool = False) -> None:
        self._spec = spec
        # The engine saves blocks: each connection asks for grants at once (prepare_puts). Off by
        # default: grants wait in a client's ring until it puts, so a loader's would sit idle.
        self._puts = puts
        self.counters = counters
        self.log = log
        self.quiet = LogThrottle(log)
        self.call_timeout_s = call_timeout_s
        self._component = component
        self._connect_kw: dict[str, Any] = {"staging_blocks": staging_blocks, "timeout": connect_timeout_s,
                                            "socket_timeout": socket_timeout_s, "remote_timeout": remote_timeout_s}
        self._runtime_dir = runtime_dir
        self._retry_s, self._mismatch_retry_s, self._watch_s = retry_s, mismatch_retry_s, watch_s
        self._lock = threading.Lock()  # guards _client and _closed
        self._client: SyncClient | None = None
        self._closed = False
        self._next_try = 0.0
        self._wake = threading.Event()
        self._tried = threading.Event()  # the watcher's first round is over (start's wait_s)
        self._watcher: threading.Thread | None = None
        self.mismatch = ""  # the last PoolMismatch or NamespaceConflict, while it keeps the link down
        # The manifest (core/manifest.py): the entry this engine registers, whether it has been
        # (once per link: a conflict cannot come later), and what it stored since the last flush.
        self._entry: ManifestEntry | None = None
        self._registered = False
        self._register_next = 0.0  # after a failed registration (Redis down): when to try again
        self._stored = [0, 0]
        self._flush_next, self._flush_s = 0.0, stored_flush_s

    @property
    def spec(self) -> PoolSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: PoolSpec) -> None:
        """A fuller spec, once the integration knows its blocks: checked against the live client at
        once (no call may use a pool that does not fit), and on every connection from then on."""
        self._spec = spec
        c = self._client
        if c is None:
            return
        try:
            spec.check(c)
        except PoolMismatch as e:
            self._mismatched(e)
            self._drop(c)

    # --- the connection ------------------------------------------------------------------------

    def start(self, *, first: bool = False, wait_s: float = 0.0) -> EngineLink:
        """Connect once now (with `first`, a PoolMismatch propagates: the engine's start fails with
        it), then keep the connection up from the watcher thread. Without `first`, the watcher
        tries at once, and the caller waits up to `wait_s` for that try: an engine whose first
        request comes as soon as it is ready finds a healthy daemon connected, and one that does
        not answer delays its start by no more than that."""
        if first:
            self._connect(first=True)
        self._watcher = threading.Thread(target=self._watch, name=f"{self._component}-link", daemon=True)
        self._watcher.start()
        if wait_s > 0 and not self._tried.wait(wait_s) and self._client is None:
            # Said, because the engine's first requests then recompute what the node may hold.
            self.log.warning(f"{self._component}.connect_slow", waited_s=wait_s,
                             detail="the first connection is not made yet: calls miss until it is")
        return self

    def client(self) -> SyncClient | None:
        """The live client, or None while the daemon is unreachable (or its pool does not fit).
        Never waits: the watcher thread does the connecting and the checking."""
        return self._client

    current = property(client)

    def _watch(self) -> None:
        while not self._closed:
            try:
                c = self._client
                if c is not None:
                    if not self._fits(c):
                        self._drop(c)
                    else:
                        self._flush_stored(c)
                elif time.monotonic() >= self._next_try:
                    self._connect()
            except Exception as e:  # noqa: BLE001 - the watcher must outlive any surprise
                self.quiet.warning(f"{self._component}.watch_failed", error=f"{type(e).__name__}: {e}")
            self._tried.set()
            self._wake.wait(self._watch_s)
            self._wake.clear()

    def _fits(self, c: SyncClient) -> bool:
        """The daemon still runs (its pid), and its pool (perhaps restarted) still fits."""
        try:
            alive = c.daemon_alive()
        except Exception:  # noqa: BLE001 - anything here means "look again"
            alive = False
        if not alive:
            self.counters.add("daemon_lost")
            self.quiet.warning(f"{self._component}.daemon_lost", detail="every call misses until it is back")
            self._next_try = 0.0  # try at once: a restarted daemon is usually back already
            return False
        try:
            self.spec.check(c)
        except PoolMismatch as e:
            self._mismatched(e)
            return False
        return self._register(c)

    def _connect(self, *, first: bool = False) -> SyncClient | None:
        self._next_try = time.monotonic() + self._retry_s
        try:
            c = SyncClient(self._runtime_dir, **self._connect_kw)
        except Exception as e:  # noqa: BLE001 - DaemonUnavailable, OSError, a Redis error, a timeout
            self.counters.add("connect_failures")
            self.quiet.warning(f"{self._component}.call_failed", per=("connect", "unavailable"), op="connect",
                               kind="connect_failures", error=f"{type(e).__name__}: {e}",
                               detail=f"every call misses; trying again every {self._retry_s:g} s")
            return None
        try:
            self.spec.check(c)
            if not self._register(c):
                self._close_quietly(c)
                return None
        except PoolMismatch as e:
            self._close_quietly(c)
            if first:
                raise
            self._mismatched(e)
            return None
        except BaseException:
            self._close_quietly(c)
            raise
        with self._lock:
            if self._closed:  # closed meanwhile: this client is nobody's
                self._close_quietly(c)
                return None
            old, self._client = self._client, c
        self.mismatch = ""
        if old is not None:
            self._close_quietly(old)
        if self._puts:  # the first save then writes its blocks into their final slots (one pass)
            try:
                c.prepare_puts(self.spec.name, timeout=self.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - only a head start: the first put asks again
                self.failed("prepare_puts", e)
        self.log.info(f"{self._component}.connected", node=c.node, pool=self.spec.name)
        return c

    # --- the manifest ---------------------------------------------------------------------------

    def register(self, entry: ManifestEntry) -> None:
        """The engine's manifest entry (its namespace, weights and page), entered in Redis now if
        the daemon is up, else on the next connection. A namespace registered for other page
        bytes takes the link down (NamespaceConflict, logged once): no block under it is read."""
        self._entry, self._registered, self._register_next = entry, False, 0.0
        c = self._client
        if c is not None and not self._register(c):
            self._drop(c)

    def _register(self, c: SyncClient) -> bool:
        """False on a conflict. Redis unreachable: counted, and tried again on the next round."""
        if self._entry is None or self._registered or time.monotonic() < self._register_next:
            return True
        try:
            c.register_namespace(self.spec.name, self._entry, timeout=self.call_timeout_s)
        except NamespaceConflict as e:
            self._mismatched(e, "namespace_conflicts", "namespace_conflict")
            return False
        except Exception as e:  # noqa: BLE001 - Redis down: the blocks are still this engine's to use
            self._register_next = time.monotonic() + self._mismatch_retry_s  # not every watch round
            self.counters.add("manifest_errors")
            self.quiet.warning(f"{self._component}.manifest_failed", error=f"{type(e).__name__}: {e}")
            return True
        self._registered = True
        return True

    def stored(self, blocks: int, nbytes: int) -> None:
        """Blocks the engine handed over under its namespace: added to the manifest's counts by
        the link's thread (kept, and added later, while Redis is unreachable)."""
        with self._lock:
            self._stored[0] += blocks
            self._stored[1] += nbytes

    def _flush_stored(self, c: SyncClient, *, now: bool = False) -> None:
        t = time.monotonic()
        if self._entry is None or (t < self._flush_next and not now):
            return
        self._flush_next = t + self._flush_s
        with self._lock:
            (blocks, nbytes), self._stored = self._stored, [0, 0]
        if not blocks:
            return
        try:
            c.count_stored(self.spec.name, self._entry.namespace, blocks, nbytes, timeout=self.call_timeout_s)
        except Exception as e:  # noqa: BLE001 - kept for the next round
            self.stored(blocks, nbytes)
            self.counters.add("manifest_errors")
            self.quiet.warning(f"{self._component}.manifest_failed", error=f"{type(e).__name__}: {e}")

    def _mismatched(self, e: Exception, counter: str = "pool_mismatches", event: str = "pool_mismatch") -> None:
        """The link stays down (tried again after mismatch_retry_s); each distinct finding is
        counted and logged once."""
        self._next_try = time.monotonic() + self._mismatch_retry_s
        if str(e) != self.mismatch:
            self.counters.add(counter)
            self.log.error(f"{self._component}.{event}", error=str(e))
        self.mismatch = str(e)

    def _drop(self, c: SyncClient) -> None:
        with self._lock:
            if self._client is c:
                self._client = None
        self._close_quietly(c)  # cancels what still runs on it: misses for their callers

    def lost(self, c: SyncClient) -> None:
        """A call on `c` failed as if the daemon were gone: have the watcher look at once."""
        if self._client is c:
            self._wake.set()

    @staticmethod
    def _close_quietly(c: SyncClient) -> None:
        with contextlib.suppress(Exception):
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            c, self._client = self._client, None
        self._wake.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(10)
        if c is not None:
            self._flush_stored(c, now=True)  # the manifest's last counts (bounded by call_timeout_s)
            self._close_quietly(c)

    # --- the guard -----------------------------------------------------------------------------

    def guard(self, op: str, miss: T, fn: Callable[[SyncClient], T]) -> T:
        """fn(client), or `miss` when the daemon is down or anything goes wrong: counted, logged
        (throttled), never raised into the engine."""
        client = self._client
        if client is None:
            return miss
        try:
            return fn(client)
        except Exception as e:  # noqa: BLE001 - the engine must never fail because of its cache
            self.failed(op, e)
            if isinstance(e, (TimeoutError, RedisUnavailable, ConnectionError)):
                self.lost(client)
            return miss

    def failed(self, op: str, error: BaseException) -> None:
        """Count and log (throttled, per operation and kind) a failure the caller turns into a miss."""
        kind = ("timeouts" if isinstance(error, TimeoutError) else
                "redis_errors" if isinstance(error, RedisUnavailable) else "errors")
        self.counters.add(kind)
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self.quiet.warning(f"{self._component}.call_failed", per=(op, kind), op=op, kind=kind, error=detail,
                           detail="treated as a miss")

    def put_with(self, client: SyncClient, keys: list[bytes], fill: Callable[[int, Any], object], *,
                 parent: bytes | None, wait_s: float, token_ids: list[int] | None = None,
                 pool: str | None = None, tenant: str = "") -> int:
        """Hand blocks to the daemon (the link's pool, or `pool`: not counted in the manifest),
        waiting up to `wait_s` for room; how many leading blocks were taken (staged on return)."""
        name = pool or self.spec.name
        res = client.put_with(name, keys, fill, parent=parent, token_ids=token_ids, wait_s=wait_s, tenant=tenant,
                              timeout=wait_s + self.call_timeout_s)
        if res.staged and name == self.spec.name:
            self.stored(res.staged, res.staged * client.pool(name).block_bytes)
        return res.staged
