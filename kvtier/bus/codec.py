"""msgpack codec for events. Decoding treats input as hostile: every field is type- and size-checked.

Wire form: a msgpack map {"v": version, "t": type, "p": producer, "e": epoch, "s": seq, "b": body}
where body maps field names to values; or, for several events a producer sends to one stream at
once, an array of such maps (a packed entry: one XADD, one read and one ack for the lot, each
event keeping its own seq). Validation is derived from the dataclass annotations, so a new event
type needs no codec change.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

import msgpack

from kvtier.core.events import EVENT_TYPES, SCHEMA_VERSION, Envelope, Event, StagedBlock, Tier, TokenIds, staged_block
from kvtier.errors import MalformedEvent
from kvtier.keys import KEY_BYTES, BlockKey

MAX_ENTRY_BYTES = 4 << 20
MAX_ITEMS = 65_536
MAX_STR = 256
NAME_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")  # used with fullmatch: "$" would admit "\n"
I64_MAX = (1 << 63) - 1


MAX_PACKED = 4096  # events in one packed entry

# Fields added to an event type after it shipped, with the value they take when absent: left
# out on the wire at that value and accepted missing, so clients and daemons one release apart
# still understand each other's events of that type (any other field set is exact).
LATE_FIELDS: Mapping[str, Mapping[str, object]] = MappingProxyType({"put": MappingProxyType({"tenant": ""})})


def encode(env: Envelope) -> bytes:
    packed: bytes = msgpack.packb(_wire(env), use_bin_type=True)
    return packed


def encode_packed(envs: Sequence[Envelope]) -> bytes:
    """Several envelopes as one entry's payload (1 to MAX_PACKED of them)."""
    if not 1 <= len(envs) <= MAX_PACKED:
        raise ValueError(f"a packed entry holds 1 to {MAX_PACKED} events, not {len(envs)}")
    packed: bytes = msgpack.packb([_wire(e) for e in envs], use_bin_type=True)
    return packed


def _wire(env: Envelope) -> dict[str, object]:
    late = LATE_FIELDS.get(env.event.TYPE, {})
    values = ((f.name, getattr(env.event, f.name)) for f in dataclasses.fields(env.event))
    body = {name: _to_wire(v) for name, v in values if name not in late or v != late[name]}
    return {"v": SCHEMA_VERSION, "t": env.event.TYPE, "p": env.producer, "e": env.epoch, "s": env.seq, "b": body}


def _to_wire(value: object) -> object:
    if isinstance(value, enum.Enum):  # Tier as its int, the str enums (Cause, Reason, Failure) as their str
        return value.value
    if isinstance(value, StagedBlock):
        wire = [value.key, value.parent, value.slot, value.gen]
        return wire + [True] if value.granted else wire
    if isinstance(value, tuple):  # a batch's columns, or its blocks: thousands of items, so no call per item
        if all(type(v) in _PLAIN for v in value):
            return list(value)
        if all(type(v) is StagedBlock for v in value):
            return [[b.key, b.parent, b.slot, b.gen, True] if b.granted else [b.key, b.parent, b.slot, b.gen]
                    for b in value]
        return [_to_wire(v) for v in value]
    return value


_PLAIN = frozenset({bytes, int, str, bool, float, type(None)})  # what goes on the wire as it is


def decode(data: object) -> Envelope:
    """bytes -> Envelope, or MalformedEvent with a reason fit for the dead-letter stream."""
    return _envelope(_unpack(data))


def decode_entry(data: object) -> list[Envelope]:
    """An entry's payload -> its envelopes: one, or the events of a packed entry, in order. A
    packed entry with one bad event is rejected whole (MalformedEvent names the event)."""
    obj = _unpack(data)
    if not isinstance(obj, list):
        return [_envelope(obj)]
    if not 1 <= len(obj) <= MAX_PACKED:
        raise MalformedEvent(f"a packed entry must hold 1 to {MAX_PACKED} events, got {len(obj)}")
    out = []
    for i, one in enumerate(obj):
        try:
            out.append(_envelope(one))
        except MalformedEvent as e:
            raise MalformedEvent(f"packed event {i}: {e.reason}") from e
    return out


def _unpack(data: object) -> object:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedEvent(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > MAX_ENTRY_BYTES:
        raise MalformedEvent(f"entry of {len(data)} bytes exceeds {MAX_ENTRY_BYTES}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_ENTRY_BYTES,
            max_str_len=MAX_STR * 4,
            max_array_len=MAX_ITEMS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types on bad input
        raise MalformedEvent(f"not valid msgpack: {type(e).__name__}: {e}") from e
    return obj


def _envelope(obj: object) -> Envelope:
    if not isinstance(obj, dict):
        raise MalformedEvent("top level must be a map")
    if set(obj) != {"v", "t", "p", "e", "s", "b"}:
        raise MalformedEvent(f"envelope fields must be v,t,p,e,s,b; got {sorted(map(str, obj))}")
    if type(obj["v"]) is not int or obj["v"] != SCHEMA_VERSION:  # True == 1 and 1.0 == 1 in Python
        raise MalformedEvent(f"unsupported schema version {obj['v']!r}")
    cls = EVENT_TYPES.get(obj["t"]) if isinstance(obj["t"], str) else None
    if cls is None:
        raise MalformedEvent(f"unknown event type {obj['t']!r}")
    producer = _name("producer", obj["p"])
    epoch = _uint("epoch", obj["e"])
    seq = _uint("seq", obj["s"])
    body = obj["b"]
    if not isinstance(body, dict):
        raise MalformedEvent("body must be a map")
    fields = _SCHEMAS[cls.TYPE]
    names = _FIELD_NAMES[cls.TYPE]
    if body.keys() != names and (late := LATE_FIELDS.get(cls.TYPE)) is not None:
        body = {**late, **body}  # a late field left out: its value when absent
    if body.keys() != names:
        missing = sorted(names - set(body))
        extra = sorted(map(str, set(body) - names))
        raise MalformedEvent(f"{cls.TYPE}: missing fields {missing}, unexpected fields {extra}")
    # Each value is checked against its field's annotation, so the call below is well typed.
    kwargs: dict[str, Any] = {name: check(where, body[name]) for name, where, check in fields}
    event: Event = cls(**kwargs)
    return Envelope(event=event, producer=producer, epoch=epoch, seq=seq)


Check = Callable[[str, object], object]  # check(where, value): the value as the field holds it, or MalformedEvent


def _schema(type_name: str, cls: type) -> tuple[tuple[str, str, Check], ...]:
    """(field name, where it is named in errors, its check) for each field of an event type. The
    checks are built once from the annotations, so decoding does no type dispatch per value."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, f"{type_name}.{f.name}", _checker(f.name, hints[f.name])) for f in dataclasses.fields(cls))


def _checker(name: str, hint: object) -> Check:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is BlockKey or hint is bytes:
        return _key
    if hint is TokenIds:
        return _tokens
    if hint is str:
        return _name if name in ("pool", "segment") else _tenant if name == "tenant" else _str
    if hint is int:
        return _uint if name == "ttl_s" else _int
    if hint is bool:
        return _bool
    if hint is Tier:
        return _tier
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return partial(_str_enum, hint)
    if hint is StagedBlock:
        return _staged
    if origin in (typing.Union, types.UnionType):
        arms = [_checker(name, a) for a in args if a is not type(None)]
        names = ", ".join(v for a in args if isinstance(a, type) and issubclass(a, enum.StrEnum) for v in a)
        return partial(_union, type(None) in args, arms, names)
    if origin is tuple and args == (StagedBlock, Ellipsis):
        return _staged_blocks
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return partial(_tuple, _checker(name, args[0]))
    raise TypeError(f"no validator for {name}: {hint!r}")  # a programming error, caught at import


def _tokens(where: str, value: object) -> TokenIds:
    if not isinstance(value, bytes) or len(value) % 4:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise MalformedEvent(f"{where}: expected u32 token ids (a multiple of 4 bytes), got {got}")
    return TokenIds(value)


def _str(where: str, value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_STR:
        raise MalformedEvent(f"{where}: expected a string of at most {MAX_STR} chars")
    return value


def _tier(where: str, value: object) -> Tier:
    if type(value) is not int or value not in Tier._value2member_map_:
        raise MalformedEvent(f"{where}: unknown tier {value!r}")
    return Tier(value)


def _str_enum(hint: type[enum.StrEnum], where: str, value: object) -> enum.StrEnum:
    # Type first: an unhashable value (a list, a map) must not reach the dict lookup.
    if type(value) is not str or value not in hint._value2member_map_:
        raise MalformedEvent(f"{where}: expected one of {', '.join(hint)}, got {str(value)[:80]!r}")
    return hint(value)


def _staged(where: str, value: object) -> StagedBlock:
    """One staged block, each field checked and what is wrong named (`_staged_blocks` takes the
    common block itself, without a call)."""
    if type(value) is not list or not (len(value) == 4 or (len(value) == 5 and value[4] is True)):
        raise MalformedEvent(f"{where}: staged block must be [key, parent, slot, gen] (+ true: granted)")
    k, p, slot, gen = value[0], value[1], value[2], value[3]
    return StagedBlock(
        key=_key(where + ".key", k),
        parent=None if p is None else _key(where + ".parent", p),
        slot=_uint(where + ".slot", slot),
        gen=_uint(where + ".gen", gen),
        granted=len(value) == 5,
    )


def _staged_blocks(where: str, value: object) -> tuple[StagedBlock, ...]:
    """A put's blocks, `_staged` each: the common block checked in this one loop, no call a block
    (a put names up to thousands, and the daemon decodes every one); anything else goes through
    `_staged`, which says what is wrong and where."""
    if not isinstance(value, list):
        raise MalformedEvent(f"{where}: expected a list")
    if len(value) > MAX_ITEMS:
        raise MalformedEvent(f"{where}: more than {MAX_ITEMS} items")
    out = []
    for i, v in enumerate(value):
        if type(v) is list and (len(v) == 4 or (len(v) == 5 and v[4] is True)):
            k, p, slot, gen = v[0], v[1], v[2], v[3]
            if (type(k) is bytes and len(k) == KEY_BYTES and (p is None or (type(p) is bytes and len(p) == KEY_BYTES))
                    and type(slot) is int and 0 <= slot <= I64_MAX and type(gen) is int and 0 <= gen <= I64_MAX):
                out.append(staged_block((k, p, slot, gen, len(v) == 5)))
                continue
        out.append(_staged(f"{where}[{i}]", v))
    return tuple(out)


def _union(optional: bool, arms: list[Check], names: str, where: str, value: object) -> object:
    if value is None and optional:
        return None
    if len(arms) == 1:
        return arms[0](where, value)
    # Several arms (`Reason | Failure`): the first that accepts the value; their values are disjoint.
    for arm in arms:
        try:
            return arm(where, value)
        except MalformedEvent:
            continue
    raise MalformedEvent(f"{where}: expected one of {names}, got {str(value)[:80]!r}")


def _tuple(item: Check, where: str, value: object) -> tuple[object, ...]:
    if not isinstance(value, list):
        raise MalformedEvent(f"{where}: expected a list")
    if len(value) > MAX_ITEMS:
        raise MalformedEvent(f"{where}: more than {MAX_ITEMS} items")
    try:
        return tuple([item(where, v) for v in value])  # no "where[i]" built per item on the way
    except MalformedEvent:
        for i, v in enumerate(value):  # again, to name the bad item
            item(f"{where}[{i}]", v)
        raise


def _key(where: str, value: object) -> BlockKey:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise MalformedEvent(f"{where}: expected a {KEY_BYTES}-byte key, got {got}")
    return BlockKey(value)


def _name(where: str, value: object) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise MalformedEvent(f"{where}: expected a name matching {NAME_RE.pattern}, got {str(value)[:80]!r}")
    return value


def _tenant(where: str, value: object) -> str:
    """A tenant: a name, or "" for none (it may become a metric label: no free text)."""
    return "" if value == "" else _name(where, value)


def _int(where: str, value: object) -> int:
    if type(value) is not int or not (-I64_MAX - 1 <= value <= I64_MAX):
        raise MalformedEvent(f"{where}: expected a 64-bit integer, got {type(value).__name__}")
    return value


def _bool(where: str, value: object) -> bool:
    if type(value) is not bool:
        raise MalformedEvent(f"{where}: expected true or false, got {str(value)[:80]!r}")
    return value


def _uint(where: str, value: object) -> int:
    v = _int(where, value)
    if v < 0:
        raise MalformedEvent(f"{where}: must be >= 0")
    return v


_SCHEMAS = {name: _schema(name, cls) for name, cls in EVENT_TYPES.items()}  # (field, where, check) per type
_FIELD_NAMES = {name: frozenset(f[0] for f in fields) for name, fields in _SCHEMAS.items()}
