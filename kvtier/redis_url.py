"""The Redis URLs kvtier accepts, parsed once and without I/O (the config checks them with this).

- `redis://[user:pass@]host:port[/db][?opts]`, `rediss://...` (TLS), `unix:///path[?db=n]`: one
  server. The daemon asks a `redis[s]://` server at start whether it is a cluster node, and if
  so treats the URL as a cluster seed (`cluster_url`), so pointing it at one master just works.
- `redis+cluster://[user:pass@]host:port[,host:port...][?opts]`, `rediss+cluster://...`: a Redis
  (or Valkey) Cluster; every node listed is a seed, and any one reachable is enough.
- `redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db][?opts]`,
  `rediss+sentinel://...`: the master that these Sentinels name `service`. The credentials and
  TLS are the master's; `sentinel_username` and `sentinel_password` in the query are the
  Sentinels' own (they often have none).

Options (`?...`) are redis-py's URL options (`ssl_ca_certs=...`, `password=...`). A port left out
is 6379 (26379 for a Sentinel).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from urllib.parse import parse_qsl, urlencode

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_URL = re.compile(r"(?P<scheme>[a-z+]+)://(?:(?P<auth>[^@/?]*)@)?(?P<hosts>[^/?]*)(?P<path>/[^?]*)?(?:\?(?P<query>.*))?")
_HOST = re.compile(r"(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(?::(?P<port>[0-9]{1,5}))?")
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


class Mode(Enum):
    SINGLE = "single"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    mode: Mode
    # What redis-py's `from_url` takes for one server: the URL itself (SINGLE), or the first
    # node's address with the URL's credentials, TLS, db and options (CLUSTER, SENTINEL).
    node_url: str
    # Cluster seeds or Sentinels, as (host, port); empty for SINGLE.
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""  # SENTINEL: the master's name
    sentinel_options: tuple[tuple[str, str], ...] = ()  # SENTINEL: sentinel_username/_password

    @property
    def tls(self) -> bool:
        return self.node_url.startswith("rediss://")


def parse_redis_url(url: str) -> RedisTarget:
    """Parse a kvtier Redis URL, or raise ValueError saying what is wrong with it."""
    m = _URL.fullmatch(url)
    if m is None or m["scheme"] not in SCHEMES:
        raise ValueError(f"expected a URL starting with one of {', '.join(s + '://' for s in SCHEMES)}")
    scheme = m["scheme"]
    if scheme in ("redis", "rediss", "unix"):
        if scheme != "unix" and not m["hosts"]:
            raise ValueError("a redis:// URL needs a host")
        if scheme != "unix" and "," in m["hosts"]:
            raise ValueError("several hosts: use redis+cluster:// for a cluster or redis+sentinel:// for Sentinels")
        return RedisTarget(Mode.SINGLE, url)
    base, kind = scheme.split("+")
    mode = Mode.CLUSTER if kind == "cluster" else Mode.SENTINEL
    nodes = _hosts(m["hosts"], DEFAULT_PORT if mode is Mode.CLUSTER else DEFAULT_SENTINEL_PORT, scheme)
    parts = [p for p in (m["path"] or "").split("/") if p]
    query = parse_qsl(m["query"] or "", keep_blank_values=True)
    sentinel = tuple((k, v) for k, v in query if k in SENTINEL_OPTIONS)
    query = [(k, v) for k, v in query if k not in SENTINEL_OPTIONS]
    if mode is Mode.CLUSTER:
        if sentinel:
            raise ValueError(f"{sentinel[0][0]} applies to redis+sentinel:// URLs only")
        if parts and parts != ["0"]:
            raise ValueError("a Redis Cluster has only database 0")
        db, service = "0", ""
    else:
        if not parts or len(parts) > 2:
            raise ValueError("a redis+sentinel:// URL names the master: .../<service name>[/<db>]")
        service, db = parts[0], parts[1] if len(parts) == 2 else "0"
        if not db.isdigit():
            raise ValueError(f"database must be a number, got {db!r}")
    host, port = nodes[0]
    auth = f"{m['auth']}@" if m["auth"] is not None else ""
    node_url = f"{base}://{auth}{_bracketed(host)}:{port}/{db}" + (f"?{urlencode(query)}" if query else "")
    return RedisTarget(mode, node_url, nodes, service, sentinel)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address, in a URL


def _hosts(text: str, default_port: int, scheme: str) -> tuple[tuple[str, int], ...]:
    if not text:
        raise ValueError(f"a {scheme}:// URL needs at least one host:port")
    out = []
    for part in text.split(","):
        h = _HOST.fullmatch(part)
        if h is None:
            raise ValueError(f"not a host[:port]: {part!r}")
        port = int(h["port"]) if h["port"] else default_port
        if not 0 < port < 65536:
            raise ValueError(f"port out of range in {part!r}")
        out.append((h["host"].strip("[]"), port))
    return tuple(out)


_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@|([?&](?:sentinel_)?password=)[^&]*")


def redact_url(url: str) -> str:
    """A Redis URL fit for printing: its passwords (userinfo or query) replaced by ***."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}***@" if m.group(1) else f"{m.group(2)}***", url)


def cluster_url(url: str) -> str:
    """The redis+cluster:// form of a one-server redis[s]:// URL whose server turned out to be a
    cluster node: the same host, credentials and options, as the one seed."""
    m = _URL.fullmatch(url)
    if m is None or m["scheme"] not in ("redis", "rediss"):
        raise ValueError("only a redis:// or rediss:// URL can name a cluster node")
    if (m["path"] or "/").strip("/") not in ("", "0"):
        raise ValueError("a Redis Cluster has only database 0; drop the /<db> from the URL")
    auth = f"{m['auth']}@" if m["auth"] is not None else ""
    return f"{m['scheme']}+cluster://{auth}{m['hosts']}" + (f"?{m['query']}" if m["query"] else "")
