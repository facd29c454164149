"""Engines' KV events read as untrusted bytes (core/engine_events.py): both encodings, hostile
messages, and one engine's state across gaps, restarts and removals."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from kvtier.core.engine_events import BadMessage, Cleared, EngineState, Removed, Stored, decode_any, decode_message
from kvtier.keys import chain_keys, root_key

ROOT = root_key(b"\x07" * 32)


def frames(seq: int, events: list, topic: bytes = b"kv@n@m") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big", signed=True), msgpack.packb([1.5, events, 0])]


def stored(hashes, parent, tokens, size=4):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}


def test_map_and_legacy_array_forms() -> None:
    seq, evs = decode_message(frames(7, [stored([1, 2], None, list(range(8))),
                                         ["BlockRemoved", [1], "GPU"], {"type": "AllBlocksCleared"},
                                         {"type": "SomethingNew", "x": 1}]))
    assert seq == 7
    assert evs == [Stored((1, 2), None, tuple(range(8)), 4, "GPU"), Removed((1,), "GPU"), Cleared()]
    _, legacy = decode_message(frames(8, [["BlockStored", [b"h1"], None, [1, 2, 3, 4], 4, None, "GPU"]]))
    assert legacy == [Stored((b"h1",), None, (1, 2, 3, 4), 4, "GPU")]


@pytest.mark.parametrize("bad", [
    [b"t", b"\x00" * 8],  # two frames
    [b"t", b"\x00" * 4, msgpack.packb([1, [], 0])],  # short sequence
    [b"t", b"\x00" * 8, b"\xc1\xc1"],  # not msgpack
    [b"t", b"\x00" * 8, msgpack.packb({"a": 1})],  # not a batch
    frames(1, ["nope"]),
    frames(1, [{"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 4}]),
    frames(1, [stored([True], None, [1, 2, 3, 4])]),  # a bool is no hash
    frames(1, [stored([1], None, [1, 2, 3, -4])]),
    frames(1, [stored([1], None, [1, 2, 3, 1 << 32])]),
    frames(1, [stored([1], None, [1, 2, 3, 4], size=0)]),
    frames(1, [stored([b"x" * 65], None, [1, 2, 3, 4])]),
    frames(1, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 5}]),
])
def test_hostile_messages_are_refused_with_a_reason(bad) -> None:
    with pytest.raises(BadMessage):
        decode_message(bad)


def test_non_bytes_frames() -> None:
    with pytest.raises(BadMessage):
        decode_any(["t", b"\x00" * 8, b""])


def state() -> EngineState:
    return EngineState(4, lambda parent, toks: chain_keys(parent if parent is not None else ROOT, toks, 4))


def test_stored_blocks_get_their_kvtier_keys_chained_from_their_parent() -> None:
    s = state()
    added, gone, cleared = s.apply(0, [Stored((10, 11), None, tuple(range(8)), 4, "GPU")])
    assert added == chain_keys(ROOT, list(range(8)), 4) and gone == [] and not cleared
    added2, _, _ = s.apply(1, [Stored((12,), 11, tuple(range(8, 12)), 4, "GPU")])
    assert added2 == chain_keys(ROOT, list(range(12)), 4)[2:]  # the same chain a client computes
    _, gone, _ = s.apply(2, [Removed((11, 99), "GPU")])
    assert gone == [added[1]] and 11 not in s.blocks


def test_gaps_restarts_duplicates_and_unmatched() -> None:
    s = state()
    s.apply(0, [Stored((1,), None, (1, 2, 3, 4), 4, None)])
    assert not s.gap(1) and s.gap(3)
    assert s.apply(0, [Stored((2,), None, (5, 6, 7, 8), 4, None)])[2] is True  # back to 0: a restart
    assert list(s.blocks) == [2]
    assert s.apply(0, [], replayed=True) == ([], [], False)  # a replay's duplicate changes nothing
    assert list(s.blocks) == [2] and s.last_seq == 0
    s.apply(1, [Stored((3,), 77, (1, 2, 3, 4), 4, None),  # parent never seen
                Stored((4,), None, (1, 2, 3), 4, None),  # tokens short
                Stored((5,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8, None)])  # another block size
    assert s.unmatched == 3
    _, gone, cleared = s.apply(2, [Cleared()])
    assert cleared and gone == [chain_keys(ROOT, [5, 6, 7, 8], 4)[0]] and not s.blocks


def test_capacity_bounds_memory() -> None:
    s = EngineState(1, lambda p, t: [hashlib.sha256(bytes([x])).digest() for x in t], capacity=3)
    s.apply(0, [Stored(tuple(range(5)), None, tuple(range(5)), 1, None)])
    assert list(s.blocks) == [2, 3, 4]
