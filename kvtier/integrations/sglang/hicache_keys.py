"""SGLang page keys -> kvtier keys, with the topology suffix SGLang expects a backend to add.

SGLang names a page by a hex SHA-256 chained over its tokens (plus the namespace seed, the extra
key and the cache salt): the same prompt gives the same key whatever model, parallel layout or
host layout produced the page. HiCacheFile therefore appends `_{model}_{tp_rank}_{tp_size}`
(and the pp and cp shard) to every key, or only the model for MLA, whose KV every TP rank holds
whole and which `is_storage_writer` writes once. We put the same shard fields, plus what the bytes
depend on that HiCacheFile leaves out (its own TODO): the weights' identity in place of the
served name (hicache_identity.py), the host layout, dtype and geometry, the page size and
bytes, and an operator salt, in the namespace of namespaced_keys.KeyMapper. Two sets of weights,
two TP layouts or two host layouts never share a page; equal deployments on any node do. Pure.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.namespaced_keys import KeyMapper, namespace_bytes

DOMAIN = b"kvtier/sglang-hicache/v2"  # v2: the weights' identity, not the served name


def namespace_fields(cfg: Any, *, weights: dict[str, Any], layout: str, page_size: int, page_bytes: int,
                     salt: str | None, host: dict[str, Any] | None = None) -> dict[str, Any]:
    """The namespace of an SGLang `HiCacheStorageConfig` (read by attribute: no SGLang import);
    `weights` is the weights' identity (hicache_identity.py), `host` the host pool's dtype and
    geometry (hicache_pages.host_geometry), once registered."""
    shard: dict[str, Any] = {}
    if cfg.pp_size > 1:
        shard["pp"] = [cfg.pp_rank, cfg.pp_size]
    if cfg.attn_cp_size > 1:
        shard["cp"] = [cfg.attn_cp_rank, cfg.attn_cp_size]
    dcp_size = getattr(cfg, "dcp_size", 1)
    if dcp_size > 1:
        shard["dcp"] = [cfg.dcp_rank, dcp_size, cfg.tp_size, getattr(cfg, "logical_page_size", None)]
    # MLA: every TP rank holds the same page, so the TP rank is not part of its name.
    tp = None if cfg.is_mla_model else [cfg.tp_rank, cfg.tp_size]
    return {"weights": weights, "tp": tp, **shard, "layout": layout, "page_size": int(page_size),
            "page_bytes": int(page_bytes), "host": host, "salt": salt}


def key_mapper(fields: dict[str, Any]) -> KeyMapper:
    return KeyMapper(DOMAIN, namespace_bytes(fields))


def page_key(mapper: KeyMapper, key: object) -> bytes:
    """The kvtier key of one SGLang page key; TypeError for anything but a non-empty str."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"SGLang page keys are non-empty strings, got {type(key).__name__}")
    return mapper(key.encode("utf-8"))
