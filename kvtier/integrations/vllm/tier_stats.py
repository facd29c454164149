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
                          (each is then read through from Redis, within the job's deadline)
    daemon_unavailable    jobs (or job phases) refused or cut short because the daemon was down
    connect_failures, daemon_lost, pool_mismatches   the link's own (kvtier/integrations/link.py)
    redis_errors          Redis calls that failed (existence checks, put and prefetch events)
    timeouts              deadlines passed (lookups, staging room, residency)
    errors                calls that failed otherwise (answered as misses; the link's count)
"""

from __future__ import annotations

from kvtier.integrations.counters import Counters as _Counters
from kvtier.integrations.counters import LogThrottle

__all__ = ["Counters", "LogThrottle"]


class Counters(_Counters):
    NAMES = (
        "lookup_local_hits", "lookup_async_hits", "lookup_misses", "lookup_unavailable", "lookup_errors",
        "store_chunks_ok", "store_chunks_failed", "store_chunks_deduped", "store_jobs_failed",
        "load_chunks_ok", "load_chunks_failed", "load_chunks_prefetched", "load_jobs_failed",
        "read_failures", "daemon_unavailable", "redis_errors", "timeouts", "errors", "connect_failures",
        "daemon_lost", "pool_mismatches",
    )
