"""Hostile stream entries against a real Consumer and a real daemon.

Hypothesis builds batches of malformed entries: missing or extra fields (stream, envelope and
body level), wrong types, non-UTF-8 bytes, huge and lying lengths, wrong key sizes, bad names,
out-of-range numbers, plus nil payloads (entries deleted while pending, as after trimming). None
crashes the consumer; each malformed entry reaches the dead-letter stream with the reason the
codec gives for it; each nil one is acked and counted; the good entries queued between and
behind them are all handled, in order.
"""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest
import structlog
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.bus.codec import MAX_ENTRY_BYTES, MAX_ITEMS, MAX_STR, NAME_RE, decode_entry, encode
from kvtier.bus.connect import make_redis
from kvtier.bus.consumer import Consumer, Delivery
from kvtier.bus.deadletter import REASON_EXTRA_FIELDS, REASON_MISSING_FIELD
from kvtier.bus.publisher import BusStats, Publisher
from kvtier.client import Client
from kvtier.core.events import (
    SCHEMA_VERSION,
    Access,
    Cause,
    Copy,
    Demote,
    Envelope,
    Evict,
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
from kvtier.keys import BlockKey
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

K = BlockKey(bytes(range(32)))
SEG = "kvtier.n.stage.1.0123456789abcdef"
# One well-formed event of every type: the material the mutations below break.
EVENTS = [
    Access("p", (K, K), 0),
    Put("p", SEG, (StagedBlock(K, None, 0, 2), StagedBlock(K, K, 1, 2))),
    Prefetch("p", (K,), None),
    RemoteRead("p", (K, K), K),
    Store("p", Tier.CPU, K, None, SEG, 0, 2),
    Promote("p", K, K, Tier.REDIS, Tier.CPU, -1, 0),
    Demote("p", K, None, Tier.GPU, Tier.CPU, 3, 4),
    Copy("p", K, None, Tier.CPU, Tier.REDIS),
    Evict("p", K, Tier.GPU, "demoted"),
    Stored("p", K, None, Tier.CPU, 2, "store"),
    Removed("p", K, Tier.CPU, Cause.EVICT, Reason.DEMOTED),
    StoreBatch("p", Tier.CPU, SEG, (StagedBlock(K, None, 0, 2), StagedBlock(K, K, 1, 2, True))),
    StoredBatch("p", Tier.CPU, Cause.STORE, (K, K), (None, K), (2, 3)),
]
WIRE = [msgpack.unpackb(encode(Envelope(ev, "prod", 1, 1)), raw=False) for ev in EVENTS]

# Values no field of any event accepts: not bytes, str, int, list or None (bool is not an int here).
WRONG_TYPE = st.one_of(st.floats(allow_nan=False), st.booleans(),
                       st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2))
BAD_NAME = st.one_of(st.text(max_size=140).filter(lambda s: not NAME_RE.fullmatch(s)), st.just("x" * 129))
WRONG_KEY = st.binary(max_size=80).filter(lambda b: len(b) != 32)
INT = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
NON_UTF8 = st.binary(max_size=20).map(lambda b: b"\xff\xfe" + b)  # never valid UTF-8


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# Entries too big to draw each time: built once, sampled.
TOO_MANY_KEYS = pack({**WIRE[0], "b": {**WIRE[0]["b"], "keys": [bytes(K)] * (MAX_ITEMS + 1)}})
OVERSIZED = b"\x00" * (MAX_ENTRY_BYTES + 1)
LYING_LENGTHS = [
    b"\xdb\xff\xff\xff\xffabc",  # str 32 claiming 4 GiB
    b"\xc6\x7f\xff\xff\xff\x00",  # bin 32 claiming 2 GiB
    b"\xdd\xff\xff\xff\xff\xc0",  # array 32 claiming 4 G items
    b"\xdf\xff\xff\xff\xff\xa1v",  # map 32 claiming 4 G pairs
    b"\x81\xa1v" + b"\x91" * 100_000 + b"\xc0",  # 100k nested arrays
]


@st.composite
def envelope_mutation(draw) -> bytes:
    """A real envelope of a random event type, broken in exactly one way."""
    wire = draw(st.sampled_from(WIRE))
    env = {**wire, "b": dict(wire["b"])}
    body = env["b"]
    field = draw(st.sampled_from(sorted(body)))
    how = draw(st.sampled_from([
        "drop_env", "extra_env", "drop_body", "extra_body", "wrong_type", "bad_version", "unknown_type",
        "body_not_map", "bad_producer", "negative", "overflow", "trailing", "non_utf8", "long_str",
        "key_size", "bad_pool", "bad_tier", "bad_staged", "many_fields",
    ]))
    if how == "drop_env":
        del env[draw(st.sampled_from(sorted(env)))]
    elif how == "extra_env":
        env[draw(st.text(max_size=4).filter(lambda s: s not in env))] = draw(INT)
    elif how == "drop_body":
        del body[field]
    elif how == "extra_body":
        body[draw(st.text(max_size=8).filter(lambda s: s not in body))] = 0
    elif how == "wrong_type":
        body[field] = draw(WRONG_TYPE)
    elif how == "bad_version":
        env["v"] = draw(st.sampled_from([0, SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, -1, True, float(SCHEMA_VERSION),
                                         str(SCHEMA_VERSION), None, 2**64 - 1]))
    elif how == "unknown_type":
        env["t"] = draw(st.one_of(st.text(max_size=10).filter(lambda s: s not in {w["t"] for w in WIRE}),
                                  INT, st.binary(max_size=5)))
    elif how == "body_not_map":
        env["b"] = draw(st.one_of(st.lists(INT, max_size=3), st.text(max_size=5), INT))
    elif how == "bad_producer":
        env["p"] = draw(st.one_of(BAD_NAME, INT, st.binary(max_size=5)))
    elif how == "negative":
        env[draw(st.sampled_from(["e", "s"]))] = draw(st.integers(max_value=-1, min_value=-(2**63)))
    elif how == "overflow":
        env[draw(st.sampled_from(["e", "s"]))] = draw(st.integers(2**63, 2**64 - 1))
    elif how == "trailing":
        return pack(env) + draw(st.binary(min_size=1, max_size=8))
    elif how == "non_utf8":
        # A str-typed msgpack value holding bytes that are not UTF-8 (old "raw" format).
        env["p"] = draw(NON_UTF8)
        return msgpack.packb(env, use_bin_type=False)
    elif how == "many_fields":
        env.update({f"x{i}": i for i in range(draw(st.integers(65, 80)))})  # past max_map_len
    else:
        # Field-specific breakage, on a field of the right kind for the drawn event.
        name = {"key_size": "key", "bad_pool": "pool", "bad_tier": "tier", "long_str": None,
                "bad_staged": "blocks"}[how]
        if how == "key_size":
            if "key" in body:
                body["key"] = draw(WRONG_KEY)
            elif "keys" in body:
                body["keys"] = [*body["keys"][:-1], draw(WRONG_KEY)]
            else:
                body["blocks"] = [[draw(WRONG_KEY), None, 0, 2]]
        elif how == "long_str":
            target = next((f for f in ("reason", "cause") if f in body), "pool")
            body[target] = "y" * draw(st.integers(MAX_STR + 1, 4 * MAX_STR))
        elif how == "bad_tier":
            target = next((f for f in ("tier", "src", "dst") if f in body), None)
            if target is None:
                body["pool"] = draw(BAD_NAME)
            else:
                body[target] = draw(st.sampled_from([len(Tier), -1, 255, 2**40]))
        elif how == "bad_staged":
            body["blocks"] = draw(st.sampled_from([[[bytes(K), None, 0]], [[bytes(K), None, 0, 2, 9]], [bytes(K)],
                                                   [[bytes(K), None, -1, 2]]]))
            if "blocks" not in wire["b"]:
                del body["blocks"]  # an unexpected field for this event type, then
                body["pool"] = draw(BAD_NAME)
        else:
            assert name == "pool"
            body["pool"] = draw(BAD_NAME)
    return pack(env)


JUNK = st.recursive(st.none() | st.booleans() | INT | st.text(max_size=8) | st.binary(max_size=8),
                   lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4),
                   max_leaves=12)


@st.composite
def packed_with_one_bad(draw) -> bytes:
    """A packed entry (publisher.py): real envelopes, and somewhere among them one that is not."""
    good = draw(st.lists(st.sampled_from(WIRE), min_size=0, max_size=4))
    bad = draw(st.one_of(JUNK, st.sampled_from([[], *[{**w, "v": SCHEMA_VERSION + 1} for w in WIRE]])))
    return pack([*good[:len(good) // 2], bad, *good[len(good) // 2:]] if bad != [] else [])


PAYLOAD = st.one_of(
    envelope_mutation(),
    envelope_mutation(),
    packed_with_one_bad(),
    st.binary(max_size=120),  # junk
    JUNK.map(pack),  # valid msgpack, not an envelope
    st.just(b""),  # an empty payload
    st.sampled_from([*LYING_LENGTHS, TOO_MANY_KEYS, OVERSIZED]),  # the big two: rarely, they cost MBs
)
EXTRA_FIELDS = st.dictionaries(st.binary(min_size=1, max_size=6).filter(lambda b: b != b"e"),
                               st.binary(max_size=12), max_size=2)
# Entries without the b"e" field: other names, some not UTF-8 (Redis field names are binary).
MISSING = st.dictionaries(st.binary(min_size=1, max_size=6).filter(lambda b: b != b"e"),
                          st.binary(max_size=12), min_size=1, max_size=3)


@st.composite
def hostile_entry(draw) -> dict[bytes, bytes]:
    if draw(st.integers(0, 9)) == 0:
        return draw(MISSING)
    return {**draw(EXTRA_FIELDS), b"e": draw(PAYLOAD)}


def expected_reason(fields: dict[bytes, bytes]) -> str:
    """The oracle: the codec must refuse the entry; its reason is what the dlq must carry."""
    if b"e" not in fields:
        return REASON_MISSING_FIELD
    if len(fields) != 1:
        return REASON_EXTRA_FIELDS
    try:
        env = decode_entry(fields[b"e"])
    except MalformedEvent as e:
        assert e.reason, "a reason fit for the dead-letter stream"
        return e.reason
    raise AssertionError(f"the generator built a valid entry: {env}")


class Recorder:
    def __init__(self) -> None:
        self.pools: list[str] = []

    async def __call__(self, d: Delivery) -> None:
        self.pools.append(d.envelope.event.pool)


async def run_batch(url: str, hostile: list[dict[bytes, bytes]]) -> None:
    tag = uuid.uuid4().hex[:8]
    stream, dlq, group = f"kvtier:{{h-{tag}}}:client", f"kvtier:{{h-{tag}}}:dlq", "g"
    r = make_redis(url, socket_timeout=5.0, connect_timeout=2.0, retries=1)
    try:
        pub = Publisher(r, "hostile-test", 1, 100_000)
        # Nil payloads: entries another consumer read and never acked, then deleted (trimmed).
        await r.xgroup_create(stream, group, id="0", mkstream=True)
        ghosts = [await pub.publish(stream, Access("ghost", (K,), 0)) for _ in range(3)]
        await r.xreadgroup(group, "ghost", {stream: ">"}, count=10)
        await r.xdel(stream, *ghosts)

        reasons = [expected_reason(f) for f in hostile]
        dead_ids, good = [], []
        for i, fields in enumerate(hostile):
            dead_ids.append(await r.xadd(stream, fields))
            if i % 7 == 6:  # good entries between the bad ones
                good.append(f"good-{i}")
                await pub.publish(stream, Access(good[-1], (K,), 0))
        good.append("last")
        await pub.publish(stream, Access("last", (K,), 0))

        rec = Recorder()
        stats = BusStats()
        consumer = Consumer(r, [stream], group, "c1", rec, dlq=dlq, read_count=7, block_ms=50, claim_idle_ms=50,
                            max_deliveries=3, publisher_maxlen=100_000, stats=stats, log=structlog.get_logger())
        task = asyncio.create_task(consumer.run())
        try:
            async def settled() -> bool:
                return (rec.pools[-1:] == ["last"] and stats.dead_lettered == len(hostile)
                        and stats.deleted_entries >= len(ghosts)
                        and (await r.xpending(stream, group))["pending"] == 0)

            await async_wait_until(settled, timeout=30, message="every entry handled, dead-lettered or acked")
            assert not task.done(), task  # never crashed
        finally:
            consumer.stop()
            await asyncio.wait_for(task, timeout=5)
        assert rec.pools == good, "good entries handled once each, in order, none held up"
        assert stats.handler_errors == 0 and stats.redis_errors == 0 and stats.delivered == len(good)
        letters = await r.xrange(dlq)
        assert [f[b"id"] for _, f in letters] == dead_ids
        for (_, f), fields, reason in zip(letters, hostile, reasons):
            assert f[b"stream"] == stream.encode() and f[b"reason"].decode() == reason
            assert f.get(b"e") == fields.get(b"e"), "the raw payload travels with its dead letter"
    finally:
        await r.delete(stream, dlq)
        await r.aclose()


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(st.lists(hostile_entry(), min_size=30, max_size=50))
def test_hostile_entries_are_dead_lettered_and_never_hold_up_good_ones(redis_server, hostile) -> None:
    asyncio.run(run_batch(redis_server.url, hostile))


# --- the same through a running daemon, on every stream it consumes --------------------------

FIXED = [
    {b"e": b"\xc1"}, {b"e": b""}, {b"x": b"1"}, {b"\xff\xfe": b"\x00"},
    {b"e": LYING_LENGTHS[0]}, {b"e": LYING_LENGTHS[-1]}, {b"e": TOO_MANY_KEYS},
    {b"e": pack({**WIRE[3], "b": {**WIRE[3]["b"], "key": b"k" * 31}})},
    {b"e": msgpack.packb({**WIRE[0], "p": b"\xff\xfe"}, use_bin_type=False)},
    {b"e": pack({**WIRE[7], "s": 2**64 - 1})},
    {b"e": pack({**WIRE[8], "b": {**WIRE[8]["b"], "tier": 7}}), b"extra": b"x"},
]


async def test_daemon_survives_hostile_entries_on_every_stream(daemon_factory, redis_server):
    d = daemon_factory(node="hostile")
    r = redis_server.client()
    node = d.node
    streams = [f"kvtier:{{{node}}}:{s}" for s in ("client", "tier:gpu", "tier:cpu", "tier:redis", "facts")]
    try:
        async with await Client.connect(d.runtime_dir) as client:
            keys = client.block_keys("t", list(range(16 * 3)), salt=b"hostile")
            kv = make_kv(3, seed=41)
            await client.put("t", keys, kv)
            assert await client.wait_resident("t", keys, timeout=10)
            for s in streams:
                for fields in FIXED:
                    r.xadd(s, fields)
            n = len(streams) * len(FIXED)
            wait_until(lambda: r.xlen(f"kvtier:{{{node}}}:dlq") >= n, timeout=20, message=f"{n} dead letters")
            letters = [f for _, f in r.xrange(f"kvtier:{{{node}}}:dlq")]
            assert len(letters) == n and all(f[b"reason"] for f in letters)
            assert {f[b"stream"].decode() for f in letters} == set(streams)
            for s in streams:
                wait_until(lambda s=s: r.xpending(s, "kvtier")["pending"] == 0, timeout=10, message=f"{s} acked")
            assert d.alive
            out = torch.empty((3, *SHAPE), dtype=torch.float16)
            assert await client.get("t", keys, out) == 3 and same_bytes(out, kv)
            more = client.block_keys("t", list(range(100, 100 + 16 * 2)), salt=b"hostile")
            await client.put("t", more, make_kv(2, seed=42))
            assert await client.wait_resident("t", more, timeout=10), "a good put behind the junk is handled"
    finally:
        r.close()


async def test_meaningless_batches_are_dead_lettered_with_their_reason(daemon_factory, redis_server):
    """Well-formed on the wire, meaningless to the daemon: a stored_batch whose columns differ in
    length, a store_batch on another tier's stream. Each is dead-lettered, and puts still work."""
    d = daemon_factory(node="hostile-batch")
    r = redis_server.client()
    node = d.node
    bad = [
        ("facts", StoredBatch("t", Tier.CPU, Cause.STORE, (K, K), (None,), (2, 3)), "differ in length"),
        ("tier:gpu", StoreBatch("t", Tier.CPU, SEG, (StagedBlock(K, None, 0, 2),)), "not a command for the gpu worker"),
    ]
    try:
        for stream, ev, _ in bad:
            r.xadd(f"kvtier:{{{node}}}:{stream}", {b"e": encode(Envelope(ev, "hostile/x", 1, 1))})
        dlq = f"kvtier:{{{node}}}:dlq"
        wait_until(lambda: r.xlen(dlq) >= len(bad), timeout=20, message="both dead-lettered")
        reasons = {f[b"stream"].decode(): f[b"reason"].decode() for _, f in r.xrange(dlq)}
        for stream, _, needle in bad:
            assert needle in reasons[f"kvtier:{{{node}}}:{stream}"], reasons
        async with await Client.connect(d.runtime_dir) as client:
            keys = client.block_keys("t", list(range(16 * 2)), salt=b"hostile-batch")
            await client.put("t", keys, make_kv(2, seed=43))
            assert await client.wait_resident("t", keys, timeout=10)
    finally:
        r.close()
