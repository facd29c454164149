"""A vLLM model's KV-cache groups as the connector stores them, and which of a prefix's blocks
each group needs. Pure: no vLLM, no I/O.

vLLM's hybrid KV-cache manager gives a model with several attention kinds (sliding-window and
full layers, for example) one block table per group. kvtier keeps one key chain per group (the
salt commits to the group's index and kind), so each group's part of a block is stored, evicted
and verified on its own. A prefix of n blocks is complete, and may be loaded, only when:
- every full-attention (or MLA) group holds its part of blocks [0, n);
- every sliding-window group holds its part of the blocks vLLM keeps once n blocks of tokens are
  computed, [first_kept(n), n). vLLM puts its null block in front of those and computes the
  next token from the window alone, so older parts are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

NULL_BLOCK = 0  # vLLM's placeholder block id (its block pool's first block): never holds a page

FULL, MLA, SLIDING = "full", "mla", "sliding"


@dataclass(frozen=True, slots=True)
class GroupRule:
    kind: str  # FULL, MLA or SLIDING
    block_size: int  # tokens per vLLM block
    window: int = 0  # SLIDING: vLLM's sliding_window (tokens a position attends back over)
    extra_retained: int = 0  # SLIDING: vLLM's extra_retained_tokens (kept for speculative re-prefill)

    def first_kept(self, n_blocks: int) -> int:
        """The first block vLLM keeps (not null) once n_blocks blocks of tokens are computed; the
        same arithmetic as vLLM's SlidingWindowManager.get_num_skipped_tokens."""
        if self.kind != SLIDING:
            return 0
        skipped = max(0, n_blocks * self.block_size - self.window + 1 - self.extra_retained)
        return skipped // self.block_size

    def describe(self) -> str:
        """The group's kind as the key salt and the manifest name it."""
        return f"{SLIDING}:{self.window}:{self.extra_retained}" if self.kind == SLIDING else self.kind


def describe_groups(rules: Sequence[GroupRule]) -> str:
    return ",".join(r.describe() for r in rules)


def complete_prefix(rules: Sequence[GroupRule], present: Sequence[Sequence[bool]], max_blocks: int) -> int:
    """The most leading blocks (<= max_blocks) a load may use: for every chain c (a group's keys,
    one per rank and group, with rule rules[c]) present[c] says which of its blocks are held, and
    each must hold what its rule needs."""
    missing = [[0, *accumulate(not p for p in bools[:max_blocks])] for bools in present]
    for n in range(min([max_blocks, *(len(m) - 1 for m in missing)]), 0, -1):
        if all(m[n] - m[rule.first_kept(n)] == 0 for rule, m in zip(rules, missing)):
            return n
    return 0


def held_part(block_ids: Sequence[int], first: int, end: int) -> tuple[int, tuple[int, ...]]:
    """Blocks [first, end) of one group as (first block, vLLM block ids), without null blocks
    (blocks vLLM dropped or never kept: the part starts after the last one)."""
    ids = tuple(block_ids[first:end])
    if NULL_BLOCK in ids:
        last = len(ids) - 1 - ids[::-1].index(NULL_BLOCK)
        first, ids = first + last + 1, ids[last + 1:]
    return first, ids
