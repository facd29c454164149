"""vLLM offload keys -> kvtier block keys, namespaced the way vLLM's own storage tiers are.

vLLM names an offloaded chunk by an `OffloadKey`: its block hash (already a chain over the
prompt's tokens, parent first) followed by a 4-byte KV-cache group index. Those bytes say nothing
about which model, dtype or parallel layout produced the chunk, so two deployments that share a
Redis would collide on them. vLLM's file-system tier solves this with `FileMapper`: a directory
named after a SHA-256 of the model's name, tokens per hash, blocks per file, tp/pp/pcp/dcp sizes, dtype,
KV-cache groups, canonical format and engine, plus the rank. We reuse `FileMapper` itself for
those fields (so a vLLM upgrade that adds one changes our namespace too, as it must) and add
the chunk's byte size, an optional operator salt and the weights' identity (in place of the
model's name, which two deployments of different weights may share).

The kvtier key is then

    SHA-256( "kvtier/vllm-tier/v1" || u32 len || namespace JSON || u32 len || offload key )

Why not kvtier's own `root_key(fingerprint, salt)` + `chain_keys`: those hash token ids, and a
secondary tier never sees tokens, only vLLM's hashes. Hashing the offload key under the namespace
keeps the property that matters: equal chunks from equal deployments meet on every node (the
function is deterministic and process-independent), anything else never shares a key (SHA-256,
length-prefixed fields). Pure functions: no I/O, no state. The hashing itself:
kvtier/integrations/namespaced_keys.py.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from kvtier.client import ManifestEntry
from kvtier.integrations.namespaced_keys import KeyMapper as NamespacedKeys
from kvtier.integrations.namespaced_keys import namespace_bytes
from kvtier.integrations.vllm.model_identity import tier_identity

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

DOMAIN = b"kvtier/vllm-tier/v2"  # v2: the weights' identity, not the model's name
log = logging.getLogger("vllm.kvtier")
__all__ = ["DOMAIN", "KeyMapper", "manifest_entry", "namespace_bytes", "namespace_fields"]


def namespace_fields(spec: OffloadingSpec, chunk_bytes: int, salt: str | None = None,
                     weights_id: str | None = None) -> dict:
    """Everything a chunk's bytes depend on besides its tokens, as a JSON-able dict.

    The scheduler-side tier sees whole chunk rows (every worker's pages side by side), so the
    rank is the scheduler's (0) and the tp/pp/... sizes carry the layout, as for vLLM's fs tier.
    `parallel_agnostic=True` collapses the layout only when vLLM says the bytes are portable.
    The weights' identity (model_identity.tier_identity) replaces the model's name, which is only
    what the operator typed; WeightsUnknown (a ValueError: vLLM's start fails with it) when the
    weights cannot be read and no weights_id was given."""
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(root_dir="kvtier", offloading_spec=spec,
                                             blocks_per_file=spec.config.cache.blocks_per_chunk,
                                             parallel_agnostic=True)
    run = dict(mapper.get_run_config())
    model = spec.config.model
    identity = tier_identity(str(model.name), str(model.dtype), weights_id, log=log.info)
    run.pop("model_name", None)  # what the operator typed: the identity decides
    return {"vllm": run, "weights": identity.key_fields(), "rank": mapper.rank, "chunk_bytes": int(chunk_bytes),
            "salt": salt}


class KeyMapper(NamespacedKeys):
    """Maps vLLM `OffloadKey`s (bytes) to 32-byte kvtier keys under one namespace."""

    __slots__ = ()

    def __init__(self, namespace: bytes) -> None:
        super().__init__(DOMAIN, namespace)


def manifest_entry(spec: OffloadingSpec, fields: dict[str, Any], chunk_bytes: int) -> ManifestEntry:
    """The tier's entry in the pool's manifest (core/manifest.py): its namespace, by name."""
    import vllm

    return ManifestEntry(namespace=hashlib.sha256(DOMAIN + namespace_bytes(fields)).hexdigest()[:32],
                         engine="vllm-tier", engine_version=str(vllm.__version__), model=str(spec.config.model.name),
                         weights=dict(fields["weights"]), page={"chunk_bytes": int(chunk_bytes)},
                         extra={"tp_size": fields["vllm"].get("tp_size"),
                                "groups": len(fields["vllm"].get("kv_cache_groups") or [])})
