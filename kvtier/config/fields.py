"""Value checkers that the config dataclasses attach to their fields.

Each config field is declared with `setting(check, default)`. The check converts a raw TOML or
environment value into the field's type, or raises `Invalid` with a message that completes
"<dotted.key>: ...". The loader (`kvtier.config.loader`) walks the dataclass fields, so the schema,
the defaults and the documentation of a key live in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.redis_url import parse_redis_url, redact_url

Check = Callable[[Any], Any]

NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
NAME_WHAT = "1-64 characters from [A-Za-z0-9_.-]"


class Invalid(ValueError):
    """A value failed its check; the message completes '<key>: ...'."""


def setting(check: Check, default: Any = dataclasses.MISSING, *, text: bool = False) -> Any:
    """Declare a config key. `text` marks string-like keys: env values are kept verbatim."""
    return dataclasses.field(default=default, metadata={"check": check, "text": text})


def checked_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of a config dataclass that are settable keys, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if "check" in f.metadata}


def is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def did_you_mean(word: str, options: list[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `true` must never pass for a count.
    return isinstance(value, int) and not isinstance(value, bool)


def integer(lo: int | None = None, hi: int | None = None) -> Check:
    if lo is not None and hi is not None:
        want = f"an integer in {lo}..{hi}"
    elif lo is not None:
        want = f"an integer >= {lo}"
    else:
        want = "an integer"

    def check(value: Any) -> int:
        if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise Invalid(f"expected {want}, got {shown(value)}")
        return value

    return check


def number(*, gt: float | None = None, lt: float | None = None, le: float | None = None,
           ge: float | None = None) -> Check:
    """A finite float; ints are accepted and converted."""
    upper = f"{lt:g})" if lt is not None else (f"{le:g}]" if le is not None else "")
    if gt is not None and upper:
        want = f"a number in ({gt:g}, {upper}"
    elif gt is not None:
        want = f"a number > {gt:g}"
    elif ge is not None:
        want = f"a number >= {ge:g}"
    else:
        want = "a number"

    def check(value: Any) -> float:
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
        x = float(value) if ok else math.nan
        if not ok or (gt is not None and x <= gt) or (lt is not None and x >= lt) or (
                le is not None and x > le) or (ge is not None and x < ge):
            raise Invalid(f"expected {want}, got {shown(value)}")
        return x

    return check


def boolean() -> Check:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise Invalid(f"expected true or false, got {shown(value)}")
        return value

    return check


def string(pattern: str | None = None, what: str = "", *, empty_ok: bool = True) -> Check:
    """A string, optionally matching `pattern` (the empty string is allowed when `empty_ok`)."""
    compiled = re.compile(pattern) if pattern else None
    want = f"a string of {what}" if what else ("a string" if empty_ok else "a non-empty string")

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise Invalid(f"expected {want}, got {shown(value)}")
        if value == "" and not empty_ok:
            raise Invalid(f"expected {want}, got ''")
        if value and compiled is not None and not compiled.fullmatch(value):
            raise Invalid(f"expected {want}, got {shown(value)}")
        return value

    return check


def redis_url() -> Check:
    """A Redis URL that kvtier.redis_url accepts, or "" (the embedded default)."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise Invalid(f"expected a Redis URL string, got {shown(value)}")
        if value:
            try:
                parse_redis_url(value)
            except ValueError as e:
                raise Invalid(f"{e}; got {shown(redact_url(value))}") from None
        return value

    return check


def choice(*options: str) -> Check:
    want = ", ".join(repr(o) for o in options)

    def check(value: Any) -> str:
        if value not in options or not isinstance(value, str):
            raise Invalid(f"expected one of {want}; got {shown(value)}")
        return value

    return check


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def size() -> Check:
    """A byte count: an integer, or a string like '512MiB', '16GiB', '2GB' (1 GB = 10^9 bytes)."""
    want = "a size in bytes: an integer >= 0 or a string like '512MiB' or '16GiB'"

    def check(value: Any) -> int:
        if _is_int(value) and value >= 0:
            return value
        m = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if unit is None:
            raise Invalid(f"expected {want}, got {shown(value)}")
        return int(float(m.group(1)) * unit)

    return check


def table(value: Check, key_pattern: str = r"[A-Za-z0-9_.:/-]{0,128}") -> Check:
    """A TOML table of name -> value (each checked by `value`), held as sorted (name, value) pairs:
    frozen, like every config value."""
    def check(raw: Any) -> tuple[tuple[str, Any], ...]:
        if not isinstance(raw, dict):
            raise Invalid(f"expected a table of name = value, got {shown(raw)}")
        out = []
        for k, v in sorted(raw.items()):
            if not re.fullmatch(key_pattern, k):
                raise Invalid(f"bad name {shown(k)} (must match {key_pattern})")
            try:
                out.append((k, value(v)))
            except Invalid as e:
                raise Invalid(f"{k}: {e}") from None
        return tuple(out)

    return check


def absolute_path() -> Check:
    def check(value: Any) -> Path:
        if not isinstance(value, str) or not value.startswith("/"):
            raise Invalid(f"expected an absolute path, got {shown(value)}")
        return Path(value)

    return check


def eviction_policy() -> Check:
    # The embedded redis holds the bus streams next to the blocks. A streams key has no TTL,
    # so only volatile-* policies (or noeviction) leave the streams and groups alone.
    allowed = choice("volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl",
                     "noeviction")

    def check(value: Any) -> str:
        if isinstance(value, str) and value.startswith("allkeys-"):
            raise Invalid(
                f"{value!r} is not allowed: this redis also holds the bus streams and consumer "
                "groups, and an allkeys-* policy would evict them under memory pressure, losing "
                "events and pending entries; use a volatile-* policy (blocks carry a TTL)"
            )
        return allowed(value)

    return check
