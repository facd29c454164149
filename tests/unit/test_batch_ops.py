"""The batch forms of the per-block steps a put's adoption takes (kvtier/tiers/grants.py): each leaves
exactly the state its per-block form leaves, block after block, for any sequence of batches
(hypothesis). Compared through each structure's own queries, and for the client directory byte
for byte, since clients read that shared memory."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.events import Tier
from kvtier.core.fence import CommandFence
from kvtier.core.index import TierIndex
from kvtier.core.residency import Residency
from kvtier.layout import BlockLayout
from kvtier.shm.directory import NO_SLOT, DirectoryWriter, directory_bytes
from tests.support.segments import segment_factory

KEYS = [bytes([i]) * 32 for i in range(1, 25)]
key = st.sampled_from(KEYS)
FP = BlockLayout("m", 2, 2, 4, 16, "float16").fingerprint


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(key, st.one_of(st.none(), key)), max_size=8), max_size=8))
def test_commit_many_is_commit_block_after_block(batches) -> None:
    one, many = TierIndex(64), TierIndex(64)
    for batch in batches:
        for idx in (one, many):
            for k, parent in batch:
                idx.reserve(k, parent)
        for k, _ in batch:
            one.commit(k)
        many.commit_many([e for k, _ in batch if (e := many.get(k)) is not None])
        assert [e.key for e in one.ready()] == [e.key for e in many.ready()], "LRU order"
        assert [one.children(k) for k in KEYS] == [many.children(k) for k in KEYS]
        assert list(one.candidates()) == list(many.candidates())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 15), key, st.one_of(st.none(), key)), max_size=8), max_size=6),
       st.dictionaries(key, st.sampled_from(["a", "b"]), max_size=10))
def test_claim_many_is_claim_block_after_block(batches, owners) -> None:
    def residency() -> Residency:
        r = Residency({Tier.GPU: TierIndex(0), Tier.CPU: TierIndex(16), Tier.REDIS: TierIndex(None)})
        r.grant(Tier.CPU, 12)  # slots 4-15 granted, 0-3 left free: claiming one of those is refused
        for k, who in owners.items():
            r.tenants.claim(k, who)
        return r

    one, many = residency(), residency()
    for batch in batches:
        got_one = [one.claim(Tier.CPU, slot, k, parent) for slot, k, parent in batch]
        got_many = many.claim_many(Tier.CPU, batch)
        assert [e and (e.key, e.slot, e.parent) for e in got_one] == \
            [e and (e.key, e.slot, e.parent) for e in got_many]
        assert one.tenants.blocks.get(Tier.CPU, {}) == many.tenants.blocks.get(Tier.CPU, {}), "blocks per owner"
        assert one.tiers[Tier.CPU].granted == many.tiers[Tier.CPU].granted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(key, st.integers(0, 2), st.integers(-1, 40)), max_size=10), max_size=8))
def test_set_slots_is_set_slot_block_after_block_byte_for_byte(segments, batches) -> None:
    one, many = (DirectoryWriter.create(segments(directory_bytes(64)), 64, FP) for _ in range(2))
    for batch in batches:
        for tier in (0, 1, 2):  # a batch is of one tier
            part = [(k, s if s >= 0 else NO_SLOT) for k, t, s in batch if t == tier]
            for k, s in part:
                one.set_slot(k, tier, s)
            many.set_slots(tier, [k for k, _ in part], [s for _, s in part])
        assert bytes(one.seg.buf) == bytes(many.seg.buf)
        assert [one.get(k) for k in KEYS] == [many.get(k) for k in KEYS] and len(one) == len(many)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(key, max_size=8), st.integers(0, 9)), max_size=12))
def test_record_many_is_record_block_after_block(batches) -> None:
    one, many = CommandFence(10), CommandFence(10)  # fewer than the keys: the bound drops the coldest
    for keys, seq in batches:
        for k in keys:
            one.record("p", k, (1, seq))
        many.record_many("p", keys, (1, seq))
        assert list(one._last.items()) == list(many._last.items()), "stamps, and the order the bound evicts in"


@pytest.fixture(scope="module")
def segments() -> Iterator:
    with segment_factory("kvtier.test-batchops-") as make:
        yield make
