"""Redis clients configured the one way kvtier wants them: one server, a Redis Cluster, or a
master found through Sentinels (the URLs are in kvtier/redis_url.py).

Everything that matters for the bus is explicit rather than left to redis-py defaults, which
changed between majors (reliability.md §0.5): socket and connect timeouts, a small capped
exponential retry on connection and timeout errors, and a periodic health check so an idle
pooled connection is verified before use. Replies stay bytes (`decode_responses=False`): event
payloads are msgpack, not text.

On a cluster, redis-py's own `RedisCluster` follows MOVED and ASK and reloads the slot map. Its
cluster-level retry (`retries`) re-runs a failed command after closing every connection of the
client, so a client whose batches span masters (the blocks: store/batches.py) takes
`retries=0` and keeps one master's failure to that master's keys. A cluster client also does
not require full slot coverage: with one master down, the others keep serving.

A Sentinel client (`master_for`) asks the Sentinels for the master on every new connection, so
a failover needs no restart: the retries reconnect to the new master.

Retries can duplicate a non-idempotent XADD whose reply was lost; consumers are idempotent, so
that is accepted (reliability.md §1.7). A blocking XREADGROUP must use BLOCK < socket_timeout.
"""

from __future__ import annotations

from typing import Any, TypeAlias, TypedDict

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
from redis._parsers import AsyncCommandsParser  # what RedisCluster itself uses; see _AnyPrimaryCommands
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.cluster import PRIMARY
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from kvtier.redis_url import Mode, cluster_url, parse_redis_url

HEALTH_CHECK_INTERVAL_S = 30
BACKOFF_CAP_S = 1.0
BACKOFF_BASE_S = 0.01

# What kvtier talks to: one server (also a Sentinel-managed master) or a cluster.
AsyncRedis: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def _check(socket_timeout: float, connect_timeout: float, retries: int) -> None:
    if socket_timeout <= 0 or connect_timeout <= 0:
        raise ValueError("socket_timeout and connect_timeout must be > 0")
    if retries < 0:
        raise ValueError("retries must be >= 0")


class _Options(TypedDict):
    """The keyword arguments every client gets (typed, so `**` cannot reach another parameter)."""

    decode_responses: bool
    socket_timeout: float
    socket_connect_timeout: float
    health_check_interval: int


def _kwargs(socket_timeout: float, connect_timeout: float) -> _Options:
    return {
        "decode_responses": False,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
    }


class _AnyPrimaryCommands(AsyncCommandsParser):
    """How the cluster client finds a command's keys, without depending on one master.

    redis-py asks one node (the first primary when the slot map loaded) for COMMAND, and for
    `COMMAND GETKEYS` before every command whose keys move (XREADGROUP, XREAD). With that master
    down, the client cannot start, and no node's bus can read its streams, whichever master holds
    them (scripts/repro/cluster_first_master_down.py). Here the stream reads' keys are found
    locally (they follow STREAMS: the first half of what is left), which also saves a round trip
    per read, and a node that fails to answer is replaced by the next primary."""

    __slots__ = ("_nodes", "_good")

    def __init__(self, nodes: redis.asyncio.cluster.NodesManager) -> None:
        super().__init__()
        self._nodes = nodes
        self._good: redis.asyncio.cluster.ClusterNode | None = None  # the last node that answered

    def _candidates(self, first: redis.asyncio.cluster.ClusterNode | None) -> list[redis.asyncio.cluster.ClusterNode]:
        """The node to ask first, then every other primary; the last one that answered leads, so a
        reload (which names the first primary, maybe the dead one) costs no connect timeout."""
        primaries = self._nodes.get_nodes_by_server_type(PRIMARY)
        good = self._good if self._good in primaries else None
        lead = [n for n in (good, first) if n is not None]
        return list(dict.fromkeys([*lead, *primaries]))

    async def initialize(self, node: redis.asyncio.cluster.ClusterNode | None = None) -> None:
        error: Exception | None = None
        for n in self._candidates(node or getattr(self, "node", None)):
            try:
                await super().initialize(n)
            except (ConnectionError, TimeoutError) as e:
                error = e
                continue
            self._good = self._nodes.default_node = n
            return
        raise error if error is not None else ConnectionError("no primary in the slot map")

    async def get_keys(self, *args: Any) -> tuple[Any, ...] | None:
        if len(args) > 1 and str(args[0]).upper() in ("XREADGROUP", "XREAD"):
            return _stream_keys(args)
        error: Exception | None = None
        for n in self._candidates(self.node):
            self.node = n
            try:
                keys = await super().get_keys(*args)
            except (ConnectionError, TimeoutError) as e:
                error = e
                continue
            self._good = n
            return tuple(keys) if keys is not None else None
        assert error is not None
        raise error


def _stream_keys(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys of XREAD / XREADGROUP: after STREAMS come the keys, then as many ids. XREADGROUP's
    group and consumer names (GROUP g c) are skipped, so one named "streams" is not taken for it."""
    start = 4 if str(args[0]).upper() == "XREADGROUP" else 1
    words = [a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args]
    at = next((i for i in range(start, len(words)) if words[i].upper() == "STREAMS"), None)
    if at is None:
        return None
    rest = args[at + 1:]
    return tuple(rest[: len(rest) // 2]) or None


def _retry(retries: int) -> AsyncRetry:
    return AsyncRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries,
                      supported_errors=(ConnectionError, TimeoutError))


def make_redis(url: str, *, socket_timeout: float, connect_timeout: float, retries: int) -> AsyncRedis:
    """An asyncio client for a kvtier Redis URL; the caller owns it and must `await
    client.aclose()`. Raises ValueError for a URL kvtier does not accept."""
    return _make(url, socket_timeout, connect_timeout, retries, retries)


def make_blocks_redis(url: str, *, socket_timeout: float, connect_timeout: float, retries: int) -> AsyncRedis:
    """`make_redis` for block values: on a cluster, no cluster-level retry (see above);
    store/batches.py reloads the slot map itself after a master fails."""
    return _make(url, socket_timeout, connect_timeout, retries, 0)


def _make(url: str, socket_timeout: float, connect_timeout: float, retries: int, cluster_retries: int) -> AsyncRedis:
    _check(socket_timeout, connect_timeout, retries)
    target = parse_redis_url(url)
    opts = _kwargs(socket_timeout, connect_timeout)
    if target.mode is Mode.SINGLE:
        return redis.asyncio.Redis.from_url(url, retry=_retry(retries), **opts)
    if target.mode is Mode.CLUSTER:
        seeds = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in target.nodes]
        cluster = redis.asyncio.cluster.RedisCluster.from_url(
            target.node_url, startup_nodes=seeds, require_full_coverage=False, retry=_retry(cluster_retries),
            **opts)
        cluster.commands_parser = _AnyPrimaryCommands(cluster.nodes_manager)
        return cluster
    conn: dict[str, Any] = dict(parse_url(target.node_url))
    conn.pop("host", None)
    conn.pop("port", None)
    if conn.pop("connection_class", None) is redis.asyncio.SSLConnection:
        conn["ssl"] = True
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout}
    sentinel_kwargs.update({k.removeprefix("sentinel_"): v for k, v in target.sentinel_options})
    if conn.get("ssl"):
        sentinel_kwargs.update({k: v for k, v in conn.items() if k.startswith("ssl")})
    sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(target.nodes), sentinel_kwargs=sentinel_kwargs, **opts)
    master: redis.asyncio.Redis = sentinel.master_for(target.service, retry=_retry(retries), **conn)
    return master


async def resolve_url(url: str, *, socket_timeout: float, connect_timeout: float) -> str:
    """The URL to use for `url`: a one-server redis[s]:// URL whose server is a cluster node
    becomes its redis+cluster:// form; any other comes back as it is. Asks the server
    (`INFO cluster`), so it raises what redis-py raises when the server cannot be reached."""
    target = parse_redis_url(url)
    if target.mode is not Mode.SINGLE or url.startswith("unix://"):
        return url
    client = make_redis(url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=1)
    try:
        info = await client.info("cluster")
    except ResponseError:  # a server without the section (a proxy, an old Redis): not a cluster
        return url
    finally:
        await client.aclose()
    return cluster_url(url) if int(info.get("cluster_enabled", 0)) else url


def is_cluster(client: AsyncRedis) -> bool:
    return isinstance(client, redis.asyncio.cluster.RedisCluster)


async def check_reachable(client: AsyncRedis) -> None:
    """Raise unless Redis answers: a PING, or for a cluster its slot map (PING would go to every
    master, and a cluster with one master down still serves)."""
    if isinstance(client, redis.asyncio.cluster.RedisCluster):
        await client.initialize()
    else:
        await client.ping()
