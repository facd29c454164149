"""Printing a config: as a dict, or as TOML with Redis passwords hidden."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvtier.config.fields import checked_fields
from kvtier.config.schema import SECTIONS, Config
from kvtier.redis_url import redact_url


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain JSON-able data, shaped like the TOML file."""
    out: dict[str, Any] = {name: _plain(getattr(cfg, name)) for name in SECTIONS}
    out["pools"] = {pool.name: _plain(pool) for pool in cfg.pools}
    return out


def _plain(section: Any) -> dict[str, Any]:
    return {key: str(v) if isinstance(v := getattr(section, key), Path) else dict(v) if isinstance(v, tuple) else v
            for key in checked_fields(type(section))}


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
    if isinstance(value, dict):  # a table setting (config/fields.py `table`), inline
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # A TOML basic string: escape quotes, backslashes and control characters only.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
