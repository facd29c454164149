"""Loading the config: defaults, a TOML file, then KVTIER__* environment overrides; every
problem collected into one ConfigError."""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping
from typing import Any

from kvtier.config.fields import NAME_PATTERN, NAME_WHAT, Invalid, checked_fields, did_you_mean, is_required, shown
from kvtier.config.schema import (
    DEMO_POOL,
    ENV_PREFIX,
    SECTIONS,
    Config,
    ConfigError,
    NodeConfig,
    Origins,
    PoolConfig,
)
from kvtier.layout import BlockLayout
from kvtier.runtime import default_runtime_dir


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
        if name not in SECTIONS and name != "pools":
            problems.append(f"[{name}]: unknown section"
                            f"{did_you_mean(name, [*SECTIONS, 'pools'])}{_via(origins, name)}")
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            problems.append(f"[{name}]: expected a table, got {shown(table)}")
            table = {}
        defaults = _node_defaults(env) if cls is NodeConfig else {}
        values[name] = _section(cls, table, (name,), origins, problems, defaults)
    pools = _pools(raw.get("pools"), origins, problems)
    _cross_check(values, origins, problems)
    if "dir" in values["disk"] and not values["disk"]["dir"]:
        for p in pools:
            if p.disk_bytes:
                problems.append(f"pools.{p.name}.disk_bytes: a disk tier needs [disk] dir, the directory of its "
                                f"block file{_via(origins, 'pools', p.name, 'disk_bytes')}")
    if problems:
        raise ConfigError(problems)
    sections = {name: cls(**values[name]) for name, cls in SECTIONS.items()}
    return Config(**sections, pools=tuple(pools))


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
    pins = values["pins"]
    if "max_ttl_s" in pins and redis.get("block_ttl_s") and pins["max_ttl_s"] > redis["block_ttl_s"]:
        problems.append(
            f"pins.max_ttl_s: must be at most redis.block_ttl_s ({pins['max_ttl_s']} > {redis['block_ttl_s']}), or "
            f"a block's Redis copy could expire while it is pinned"
            f"{_via(origins, 'pins', 'max_ttl_s')}{_via(origins, 'redis', 'block_ttl_s')}")
    index = values["prefix_index"]
    if "refresh_s" in index and "ttl_s" in index and index["refresh_s"] >= index["ttl_s"]:
        problems.append(
            f"prefix_index.refresh_s: must be less than prefix_index.ttl_s ({index['refresh_s']:g} >= "
            f"{index['ttl_s']}), or a live node's entries would expire between refreshes"
            f"{_via(origins, 'prefix_index', 'refresh_s')}{_via(origins, 'prefix_index', 'ttl_s')}")
    ingest = values["ingest"]
    if ingest.get("engines", "").strip():
        if not index.get("enabled"):
            problems.append(f"ingest.engines: needs prefix_index.enabled = true (the engines' blocks go into the "
                            f"prefix index){_via(origins, 'ingest', 'engines')}")
        if not ingest.get("pool"):
            problems.append(f"ingest.pool: name the pool the engines' blocks are indexed under"
                            f"{_via(origins, 'ingest', 'pool')}")


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
            cls = SECTIONS.get(path[0])
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
