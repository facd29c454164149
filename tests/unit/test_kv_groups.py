"""The connector's KV-cache group rules (kvtier/integrations/vllm/kv_groups.py): which blocks a
sliding-window group keeps, when a prefix is complete across groups, and which block ids a
transfer moves. Pure: no vLLM, no daemon."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.integrations.vllm.kv_groups import (
    FULL,
    NULL_BLOCK,
    SLIDING,
    GroupRule,
    complete_prefix,
    describe_groups,
    held_part,
)

BS = 16
FULL_RULE = GroupRule(FULL, BS)
SW64 = GroupRule(SLIDING, BS, window=64)


def test_a_sliding_group_keeps_the_blocks_its_window_reaches():
    # vLLM: skipped tokens = computed - window + 1; 64-token window, 16-token blocks.
    assert [SW64.first_kept(n) for n in (0, 1, 4, 5, 6, 10)] == [0, 0, 0, 1, 2, 6]
    assert GroupRule(SLIDING, BS, window=64, extra_retained=16).first_kept(10) == 5
    assert FULL_RULE.first_kept(100) == 0


def test_groups_are_named_for_the_salt_and_the_manifest():
    assert describe_groups([FULL_RULE, SW64]) == "full,sliding:64:0"


def test_a_full_group_needs_its_whole_leading_run():
    full = [True] * 6 + [False] + [True] * 3
    assert complete_prefix([FULL_RULE], [full], 10) == 6
    assert complete_prefix([FULL_RULE], [[True] * 10], 8) == 8  # never past max_blocks


def test_a_prefix_is_complete_only_where_every_group_holds_its_part():
    full = [True] * 10
    # The sliding group lost its old blocks (0-3): still complete at 10 (its window is 6..9).
    sliding = [False] * 4 + [True] * 6
    assert complete_prefix([FULL_RULE, SW64], [full, sliding], 10) == 10
    # One part inside the window is missing: the longest complete prefix ends before it ...
    sliding[8] = False
    assert complete_prefix([FULL_RULE, SW64], [full, sliding], 10) == 8
    # ... unless that one is too short for the window (needs 4..7, and 4 is missing too).
    assert complete_prefix([FULL_RULE, SW64], [full, [False] * 10], 10) == 0
    # The full group's part missing: nothing past it, whatever the sliding group holds.
    assert complete_prefix([FULL_RULE, SW64], [[True] * 3 + [False] * 7, [True] * 10], 10) == 3


@given(st.lists(st.booleans(), min_size=1, max_size=40), st.lists(st.booleans(), min_size=1, max_size=40),
       st.integers(1, 80), st.integers(0, 40))
def test_complete_prefix_is_the_longest_prefix_that_passes_the_rules(full, sliding, window, max_blocks):
    rules = [FULL_RULE, GroupRule(SLIDING, BS, window=window)]
    got = complete_prefix(rules, [full, sliding], max_blocks)

    def ok(n: int) -> bool:
        return n <= min(max_blocks, len(full), len(sliding)) and all(full[:n]) and all(
            sliding[rules[1].first_kept(n):n])

    assert got == 0 or ok(got)
    assert not any(ok(n) for n in range(got + 1, 41))


def test_a_transfer_never_moves_a_null_block():
    assert held_part([5, 6, 7, 8], 1, 4) == (1, (6, 7, 8))
    # vLLM's null block in front (a sliding group's dropped blocks): the part starts after it.
    assert held_part([NULL_BLOCK, NULL_BLOCK, 7, 8], 0, 4) == (2, (7, 8))
    assert held_part([NULL_BLOCK, NULL_BLOCK], 0, 2) == (2, ())
