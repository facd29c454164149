"""What the vLLM secondary tier counts and how it logs trouble without flooding the log.

The counters are what `KvtierSecondaryTier.get_stats` reports to vLLM (as deltas, one
Prometheus counter each, named vllm:kv_offload_kvtier_<name>):

    lookup_local_hits     lookups answered HIT from this node's shared memory, at once
    lookup_async_hits     ... answered HIT by the background check (here, or in Redis)
    lookup_misses         lookups answered MISS (absent, or a recent failed load)
    lookup_unavailable    lookups answered MISS because the daemon was not reachable
    lookup_errors         lookups that failed unexpectedly (answered MISS)
    store_chunks_ok / store_chunks_failed / store_chunks_deduped / store_jobs_failed
    load_chunks_ok / load_chunks_failed / load_chunks_prefetched / load_jobs_failed
    read_failures         resident chunks whose read failed verification or was evicted meanwhile
    daemon_unavailable    jobs (or job phases) refused or cut short because the daemon was down
    redis_errors          Redis calls that failed (existence checks, put and prefetch events)
    timeouts              deadlines passed (lookups, staging room, residency)
"""

from __future__ import annotations

import threading
import time


class Counters:
    """Monotonic counters, bumped from the scheduler, lookup and loop threads (hence the lock)."""

    NAMES = (
        "lookup_local_hits", "lookup_async_hits", "lookup_misses", "lookup_unavailable", "lookup_errors",
        "store_chunks_ok", "store_chunks_failed", "store_chunks_deduped", "store_jobs_failed",
        "load_chunks_ok", "load_chunks_failed", "load_chunks_prefetched", "load_jobs_failed",
        "read_failures", "daemon_unavailable", "redis_errors", "timeouts",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class LogThrottle:
    """At most one log line per event name per `every_s`; the lines skipped are counted in the next."""

    def __init__(self, log, every_s: float = 5.0) -> None:
        self._log, self._every, self._last, self._skipped = log, every_s, {}, {}
        self._lock = threading.Lock()

    def warning(self, event: str, **kw) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(event, -1e9) < self._every:
                self._skipped[event] = self._skipped.get(event, 0) + 1
                return
            self._last[event] = now
            skipped = self._skipped.pop(event, 0)
        self._log.warning(event, suppressed=skipped, **kw)
