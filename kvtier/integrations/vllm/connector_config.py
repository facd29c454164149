"""The connector's settings (from `kv_connector_extra_config`) and the key namespace. No vLLM imports.

Block keys are kvtier's own chain (`kvtier.keys`) over the request's token ids, rooted in the
pool's layout fingerprint, a salt and the LoRA name. The salt commits, length-prefixed, to:
- which weights computed the bytes: the weights' identity (kvtier/integrations/weights.py: their
  content, the effective config, the quantization and the KV-cache dtype), not the served name;
- what makes the bytes of a page mean something: the engine, the attention backend's page shape
  and dtype, vLLM's KV-cache layout name, the device type and the block size;
- which slice of the model this rank holds: tensor- and pipeline-parallel rank and size (each
  rank keeps only its own heads or layers, so ranks never share a key);
- which KV-cache group the block is a part of, and every group's kind (kv_groups.py: a hybrid
  model keeps one chain per group);
- the request's `cache_salt` (tenants with different salts never share a block).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SALT_DOMAIN = b"kvtier/vllm-connector/v3"  # v2: the weights' identity, not the served name; v3: groups


class ConnectorConfigError(ValueError):
    """A `kv_connector_extra_config` value is missing or malformed."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    pool: str  # the kvtier pool that holds this model's blocks
    runtime_dir: str | None = None  # where the daemon's descriptor is (None: kvtier's default)
    lookup_timeout_s: float = 0.02  # bound on one try of the scheduler's Redis lookup for a request
    lookup_tries: int = 3  # a lookup that timed out is asked again next step, up to this many tries
    read_through: bool = True  # load the part of a prefix only Redis holds, straight from Redis
    load_async: bool = True  # loads run beside the engine's steps (vLLM's WAITING_FOR_REMOTE_KVS)
    save_decode: bool = True  # save the full blocks decoding produces too, not the prompt's only
    cost_model: bool = True  # load only what beats recomputing it (False: whatever kvtier holds)
    retry_s: float = 5.0  # after the daemon was unreachable, how long until the next try
    staging_blocks: int = 128  # the client's staging slots, one block of /dev/shm each
    call_timeout_s: float = 5.0  # bound on one worker-side get or put
    save_wait_s: float = 1.0  # how long a save may wait for staging slots the daemon is draining
    weights_id: str | None = None  # the weights' identity when kvtier cannot read their files

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        errors: list[str] = []
        pool = extra.pop("pool", None)
        if not isinstance(pool, str) or not pool:
            errors.append("'pool' (the kvtier pool name) is required")
        runtime_dir = extra.pop("runtime_dir", None)
        if runtime_dir is not None and not isinstance(runtime_dir, str):
            errors.append("'runtime_dir' must be a string")
        values: dict[str, Any] = {}
        for name, ms_key, lo in (("lookup_timeout_s", "lookup_timeout_ms", 1),
                                 ("retry_s", "retry_ms", 1), ("call_timeout_s", "call_timeout_ms", 1),
                                 ("save_wait_s", "save_wait_ms", 0)):
            if ms_key in extra:
                v = extra.pop(ms_key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < lo:
                    errors.append(f"'{ms_key}' must be a number >= {lo}")
                else:
                    values[name] = v / 1000.0
        weights_id = extra.pop("weights_id", None)
        if weights_id is not None:
            if not isinstance(weights_id, str) or not weights_id.strip():
                errors.append("'weights_id' must be a non-empty string")
            else:
                values["weights_id"] = weights_id
        for name in ("staging_blocks", "lookup_tries"):
            if name in extra:
                v = extra.pop(name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    errors.append(f"'{name}' must be an integer >= 1")
                else:
                    values[name] = v
        for name in ("read_through", "load_async", "save_decode", "cost_model"):
            if name in extra:
                v = extra.pop(name)
                if not isinstance(v, bool):
                    errors.append(f"'{name}' must be true or false")
                else:
                    values[name] = v
        if extra:
            errors.append(f"unknown keys {sorted(extra)} (known: pool, runtime_dir, lookup_timeout_ms, lookup_tries, "
                          "read_through, load_async, save_decode, cost_model, retry_ms, call_timeout_ms, "
                          "save_wait_ms, "
                          "staging_blocks, weights_id)")
        if errors:
            raise ConnectorConfigError("kvtier connector kv_connector_extra_config: " + "; ".join(errors))
        return cls(pool=pool, runtime_dir=runtime_dir, **values)  # type: ignore[arg-type]


def request_opt_outs(params: Any) -> tuple[bool, bool]:
    """(save, save_decode) for one request, from its kv_transfer_params {"kvtier": {"save": false,
    "save_decode": false}} (anything else there is left to other connectors)."""
    mine = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(mine, dict):
        return True, True
    return mine.get("save", True) is not False, mine.get("save_decode", True) is not False


def request_pin(params: Any) -> tuple[Any, Any] | None:
    """(seconds, tenant) of the session pin a request asks for in its kv_transfer_params
    {"kvtier": {"pin_s": 120, "tenant": "agent-7"}}: the blocks it saved are kept on the node that
    long once it finishes (Client.pin; the client checks the values, and a bad one is a logged,
    counted failure, never the request's). None when it asks for none."""
    mine = params.get("kvtier") if isinstance(params, dict) else None
    if not isinstance(mine, dict) or "pin_s" not in mine:
        return None
    return mine["pin_s"], mine.get("tenant", "")


def request_tenant(cache_salt: str | None, lora_name: str | None) -> str:
    """The tenant a request's saved blocks count for in the node's fair share (docs/operations.md,
    "Tenants and fair share"): what its keys are already separated by, "lora:<name>" (characters
    a tenant name may not hold become "_"), else "salt:" and 8 hex digits of its cache salt's
    SHA-256 (the salt itself never leaves the engine), else "" (the default tenant)."""
    if lora_name:
        return "lora:" + re.sub(r"[^A-Za-z0-9_.:/-]", "_", lora_name)[:123]
    if cache_salt:
        return "salt:" + hashlib.sha256(cache_salt.encode()).hexdigest()[:8]
    return ""


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """What a vLLM block's bytes mean, from facts the scheduler and every worker share."""

    model: str  # as served: readable (the manifest, logs), not part of the key
    weights: str  # the weights' identity (WeightsIdentity.key_fields, canonical JSON)
    engine_version: str  # vLLM's major.minor: page layouts may change between releases
    block_size: int  # tokens per vLLM block
    layers: int  # attention layers in each KV-cache group (the connector takes groups of one size)
    kv_heads: int  # per rank
    head_size: int
    dtype: str  # torch dtype name without "torch."
    kv_layout: str  # vLLM's KVCacheConfig.kv_cache_layout
    device: str  # "cpu", "cuda", ...
    groups: str = "full"  # every KV-cache group's kind, in vLLM's order (kv_groups.describe_groups)
    revision: str | None = None  # the weights' commit when vLLM knows it: readable (the manifest) only


def _field(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def _namespace_hash(ns: KeyNamespace) -> hashlib._Hash:
    """SHA-256 over every field the keys commit to (not the served name, not the revision)."""
    h = hashlib.sha256(SALT_DOMAIN)
    for f in (ns.weights, ns.engine_version, ns.dtype, ns.kv_layout, ns.device, ns.groups):
        h.update(_field(f))
    h.update(struct.pack("<4I", ns.block_size, ns.layers, ns.kv_heads, ns.head_size))
    return h


def rank_salt(ns: KeyNamespace, tp: tuple[int, int], pp: tuple[int, int], cache_salt: str | None,
              group: int = 0) -> bytes:
    """The salt for one rank's keys of one KV-cache group, tp = (rank, size) and pp = (rank, size),
    and one cache_salt."""
    h = _namespace_hash(ns)
    h.update(struct.pack("<5I", *tp, *pp, group))
    h.update(b"\x00" if cache_salt is None else b"\x01" + _field(cache_salt))
    return h.digest()


def namespace_id(ns: KeyNamespace) -> str:
    """The namespace's id in the pool's manifest (hex): the same fields, no rank, no cache_salt."""
    return _namespace_hash(ns).hexdigest()[:32]
