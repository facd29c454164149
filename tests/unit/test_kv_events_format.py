"""kvtier's facts as vLLM KV events (core/kv_events.py): hashes, media, grouping, what is announced.

The wire decoding with vLLM's own classes is tested in tests/vllm/test_kv_events_vllm.py."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from kvtier.core.events import Cause, Failure, Reason, Removed, Stored, Tier
from kvtier.core.kv_events import (
    all_blocks_cleared,
    block_hash,
    event_batch,
    facts_to_events,
    medium_of,
)
from kvtier.keys import BlockKey


def k(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(i.to_bytes(4, "little")).digest())


def stored(i: int, parent: int | None, tier: Tier = Tier.CPU) -> Stored:
    return Stored("p", k(i), None if parent is None else k(parent), tier, 3, Cause.STORE)


def test_block_hash_is_the_low_64_bits_big_endian() -> None:
    key = bytes(range(32))
    assert block_hash(key) == int.from_bytes(bytes(range(24, 32)), "big")
    assert block_hash(b"\xff" * 32) == (1 << 64) - 1
    with pytest.raises(ValueError):
        block_hash(b"short")


@pytest.mark.parametrize("tier, on_device, medium", [
    (Tier.CPU, False, "CPU"), (Tier.CPU, True, "CPU"), (Tier.REDIS, False, "STORAGE"),
    (Tier.GPU, True, "GPU"), (Tier.GPU, False, "CPU"),
])
def test_media(tier: Tier, on_device: bool, medium: str) -> None:
    assert medium_of(tier, on_device) == medium


def test_a_stored_chain_is_one_event_and_a_break_starts_another() -> None:
    facts = [stored(1, None), stored(2, 1), stored(3, 2), stored(9, 8), stored(3, 2, Tier.REDIS)]
    events = facts_to_events(facts, 16, False, lambda key: None)
    assert [e["type"] for e in events] == ["BlockStored"] * 3
    first, second, third = events
    assert first["block_hashes"] == [block_hash(k(1)), block_hash(k(2)), block_hash(k(3))]
    assert first["parent_block_hash"] is None and first["medium"] == "CPU" and first["block_size"] == 16
    assert second["block_hashes"] == [block_hash(k(9))] and second["parent_block_hash"] == block_hash(k(8))
    assert third["medium"] == "STORAGE" and third["parent_block_hash"] == block_hash(k(2))
    assert all(e["token_ids"] == [] and e["lora_id"] is None and e["lora_name"] is None for e in events)


def test_tokens_are_carried_only_when_every_block_has_them() -> None:
    toks = {k(1): list(range(16)), k(2): list(range(16, 32))}
    both = facts_to_events([stored(1, None), stored(2, 1)], 16, False, toks.get)
    assert both[0]["token_ids"] == list(range(32))
    one_missing = facts_to_events([stored(1, None), stored(2, 1), stored(3, 2)], 16, False, toks.get)
    assert one_missing[0]["token_ids"] == []


def test_evictions_are_removed_events_failed_commands_are_nothing() -> None:
    facts = [stored(1, None), Removed("p", k(1), Tier.CPU, Cause.EVICT, Reason.DEMOTED),
             Removed("p", k(5), Tier.CPU, Cause.STORE, Failure.VERIFY),  # never got there
             Removed("p", k(6), Tier.REDIS, Cause.EVICT, Reason.CLEAN)]
    events = facts_to_events(facts, 16, False, lambda key: None)
    assert [(e["type"], e.get("medium")) for e in events] == [
        ("BlockStored", "CPU"), ("BlockRemoved", "CPU"), ("BlockRemoved", "STORAGE")]
    assert events[1]["block_hashes"] == [block_hash(k(1))]


def test_batch_is_array_like_and_msgpack_round_trips() -> None:
    batch = event_batch(12.5, [all_blocks_cleared()], 3)
    assert batch == [12.5, [{"type": "AllBlocksCleared"}], 3]
    assert msgpack.unpackb(msgpack.packb(batch)) == batch
