"""The compatibility manifest: which models' KV a pool holds, per key namespace. Pure.

Every integration keys its blocks under a namespace (the weights' identity, the engine, the page
layout; kvtier/integrations/weights.py). The keys are hashes, so nothing in Redis or a tier says
whose blocks they are. The manifest does: one readable entry per namespace, in a Redis hash per
pool (`kvtier:manifest:{pool}`, written by the integrations through the client, read by the
daemon for `kvtier status`), plus what each namespace stored.

It is also a guard. Two engines that compute the same namespace must lay out the same page
bytes; if the entry in Redis says otherwise (an engine upgrade that changed the layout without a
field that is in the namespace, say), the newcomer is refused with both sides in the error and
never reads a block under that namespace.

Entries come back from Redis, so they are untrusted: bounded, typed, or dropped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_ENTRY_BYTES = 16 << 10  # an entry larger than this is not believed
NAMESPACE_ID_CHARS = 32  # hex


def manifest_key(pool: str) -> str:
    return f"kvtier:manifest:{pool}"


def stored_key(pool: str) -> str:
    return f"kvtier:manifest:{pool}:stored"


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    namespace: str  # hex id of the key namespace
    engine: str  # "vllm-connector", "vllm-tier", "sglang-hicache", ...
    engine_version: str
    model: str  # as served: readable only
    weights: dict[str, Any]  # WeightsIdentity.readable(): content digest, config, quantization, ...
    page: dict[str, Any]  # what the engine measured of its pages: bytes, tokens, dtype, layout
    extra: dict[str, Any] = field(default_factory=dict)  # groups, tp size, ...

    def to_json(self) -> bytes:
        raw = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        if len(raw) > MAX_ENTRY_BYTES:
            raise ValueError(f"a manifest entry of {len(raw)} bytes (at most {MAX_ENTRY_BYTES})")
        return raw

    @classmethod
    def from_json(cls, raw: bytes | str) -> ManifestEntry:
        """ValueError for anything but a well-formed entry."""
        if len(raw) > MAX_ENTRY_BYTES:
            raise ValueError(f"a manifest entry of {len(raw)} bytes (at most {MAX_ENTRY_BYTES})")
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("a manifest entry is a JSON object")
        out: dict[str, Any] = {}
        for name, kind in (("namespace", str), ("engine", str), ("engine_version", str), ("model", str),
                           ("weights", dict), ("page", dict), ("extra", dict)):
            v = d.get(name, {} if kind is dict and name == "extra" else None)
            if not isinstance(v, kind):
                raise ValueError(f"manifest entry field {name!r} is not a {kind.__name__}")
            out[name] = v
        if not valid_namespace(out["namespace"]):
            raise ValueError("manifest entry namespace is not a hex id")
        return cls(**out)


def valid_namespace(ns: str) -> bool:
    return len(ns) == NAMESPACE_ID_CHARS and all(c in "0123456789abcdef" for c in ns)


def conflict(mine: ManifestEntry, theirs: ManifestEntry) -> str | None:
    """Why `mine` may not use the namespace `theirs` registered first; None when it may. The page
    must be the same; the readable fields (model name, revision) may differ."""
    if mine.namespace != theirs.namespace:
        return None
    differ = sorted(k for k in set(mine.page) | set(theirs.page) if mine.page.get(k) != theirs.page.get(k))
    if not differ:
        return None
    shown = ", ".join(f"{k}: {theirs.page.get(k)!r} registered, {mine.page.get(k)!r} here" for k in differ)
    return (f"namespace {mine.namespace} is registered for other page bytes ({shown}) by "
            f"{theirs.engine} {theirs.engine_version} serving {theirs.model!r}; its blocks cannot be this "
            "engine's. Refused: every lookup is a miss. Give this deployment its own salt, or report the "
            "engine version: a field that changes the page bytes is missing from the namespace")


@dataclass(frozen=True, slots=True)
class ModelHoldings:
    """One namespace as `kvtier status` shows it."""

    entry: ManifestEntry
    stored_blocks: int
    stored_bytes: int


def holdings(entries: dict[bytes | str, bytes | str], stored: dict[bytes | str, bytes | str]
             ) -> tuple[list[ModelHoldings], int]:
    """The pool's namespaces from its two Redis hashes, largest first, and how many entries were
    dropped as malformed."""
    counts: dict[str, int] = {}
    for k, v in stored.items():
        name = k.decode() if isinstance(k, bytes) else k
        try:
            counts[name] = int(v)
        except ValueError:
            continue
    out, bad = [], 0
    for k, raw in entries.items():
        try:
            e = ManifestEntry.from_json(raw)
        except (ValueError, TypeError):
            bad += 1
            continue
        name = k.decode() if isinstance(k, bytes) else k
        if name != e.namespace:
            bad += 1
            continue
        out.append(ModelHoldings(e, counts.get(f"{name}:blocks", 0), counts.get(f"{name}:bytes", 0)))
    out.sort(key=lambda h: (-h.stored_bytes, h.entry.model, h.entry.namespace))
    return out, bad
