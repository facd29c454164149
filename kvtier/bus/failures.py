"""What a failed Redis call raises, for every `except` that turns a failure into a miss.

redis-py's cluster client raises some of its errors outside `RedisError`: `RedisClusterException`
when no node can be reached to load the slot map, and its subclass `SlotNotCoveredError` for a
key whose slot no master serves. Catching `RedisError` alone would let those through, and a
master going down would crash the code that meant to count a miss.
"""

from __future__ import annotations

from redis.exceptions import ClusterDownError, ConnectionError, RedisClusterException, RedisError, TimeoutError

REDIS_ERRORS = (RedisError, RedisClusterException)
# The ones that mean Redis (or the master serving the key) is unreachable for now, rather than
# that it refused the command: a retry later can succeed. BusyLoadingError is a ConnectionError;
# CLUSTERDOWN (a slot without a master, during a failover) is transient too.
OUTAGE_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, RedisClusterException)

# Loops that must outlive any one failure (the bus consumers, the daemon's chores) also catch
# `Exception` last: when one task's command meets CLUSTERDOWN, redis-py's cluster client closes
# every connection of the client, also those other tasks are using at that moment, which can
# then fail inside redis-py with errors that are not Redis errors at all (an AttributeError on a
# connection's writer, seen in tests/integration/test_redis_cluster.py). Such an error is logged
# with its traceback and retried after the backoff, never allowed to end the daemon.
