"""kvtier's tier facts as KV events in vLLM's wire format, for KV-aware routers. Pure: no I/O.

The format is vllm.distributed.kv_events at vLLM 0.32 (and SGLang 0.5.23, which encodes the
same): a message is three ZMQ frames, the topic, an 8-byte big-endian sequence number, and a
msgpack payload `[ts, [events], data_parallel_rank]` (EventBatch, array-like); each event is a
map tagged with its class name (msgspec `tag=True`), e.g.

    {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p, "token_ids": [...],
     "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None}

Block hashes are integers: the low 64 bits (the last 8 bytes, big-endian) of the 32-byte kvtier
key, which routers use only as opaque ids. Media: CPU for the cpu tier (and for a gpu tier kept
in host memory), GPU for a gpu tier on a device, STORAGE for Redis. A `removed` fact that only
says a command failed (the block never got there) is no event: it was never announced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvtier.core.events import Reason, Removed, Stored, Tier
from kvtier.keys import BlockKey

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_STORAGE = "GPU", "CPU", "DISK", "STORAGE"
TOKENS_NONE: tuple[int, ...] = ()


def block_hash(key: bytes) -> int:
    """The event hash of a kvtier key: its low 64 bits, the last 8 bytes read big-endian."""
    if len(key) != 32:
        raise ValueError(f"kvtier keys are 32 bytes, got {len(key)}")
    return int.from_bytes(key[24:], "big")


def medium_of(tier: Tier, gpu_on_device: bool) -> str:
    if tier == Tier.REDIS:
        return MEDIUM_STORAGE
    if tier == Tier.DISK:
        return MEDIUM_DISK
    if tier == Tier.GPU and gpu_on_device:
        return MEDIUM_GPU
    return MEDIUM_CPU


def block_stored(keys: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], block_size: int,
                 medium: str, lora_name: str | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [block_hash(k) for k in keys],
            "parent_block_hash": None if parent is None else block_hash(parent),
            "token_ids": list(token_ids), "block_size": int(block_size), "lora_id": None,
            "medium": medium, "lora_name": lora_name}


def block_removed(keys: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash(k) for k in keys], "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def event_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int) -> list[Any]:
    """EventBatch is array-like: [ts, events, data_parallel_rank]."""
    return [float(ts), events, int(data_parallel_rank)]


def facts_to_events(facts: Iterable[Stored | Removed], block_size: int, gpu_on_device: bool,
                    tokens: Callable[[BlockKey], Sequence[int] | None]) -> list[dict[str, Any]]:
    """One event per announced change, in fact order. Consecutive `stored` facts of one medium
    that form a chain (each the parent of the next) share one BlockStored, as an engine's do.
    `tokens(key)` gives a block's token ids when its put carried them (else an empty list)."""
    out: list[dict[str, Any]] = []
    run: list[Stored] = []

    def close_run() -> None:
        if run:
            toks: list[int] = []
            for f in run:
                t = tokens(f.key)
                if t is None:  # one block without tokens: the event says nothing of any
                    toks = []
                    break
                toks.extend(t)
            out.append(block_stored([f.key for f in run], run[0].parent, toks, block_size,
                                    medium_of(run[0].tier, gpu_on_device)))
            run.clear()

    for f in facts:
        if isinstance(f, Stored):
            if run and (run[-1].tier != f.tier or f.parent != run[-1].key):
                close_run()
            run.append(f)
            continue
        close_run()
        if isinstance(f.why, Reason):  # evicted: it had been announced
            out.append(block_removed([f.key], medium_of(f.tier, gpu_on_device)))
    close_run()
    return out
