"""The kvtier configuration: one frozen dataclass tree, loaded once.

Sources, later wins: built-in defaults, a TOML file, then environment variables
`KVTIER__<SECTION>__<KEY>` and `KVTIER__POOLS__<NAME>__<KEY>`. Everything wrong with the
result is collected and raised together as one `ConfigError`, so an operator fixes a config in
one pass. This is the only module that reads the environment, and only through the mapping
handed to `load_config`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config_schema import (
    NAME_PATTERN,
    NAME_WHAT,
    Invalid,
    absolute_path,
    boolean,
    checked_fields,
    choice,
    did_you_mean,
    eviction_policy,
    integer,
    is_required,
    number,
    setting,
    shown,
    size,
    string,
)
from kvtier.errors import KvtierError
from kvtier.failpoints import SPEC as FAILPOINT
from kvtier.layout import DTYPE_BYTES, BlockLayout

ENV_PREFIX = "KVTIER__"
_REDIS_URL = r"(rediss?|unix)://\S+"
_DEVICE = r"auto|cpu|cuda(:[0-9]+)?"


class ConfigError(KvtierError):
    """The configuration is invalid. `problems` holds one line per problem, key first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(self.problems)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    # id and runtime_dir have no static default: the loader derives them from the host.
    id: str = setting(string(NAME_PATTERN, NAME_WHAT, empty_ok=False), text=True)
    runtime_dir: Path = setting(absolute_path(), text=True)
    shm_group: str = setting(string(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}", "a group name"), "",
                             text=True)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = setting(choice("debug", "info", "warning", "error"), "info", text=True)
    format: str = setting(choice("auto", "json", "console"), "auto", text=True)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = setting(string(_REDIS_URL, "a redis://, rediss:// or unix:// URL"), "", text=True)
    bus_url: str = setting(string(_REDIS_URL, "a redis://, rediss:// or unix:// URL"), "",
                           text=True)
    socket_timeout_s: float = setting(number(gt=0), 5.0)
    connect_timeout_s: float = setting(number(gt=0), 2.0)
    retries: int = setting(integer(0), 3)
    block_ttl_s: int = setting(integer(0), 86400)
    # A tier worker sends a batch's Redis reads and writes as pipelines of at most this many
    # payload bytes each.
    pipeline_bytes: int = setting(size(), 64 << 20)


@dataclass(frozen=True, slots=True)
class EmbeddedRedisConfig:
    binary: str = setting(string(empty_ok=False), "redis-server", text=True)
    maxmemory: str = setting(string(r"(?i)[0-9]+(b|k|kb|m|mb|g|gb)?", "a size like '256mb'",
                                    empty_ok=False), "256mb", text=True)
    maxmemory_policy: str = setting(eviction_policy(), "volatile-lru", text=True)


@dataclass(frozen=True, slots=True)
class BusConfig:
    stream_maxlen: int = setting(integer(1000), 100_000)
    claim_idle_ms: int = setting(integer(1), 30_000)
    max_deliveries: int = setting(integer(1), 5)
    read_count: int = setting(integer(1, 10_000), 256)
    block_ms: int = setting(integer(1, 60_000), 500)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    # The Prometheus endpoint, "host:port" ("" = off). Loopback by default: the numbers reveal
    # traffic patterns, and scraping is meant for the node's own agent. Port 0 picks a free one
    # (written to stats.json as metrics_url).
    listen: str = setting(string(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}", "host:port"),
                          "127.0.0.1:9464", text=True)
    # How often stream lag and pending counts are sampled from Redis.
    stream_sample_s: float = setting(number(gt=0), 5.0)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    shutdown_grace_s: float = setting(number(gt=0), 10.0)
    stats_interval_s: float = setting(number(gt=0), 1.0)
    persist_arena: bool = setting(boolean(), True)
    watchdog_fraction: float = setting(number(gt=0, lt=1), 0.5)
    # Block copies at least this big run in a thread, off the event loop (0: every copy).
    off_loop_copy_bytes: int = setting(size(), 256 << 10)
    # The event loop: uvloop (faster), or asyncio's own (for debugging, and to measure uvloop).
    event_loop: str = setting(choice("uvloop", "asyncio"), "uvloop", text=True)
    # Threads that copy one batch's staged blocks into a tier at the same time (the copies and
    # checksums release the GIL); 0 = min(4, CPU cores).
    copy_threads: int = setting(integer(0, 64), 0)
    # Fault tests only: SIGKILL the daemon at a named point (kvtier/failpoints.py). "" = none.
    failpoint: str = setting(string(FAILPOINT.pattern, "a failpoint name, optionally ':<n>'"), "", text=True)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    high_watermark: float = setting(number(gt=0, le=1), 0.9)
    low_watermark: float = setting(number(gt=0, le=1), 0.75)
    promote_after_hits: int = setting(integer(1), 2)
    prefetch_lease_s: float = setting(number(gt=0), 5.0)
    transfer_timeout_s: float = setting(number(gt=0), 30.0)
    redis_write: str = setting(choice("write-back", "write-through"), "write-back", text=True)
    redis_admit_after_hits: int = setting(integer(0), 0)
    prefetch_to: str = setting(choice("cpu", "gpu"), "cpu", text=True)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One model layout. `name` comes from the `[pools.<name>]` table key."""

    name: str
    model: str = setting(string(empty_ok=False), text=True)
    layers: int = setting(integer(1))
    kv_heads: int = setting(integer(1))
    head_dim: int = setting(integer(1))
    block_tokens: int = setting(integer(1), 16)
    dtype: str = setting(choice(*DTYPE_BYTES), "bfloat16", text=True)
    device: str = setting(string(_DEVICE, "'auto', 'cpu', 'cuda' or 'cuda:N'"), "auto", text=True)
    gpu_blocks: int = setting(integer(0), 64)
    cpu_blocks: int = setting(integer(1), 256)
    # Capacity in bytes instead of blocks (0: use *_blocks): the loader sets *_blocks to how
    # many whole blocks of this layout fit.
    gpu_bytes: int = setting(size(), 0)
    cpu_bytes: int = setting(size(), 0)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)


# Used only when neither the file nor the environment names any pool, so that
# `kvtier daemon` with no config at all starts a small, working development node.
DEMO_POOL = PoolConfig(name="demo", model="demo", layers=4, kv_heads=2, head_dim=64,
                       block_tokens=16, dtype="float16", gpu_blocks=32, cpu_blocks=128)


@dataclass(frozen=True, slots=True)
class Config:
    node: NodeConfig
    log: LogConfig
    redis: RedisConfig
    embedded_redis: EmbeddedRedisConfig
    bus: BusConfig
    daemon: DaemonConfig
    metrics: MetricsConfig
    policy: PolicyConfig
    pools: tuple[PoolConfig, ...]


_SECTIONS: dict[str, type] = {
    "node": NodeConfig,
    "log": LogConfig,
    "redis": RedisConfig,
    "embedded_redis": EmbeddedRedisConfig,
    "bus": BusConfig,
    "daemon": DaemonConfig,
    "metrics": MetricsConfig,
    "policy": PolicyConfig,
}

Origins = dict[tuple[str, ...], str]  # key path -> the env var that set it


def load_config(path: str | os.PathLike[str] | None,
                environ: Mapping[str, str] | None = None) -> Config:
    """Load defaults, then `path` (TOML; None = defaults only), then `KVTIER__*` overrides."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ConfigError([f"{os.fspath(path)}: cannot read config file: {e}"]) from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{os.fspath(path)}: invalid TOML: {e}"]) from e
    origins: Origins = {}
    _apply_env(raw, env, origins, problems)

    values: dict[str, dict[str, Any]] = {}
    for name in raw:
        if name not in _SECTIONS and name != "pools":
            problems.append(f"[{name}]: unknown section"
                            f"{did_you_mean(name, [*_SECTIONS, 'pools'])}{_via(origins, name)}")
    for name, cls in _SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append(f"[{name}]: expected a table, got {shown(table)}")
            table = {}
        defaults = _node_defaults(env) if cls is NodeConfig else {}
        values[name] = _section(cls, table, (name,), origins, problems, defaults)
    pools = _pools(raw.get("pools"), origins, problems)
    _cross_check(values, origins, problems)
    if problems:
        raise ConfigError(problems)
    sections = {name: cls(**values[name]) for name, cls in _SECTIONS.items()}
    return Config(**sections, pools=tuple(pools))


def default_runtime_dir(environ: Mapping[str, str]) -> Path:
    """Where the daemon publishes its descriptor when [node] runtime_dir is not set."""
    if os.geteuid() == 0:
        return Path("/run/kvtier")
    if environ.get("XDG_RUNTIME_DIR", "").startswith("/"):  # the XDG spec ignores relative ones
        return Path(environ["XDG_RUNTIME_DIR"]) / "kvtier"
    return Path(f"/tmp/kvtier-{os.geteuid()}")


def _node_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    node_id = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:64] or "node"
    return {"id": node_id, "runtime_dir": default_runtime_dir(environ)}


def _via(origins: Origins, *path: str) -> str:
    return f" (set by {origins[path]})" if path in origins else ""


def _section(cls: type, table: dict[str, Any], path: tuple[str, ...], origins: Origins,
             problems: list[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Check one table against `cls`; return the valid values, defaults filled in."""
    fields = checked_fields(cls)
    dotted = ".".join(path)
    for key in table:
        if key not in fields:
            problems.append(f"{dotted}.{key}: unknown key{did_you_mean(key, list(fields))}"
                            f"{_via(origins, *path, key)}")
    values: dict[str, Any] = {}
    for key, f in fields.items():
        if key in table:
            try:
                values[key] = f.metadata["check"](table[key])
            except Invalid as e:
                problems.append(f"{dotted}.{key}: {e}{_via(origins, *path, key)}")
        elif key in defaults:
            values[key] = defaults[key]
        elif is_required(f):
            problems.append(f"{dotted}.{key}: required key is missing{_via(origins, *path)}")
        else:
            values[key] = f.default
    return values


def _pools(raw: Any, origins: Origins, problems: list[str]) -> list[PoolConfig]:
    if raw is None:
        return [DEMO_POOL]
    if not isinstance(raw, dict) or not raw:
        problems.append("pools: expected one or more [pools.<name>] tables, got " + shown(raw))
        return []
    pools = []
    for name, table in raw.items():
        if not re.fullmatch(NAME_PATTERN, name):
            problems.append(f"pools.{name}: invalid pool name, expected {NAME_WHAT}"
                            f"{_via(origins, 'pools', name)}")
        elif not isinstance(table, dict):
            problems.append(f"pools.{name}: expected a table, got {shown(table)}")
        else:
            before = len(problems)
            values = _section(PoolConfig, table, ("pools", name), origins, problems, {})
            if len(problems) == before:
                _capacity_from_bytes(name, table, values, origins, problems)
            if len(problems) == before:
                pools.append(PoolConfig(name=name, **values))
    return pools


def _capacity_from_bytes(name: str, table: dict[str, Any], values: dict[str, Any], origins: Origins,
                         problems: list[str]) -> None:
    """`<tier>_bytes` > 0: derive `<tier>_blocks`, the whole blocks of this layout that fit."""
    bb = BlockLayout(values["model"], values["layers"], values["kv_heads"], values["head_dim"],
                     values["block_tokens"], values["dtype"]).block_bytes
    for tier in ("gpu", "cpu"):
        key, blocks = f"{tier}_bytes", f"{tier}_blocks"
        if not values[key]:
            continue
        where, n = f"pools.{name}.{key}", values[key] // bb
        if not n:
            problems.append(f"{where}: {values[key]} bytes hold no whole block of this layout "
                            f"({bb} bytes){_via(origins, 'pools', name, key)}")
        elif blocks in table and values[blocks] != n:  # both given (a formatted config): must agree
            problems.append(f"{where}: {values[key]} bytes are {n} blocks of {bb} bytes, but {blocks} "
                            f"is {values[blocks]}; set one of them{_via(origins, 'pools', name, key)}")
        else:
            values[blocks] = n


def _cross_check(values: dict[str, dict[str, Any]], origins: Origins,
                 problems: list[str]) -> None:
    """Checks that span keys; each runs only when the keys it reads are individually valid."""
    bus, redis, policy = values["bus"], values["redis"], values["policy"]
    if "block_ms" in bus and "socket_timeout_s" in redis:
        if bus["block_ms"] >= redis["socket_timeout_s"] * 1000:
            problems.append(
                f"bus.block_ms: must be less than redis.socket_timeout_s * 1000 "
                f"({bus['block_ms']} >= {redis['socket_timeout_s'] * 1000:g}), or every blocking "
                f"stream read would hit the socket timeout"
                f"{_via(origins, 'bus', 'block_ms')}{_via(origins, 'redis', 'socket_timeout_s')}")
    if "low_watermark" in policy and "high_watermark" in policy:
        if policy["low_watermark"] >= policy["high_watermark"]:
            problems.append(
                f"policy.low_watermark: must be less than policy.high_watermark "
                f"({policy['low_watermark']:g} >= {policy['high_watermark']:g})"
                f"{_via(origins, 'policy', 'low_watermark')}"
                f"{_via(origins, 'policy', 'high_watermark')}")


def _apply_env(raw: dict[str, Any], environ: Mapping[str, str], origins: Origins,
               problems: list[str]) -> None:
    """Merge `KVTIER__*` variables into the raw tree, remembering which variable set what."""
    for var in sorted(environ):
        if not var.upper().startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].split("__")
        if parts[0].lower() == "pools":
            if len(parts) != 3 or not all(parts):
                problems.append(f"{var}: expected KVTIER__POOLS__<NAME>__<KEY>")
                continue
            pools = raw.setdefault("pools", {})
            if not isinstance(pools, dict):
                continue  # the file's own error is reported by _pools
            # Env names are usually upper case: reuse a file pool that matches regardless of case.
            name = next((n for n in pools if n.lower() == parts[1].lower()), parts[1].lower())
            path, cls = ("pools", name, parts[2].lower()), PoolConfig
            if name not in pools:
                origins[("pools", name)] = var
            table = pools.setdefault(name, {})
        else:
            if len(parts) != 2 or not all(parts):
                problems.append(f"{var}: expected KVTIER__<SECTION>__<KEY>")
                continue
            path = (parts[0].lower(), parts[1].lower())
            cls = _SECTIONS.get(path[0])
            if path[0] not in raw:
                origins[path[:1]] = var
            table = raw.setdefault(path[0], {})
        if isinstance(table, dict):
            table[path[-1]] = _env_value(environ[var], cls, path[-1])
            origins[path] = var


def _env_value(text: str, cls: type | None, key: str) -> Any:
    """A TOML value when `text` parses as one, else the text itself.

    For string keys the text is kept verbatim unless it is a quoted TOML string, so that
    `KVTIER__NODE__ID=0042` stays the string "0042".
    """
    try:
        value = tomllib.loads(f"v = {text}")["v"] if "\n" not in text else text
    except tomllib.TOMLDecodeError:
        return text
    field = checked_fields(cls).get(key) if cls is not None else None
    if field is not None and field.metadata["text"] and not isinstance(value, str):
        return text
    return value


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain JSON-able data, shaped like the TOML file."""
    out: dict[str, Any] = {name: _plain(getattr(cfg, name)) for name in _SECTIONS}
    out["pools"] = {pool.name: _plain(pool) for pool in cfg.pools}
    return out


def _plain(section: Any) -> dict[str, Any]:
    return {key: str(v) if isinstance(v := getattr(section, key), Path) else v
            for key in checked_fields(type(section))}


_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@|([?&]password=)[^&]*")


def redact_url(url: str) -> str:
    """A Redis URL fit for printing: its password (userinfo or query) replaced by ***."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}***@" if m.group(1) else f"{m.group(2)}***", url)


def format_config(cfg: Config, *, redact: bool = False) -> str:
    """The resolved config as TOML text that `load_config` reads back to an equal Config.
    `redact`: passwords in the Redis URLs are replaced by *** (for printing)."""
    lines = ["# kvtier resolved configuration"]
    data = config_to_dict(cfg)
    if redact:
        data["redis"] = {k: redact_url(v) if k in ("url", "bus_url") else v for k, v in data["redis"].items()}
    pools = data.pop("pools")
    tables = [([name], table) for name, table in data.items()]
    tables += [(["pools", name], table) for name, table in pools.items()]
    for path, table in tables:
        lines.append(f"\n[{'.'.join(_toml_key(p) for p in path)}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # A TOML basic string: escape quotes, backslashes and control characters only.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
