"""What a failed Redis call raises, for every `except` that turns a failure into a miss.

redis-py's cluster client raises some of its errors outside `RedisError`: `RedisClusterException`
when no node can be reached to load the slot map, and its subclass `SlotNotCoveredError` for a
key whose slot no master serves. Catching `RedisError` alone would let those through, and a
master going down would crash the code that meant to count a miss.
"""

from __future__ import annotations

from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TimeoutError,
)

REDIS_ERRORS = (RedisError, RedisClusterException)
# The ones that mean Redis (or the master serving the key) is unreachable for now, rather than
# that it refused the command: a retry later can succeed. BusyLoadingError and
# MasterNotFoundError (Sentinel) are ConnectionErrors; CLUSTERDOWN (a slot without a master,
# during a failover) and a slot missing from the client's map are transient too.
OUTAGE_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, SlotNotCoveredError)


def is_outage(e: object) -> bool:
    """An outage error, or the cluster client's "cannot be connected" (a RedisClusterException
    raised from the connection error of the last node it tried). Other RedisClusterExceptions
    (cross-slot keys, no node for a command) are the command's fault, not an outage."""
    if isinstance(e, OUTAGE_ERRORS):
        return True
    return isinstance(e, RedisClusterException) and isinstance(e.__cause__, ConnectionError | TimeoutError)

# Loops that must outlive any one failure (the bus consumers, the daemon's chores) also catch
# `Exception` last: when one task's command meets CLUSTERDOWN, redis-py's cluster client closes
# every connection of the client, also those other tasks are using at that moment, which can
# then fail inside redis-py with errors that are not Redis errors at all (an AttributeError on a
# connection's writer, seen in tests/integration/test_redis_cluster.py). Such an error is logged
# with its traceback and retried after the backoff, never allowed to end the daemon.
