"""An engine's own block names -> 32-byte kvtier keys, under a namespace. Pure: no I/O, no state.

Engines that hand kvtier opaque pages (vLLM's offloading tiers, SGLang's HiCache) name them by
their own hashes, already chained over the prompt's tokens, which say nothing about the model,
dtype or parallel layout that produced the bytes. So the kvtier key is

    SHA-256( domain || u32 len || namespace || u32 len || engine key )

with the namespace a canonical JSON of everything the bytes depend on besides the tokens. Equal
pages from equal deployments meet on every node (deterministic, process-independent); anything
else never shares a key (SHA-256 over length-prefixed fields).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from typing import Any


def namespace_bytes(fields: dict[str, Any]) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, so equal fields give equal bytes everywhere."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")


class KeyMapper:
    """Maps an engine's keys (bytes) to 32-byte kvtier keys under one domain and namespace."""

    __slots__ = ("namespace", "_prefix")

    def __init__(self, domain: bytes, namespace: bytes) -> None:
        self.namespace = namespace
        self._prefix = hashlib.sha256(domain + struct.pack("<I", len(namespace)) + namespace)

    def __call__(self, engine_key: bytes) -> bytes:
        h = self._prefix.copy()
        h.update(struct.pack("<I", len(engine_key)) + bytes(engine_key))
        return h.digest()

    def many(self, engine_keys: Iterable[bytes]) -> list[bytes]:
        return [self(k) for k in engine_keys]
