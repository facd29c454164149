"""What the connector's scheduler half tells its worker half each step (no vLLM imports)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GroupPart:
    """One KV-cache group's blocks [first, first + len(block_ids)) of a request's tokens, and
    where they are in vLLM (that group's block ids)."""

    group: int
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request's tokens, one part per KV-cache group. Workers recompute the keys
    from the tokens with their own rank's salt."""

    req_id: str
    token_ids: tuple[int, ...]  # the request's tokens (prompt, then output) up to the last block moved
    cache_salt: str | None
    lora_name: str | None
    parts: tuple[GroupPart, ...]
    refused: bool = False  # a load whose blocks vLLM laid out unlike the plan: all of it fails
    remote: bool = False  # a load: part of it only Redis holds (read through)
    deadline_s: float = 0.0  # a load: given up (its blocks recomputed) this long after it was handed over
    asynchronous: bool = False  # a load vLLM waits for in WAITING_FOR_REMOTE_KVS (reported by get_finished)
    final: bool = False  # a save of a finished request whose blocks vLLM frees once it is staged

    @property
    def blocks(self) -> int:
        return sum(len(p.block_ids) for p in self.parts)


@dataclass(slots=True)
class TransferPlan:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    step_tokens: int = 0  # tokens vLLM computes this step (the workers time prefill with it)
    held: bool = False  # a request waits to be asked again: an idle step need not spin
