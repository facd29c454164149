"""The msgpack event codec (kvtier/bus/codec.py) over the typed events (kvtier/core/events.py).

Decoding treats its input as hostile: anything malformed is a MalformedEvent with a reason, and
never any other exception (which would crash a consumer instead of dead-lettering the entry).
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.bus.codec import MAX_ENTRY_BYTES, MAX_ITEMS, decode, encode
from kvtier.core.events import (
    SCHEMA_VERSION,
    Access,
    Cause,
    Demote,
    Envelope,
    Evict,
    Failure,
    Prefetch,
    Promote,
    Put,
    Reason,
    RemoteRead,
    Removed,
    StagedBlock,
    Store,
    StoreBatch,
    Stored,
    StoredBatch,
    Tier,
)
from kvtier.errors import MalformedEvent

K1, K2, K3 = (bytes([i]) * 32 for i in (1, 2, 3))

EVENTS = [
    Access("llama-8b", (K1, K2, K3), missed=4),
    Access("p", (), missed=0),
    Put("llama-8b", "kvtier.node-a.stage.1234", (StagedBlock(K1, None, 0, 2), StagedBlock(K2, K1, 7, 10**12))),
    Prefetch("llama-8b", (K2, K3), head_parent=K1),
    Prefetch("llama-8b", (K1,), head_parent=None),
    Store("llama-8b", Tier.CPU, K2, K1, "kvtier.node-a.stage.1", 3, 8),
    Promote("llama-8b", K1, None, Tier.REDIS, Tier.CPU, -1, 0),
    Demote("llama-8b", K2, K1, Tier.GPU, Tier.CPU, 17, 42),
    Evict("llama-8b", K3, Tier.GPU, Reason.CLEAN),
    Stored("llama-8b", K2, K1, Tier.REDIS, -1, Cause.DEMOTE),
    Removed("llama-8b", K2, Tier.CPU, Cause.DEMOTE, Failure.NO_ROOM),
    Removed("llama-8b", K3, Tier.GPU, Cause.EVICT, Reason.MAKE_ROOM),
    RemoteRead("llama-8b", (K2, K3), head_parent=K1),
    StoreBatch("llama-8b", Tier.CPU, "kvtier.node-a.stage.1",
               (StagedBlock(K1, None, 3, 8, True), StagedBlock(K2, K1, 4, 6))),
    StoredBatch("llama-8b", Tier.CPU, Cause.STORE, (K1, K2, K3), (None, K1, K2), (3, 4, 5)),
]


def wire(event=EVENTS[0], producer: str = "node-a/daemon", epoch: int = 3, seq: int = 99) -> dict:
    """The decoded wire map of a valid envelope, to be corrupted by a test."""
    return msgpack.unpackb(encode(Envelope(event, producer, epoch, seq)), raw=False)


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def reason_of(data: bytes) -> str:
    with pytest.raises(MalformedEvent) as info:
        decode(data)
    assert info.value.reason == str(info.value)
    return info.value.reason


# --- roundtrips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_type_roundtrips(event) -> None:
    env = Envelope(event, "node-a/daemon", 7, 2**63 - 1)
    out = decode(encode(env))
    assert out == env
    assert type(out.event) is type(event)
    for name in ("tier", "src", "dst"):
        if hasattr(event, name):
            assert type(getattr(out.event, name)) is Tier
    for name in ("reason", "cause", "why"):  # decoded as their enums, not bare strings
        if hasattr(event, name):
            assert type(getattr(out.event, name)) is type(getattr(event, name))
    if isinstance(event, (Put, StoreBatch)):
        assert all(type(b) is StagedBlock for b in out.event.blocks)
        assert out.event.blocks[1].parent == K1 and out.event.blocks[0].parent is None


def test_decode_accepts_bytearray_and_memoryview() -> None:
    raw = encode(Envelope(EVENTS[3], "p", 0, 0))
    assert decode(bytearray(raw)) == decode(memoryview(raw)) == decode(raw)


def test_wire_form_is_the_documented_map() -> None:
    obj = wire(EVENTS[8])
    assert obj == {"v": SCHEMA_VERSION, "t": "evict", "p": "node-a/daemon", "e": 3, "s": 99,
                   "b": {"pool": "llama-8b", "key": K3, "tier": 0, "reason": "clean"}}


# --- malformed envelopes -------------------------------------------------------------------------


def test_not_bytes_not_msgpack_not_a_map() -> None:
    with pytest.raises(MalformedEvent, match="must be bytes"):
        decode("text")  # type: ignore[arg-type]
    assert "not valid msgpack" in reason_of(b"\xc1")  # 0xc1 is never used in msgpack
    assert "not valid msgpack" in reason_of(pack({"v": 1}) + b"\x00")  # trailing data
    assert "top level must be a map" in reason_of(pack([1, 2, 3]))


@pytest.mark.parametrize("mutate", ["drop", "extra"])
def test_missing_or_extra_envelope_field(mutate: str) -> None:
    obj = wire()
    if mutate == "drop":
        del obj["s"]
    else:
        obj["x"] = 1
    assert "envelope fields must be v,t,p,e,s,b" in reason_of(pack(obj))


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, str(SCHEMA_VERSION), None])
def test_wrong_schema_version(version) -> None:
    obj = wire()
    obj["v"] = version
    assert "unsupported schema version" in reason_of(pack(obj))


@pytest.mark.parametrize("version", [True, 1.0, float(SCHEMA_VERSION)])
def test_bool_or_float_schema_version_rejected(version) -> None:
    obj = wire()
    obj["v"] = version
    reason_of(pack(obj))


@pytest.mark.parametrize("t", ["nope", "Access", 1, None, b"access"])
def test_unknown_type(t) -> None:
    obj = wire()
    obj["t"] = t
    assert "unknown event type" in reason_of(pack(obj))


@pytest.mark.parametrize("field, value, needle", [
    ("s", -1, "seq: must be >= 0"),
    ("e", -5, "epoch: must be >= 0"),
    ("s", True, "seq: expected a 64-bit integer, got bool"),
    ("e", False, "epoch: expected a 64-bit integer, got bool"),
    ("s", 2**64 - 1, "seq: expected a 64-bit integer"),
    ("s", 1.0, "seq: expected a 64-bit integer, got float"),
    ("p", "", "producer: expected a name"),
    ("p", "bad name", "producer: expected a name"),
    ("p", "x" * 129, "producer: expected a name"),
    ("p", b"node-a", "producer: expected a name"),
    ("b", [], "body must be a map"),
])
def test_bad_envelope_values(field: str, value, needle: str) -> None:
    obj = wire()
    obj[field] = value
    assert needle in reason_of(pack(obj))


# --- malformed bodies ----------------------------------------------------------------------------


def test_missing_and_extra_body_fields_are_named() -> None:
    obj = wire()
    del obj["b"]["keys"]
    assert "access: missing fields ['keys'], unexpected fields []" in reason_of(pack(obj))
    obj = wire()
    obj["b"]["bytes"] = b"payload"
    assert "unexpected fields ['bytes']" in reason_of(pack(obj))


@pytest.mark.parametrize("event, field, value, needle", [
    (EVENTS[8], "key", bytes(31), "evict.key: expected a 32-byte key, got 31 bytes"),
    (EVENTS[8], "key", bytes(33), "evict.key: expected a 32-byte key, got 33 bytes"),
    (EVENTS[8], "key", "k" * 32, "evict.key: expected a 32-byte key, got str"),
    (EVENTS[0], "keys", [K1, bytes(31)], "access.keys[1]: expected a 32-byte key"),
    (EVENTS[0], "keys", K1, "access.keys: expected a list"),
    (EVENTS[3], "head_parent", b"", "prefetch.head_parent: expected a 32-byte key, got 0 bytes"),
    (EVENTS[8], "tier", 4, "evict.tier: unknown tier 4"),
    (EVENTS[8], "tier", -1, "evict.tier: unknown tier"),
    (EVENTS[8], "tier", True, "evict.tier: unknown tier True"),
    (EVENTS[8], "tier", "gpu", "evict.tier: unknown tier"),
    (EVENTS[6], "src_slot", True, "promote.src_slot: expected a 64-bit integer, got bool"),
    (EVENTS[6], "src_gen", None, "promote.src_gen: expected a 64-bit integer"),
    (EVENTS[0], "missed", 2**63, "access.missed: expected a 64-bit integer"),
    (EVENTS[8], "pool", "", "evict.pool: expected a name"),
    (EVENTS[8], "pool", "gpu pool", "evict.pool: expected a name"),
    (EVENTS[8], "pool", "pööl", "evict.pool: expected a name"),
    (EVENTS[8], "pool", "p" * 129, "evict.pool: expected a name"),
    (EVENTS[2], "segment", "../../etc/passwd\x00", "put.segment: expected a name"),
    (EVENTS[8], "reason", "r" * 257, "evict.reason: expected one of clean, demoted, unreused, make_room"),
    (EVENTS[8], "reason", 5, "evict.reason: expected one of"),
    (EVENTS[8], "reason", ["clean"], "evict.reason: expected one of"),  # unhashable: no TypeError
    (EVENTS[8], "reason", "no_room", "evict.reason: expected one of"),  # a Failure is no evict reason
    (EVENTS[9], "cause", "demote_failed", "stored.cause: expected one of store, promote, demote, copy, evict"),
    (EVENTS[9], "cause", 2, "stored.cause: expected one of"),
    (EVENTS[10], "why", "evict:clean",
     "removed.why: expected one of clean, demoted, unreused, make_room, fault, bad_staging"),
    (EVENTS[10], "why", {"a": 1}, "removed.why: expected one of"),
    (EVENTS[10], "why", None, "removed.why: expected one of"),
    (EVENTS[2], "blocks", [[K1, None, 0]], "put.blocks[0]: staged block must be [key, parent, slot, gen]"),
    (EVENTS[2], "blocks", [[K1, None, 0, 1, 2]], "put.blocks[0]: staged block must be"),
    (EVENTS[2], "blocks", [{"key": K1}], "put.blocks[0]: staged block must be"),
    (EVENTS[2], "blocks", [[K1, bytes(5), 0, 1]], "put.blocks[0].parent: expected a 32-byte key"),
    (EVENTS[2], "blocks", [[K1, None, -1, 1]], "put.blocks[0].slot: must be >= 0"),
    (EVENTS[2], "blocks", [[K1, None, 0, False]], "put.blocks[0].gen: expected a 64-bit integer, got bool"),
    (EVENTS[13], "blocks", [[K1, None, 0, 1], [K2, K1, -1, 1]], "store_batch.blocks[1].slot: must be >= 0"),
    (EVENTS[13], "blocks", [[K1, None, 0, 1, False]], "store_batch.blocks[0]: staged block must be"),
    (EVENTS[13], "blocks", [[K1, None, 2**63, 1]], "store_batch.blocks[0].slot: expected a 64-bit integer"),
    (EVENTS[13], "blocks", [[K1, None, True, 1]], "store_batch.blocks[0].slot: expected a 64-bit integer, got bool"),
    (EVENTS[13], "blocks", [[K1, bytes(31), 0, 1]], "store_batch.blocks[0].parent: expected a 32-byte key"),
    (EVENTS[14], "keys", [K1, K2, bytes(31)], "stored_batch.keys[2]: expected a 32-byte key, got 31 bytes"),
    (EVENTS[14], "parents", [None, 7, K2], "stored_batch.parents[1]: expected a 32-byte key, got int"),
    (EVENTS[14], "slots", [3, 4, 1.5], "stored_batch.slots[2]: expected a 64-bit integer, got float"),
])
def test_bad_body_values(event, field: str, value, needle: str) -> None:
    obj = wire(event)
    obj["b"][field] = value
    assert needle in reason_of(pack(obj))


def test_non_utf8_pool_name_is_malformed() -> None:
    # A msgpack str whose bytes are not UTF-8: fixstr of length 2 holding 0xff 0xfe.
    raw = pack(wire(EVENTS[8])).replace(b"\xa8llama-8b", b"\xa8llama\xff\xfe\x00")
    assert "not valid msgpack" in reason_of(raw)


@pytest.mark.parametrize("field", ["pool", "producer"])
def test_name_with_trailing_newline_is_malformed(field: str) -> None:
    obj = wire(EVENTS[8])
    if field == "pool":
        obj["b"]["pool"] = "llama-8b\n"
    else:
        obj["p"] = "node-a\n"
    reason_of(pack(obj))


def test_oversize_entry_and_too_many_items() -> None:
    huge = encode(Envelope(Access("p", (K1,) * (MAX_ENTRY_BYTES // 34 + 10), 0), "p", 0, 0))
    assert len(huge) > MAX_ENTRY_BYTES
    assert f"exceeds {MAX_ENTRY_BYTES}" in reason_of(huge)
    assert f"exceeds {MAX_ENTRY_BYTES}" in reason_of(b"\x00" * (MAX_ENTRY_BYTES + 1))
    many = encode(Envelope(Access("p", (K1,) * (MAX_ITEMS + 1), 0), "p", 0, 0))
    assert len(many) <= MAX_ENTRY_BYTES
    assert "max_array_len" in reason_of(many)
    at_limit = encode(Envelope(Access("p", (K1,) * MAX_ITEMS, 0), "p", 0, 0))
    assert len(decode(at_limit).event.keys) == MAX_ITEMS


# --- fuzzing: MalformedEvent or an Envelope, never anything else -----------------------------------

leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
          | st.text(max_size=40) | st.binary(max_size=40) | st.sampled_from([K1, "llama-8b", "access", 1, -1]))
structures = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["v", "t", "p", "e", "s", "b", "pool", "key", "keys", "blocks"]), kids, max_size=6),
    max_leaves=30,
)


def decodes_or_malformed(data: bytes) -> None:
    try:
        out = decode(data)
    except MalformedEvent as e:
        assert isinstance(e.reason, str) and e.reason
    else:
        assert isinstance(out, Envelope)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    decodes_or_malformed(data)


@settings(max_examples=150, deadline=None)
@given(structures)
def test_arbitrary_msgpack_structures(obj) -> None:
    decodes_or_malformed(pack(obj))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EVENTS), st.data())
def test_near_valid_envelopes(event, data: st.DataObject) -> None:
    """A valid envelope with one envelope or body field replaced by an arbitrary structure."""
    obj = wire(event)
    if data.draw(st.booleans()):
        obj[data.draw(st.sampled_from(sorted(obj)))] = data.draw(structures)
    else:
        obj["b"][data.draw(st.sampled_from(sorted(obj["b"])))] = data.draw(structures)
    decodes_or_malformed(pack(obj))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EVENTS), st.integers(0, 10_000), st.integers(0, 255))
def test_single_byte_corruption(event, pos: int, byte: int) -> None:
    raw = bytearray(encode(Envelope(event, "node-a", 1, 2)))
    raw[pos % len(raw)] = byte
    decodes_or_malformed(bytes(raw))


def test_put_token_ids_round_trip_and_are_checked() -> None:
    from kvtier.core.events import TokenIds

    blk = StagedBlock(K1, None, 1, 2)
    env = Envelope(Put("pool", "seg", (blk,), TokenIds(b"\x01\x00\x00\x00" * 16)), "p", 1, 1)
    assert decode(encode(env)) == env
    assert decode(encode(Envelope(Put("pool", "seg", (blk,)), "p", 1, 2))).event.tokens is None
    bad = msgpack.unpackb(encode(env))
    bad["b"]["tokens"] = b"\x01\x02\x03"
    with pytest.raises(MalformedEvent, match="tokens"):
        decode(msgpack.packb(bad, use_bin_type=True))
