"""The connector's scheduler half: what it keeps of each request (no vLLM imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A request vLLM sends back to the lookup again and again (each time its load is over) is
# recomputed past this many loads, whatever the reason.
MAX_LOADS = 8


@dataclass(slots=True)
class TrackedRequest:
    """What the scheduler half keeps of one request while vLLM has it."""

    request: Any  # vLLM's Request (this process's): its tokens and computed count as they grow
    prompt: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None
    save: bool = True  # kv_transfer_params may opt a request out of saves, or of decode saves
    save_decode: bool = True
    pin: tuple[Any, Any] | None = None  # (seconds, tenant) from kv_transfer_params: pinned when it finishes
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    saved: int = 0  # leading blocks already in kvtier or handed to it
    local_tokens: int = 0  # the (block-aligned) local hit vLLM last showed us
    keys: list[list[bytes]] | None = None  # per chain (rank-major, then group), as far as hashed
    reach: int | None = None  # how far Redis and this node together hold the prefix (asked once)
    tries: int = 0  # Redis lookups tried
    promised: tuple[int, int, float] | None = None  # (end block, first block from Redis, deadline s)
    redis_tokens: int = 0  # of the last load, tokens read through from Redis
    loads: int = 0  # loads planned for it (one, and one more after each preemption)
    loading: frozenset[int] = frozenset()  # vLLM block ids of its load in flight
    load_failed: bool = False  # a load of it failed: recomputed from then on, never promised again
