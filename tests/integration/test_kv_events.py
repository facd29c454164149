"""KV events for routers (issue 16, emit): a real daemon publishes its tier facts in vLLM's ZMQ
wire format; a SUB socket and the replay protocol read them back. Decoding with vLLM's own
classes: tests/vllm/test_kv_events_vllm.py."""

from __future__ import annotations

import shutil

import msgpack
import pytest

from kvtier.client import Client
from kvtier.core.kv_events import block_hash
from tests.support.blocks import make_kv
from tests.support.kv_events import Subscriber, endpoints, events_toml, replay, send_raw
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

THROUGH = '[policy]\nredis_write = "write-through"\n'


@pytest.fixture
def ipc():
    pub, rep, d = endpoints()
    yield pub, rep
    shutil.rmtree(d, ignore_errors=True)


def stats(d) -> dict:
    """The publisher's counters in the daemon's stats.json ({} until the first write)."""
    try:
        return d.stats()["kv_events"] or {}
    except (OSError, ValueError, KeyError):
        return {}


async def test_facts_become_vllm_kv_events_with_replay(daemon_factory, ipc) -> None:
    pub, rep = ipc
    d = daemon_factory(node="ev", extra=THROUGH + events_toml(pub, rep))
    sub = Subscriber(pub)
    try:
        # The start is announced before any subscriber can have joined: replay gets it.
        first = replay(rep, 0)
        assert first[0][1] == 0 and first[0][0] == f"kv@{d.node}@test-model".encode()
        ts, events, rank = msgpack.unpackb(first[0][2])
        assert events == [{"type": "AllBlocksCleared"}] and rank == 0 and ts > 0
        wait_until(lambda: (sub.drain(), True)[1] and stats(d).get("sent", 0) >= 1, 10)

        async with await Client.connect(d.runtime_dir) as c:
            tokens = [1000 + i for i in range(16 * 4)]
            keys = c.block_keys("t", tokens, salt=b"ev")
            assert (await c.put("t", keys, make_kv(4, seed=3), token_ids=tokens)).staged == 4
            hashes = [block_hash(k) for k in keys]

            def announced(evs, medium):
                got = [h for e in evs if e["type"] == "BlockStored" and e["medium"] == medium
                       for h in e["block_hashes"]]
                return all(h in got for h in hashes)

            evs = sub.wait_for(lambda evs: announced(evs, "CPU") and announced(evs, "STORAGE"), 15,
                               "BlockStored in CPU and STORAGE")
        stored = next(e for e in evs if e["type"] == "BlockStored" and e["medium"] == "CPU")
        assert set(stored) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name"}
        assert stored["block_size"] == 16 and stored["lora_id"] is None
        for medium in ("CPU", "STORAGE"):  # the tokens of every block, in block order, in both media
            runs = [e for e in evs if e["type"] == "BlockStored" and e["medium"] == medium]
            assert [t for e in runs for t in e["token_ids"]][:64] == tokens
        chain = [h for e in evs if e["type"] == "BlockStored" and e["medium"] == "CPU" for h in e["block_hashes"]]
        assert chain[:4] == hashes  # in chain order
        # Sequence numbers: one counter, no gaps, and the replay returns the same messages.
        seqs = [m[1] for m in sub.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        again = replay(rep, seqs[0])
        assert [(t, s, p) for t, s, p in again[:len(sub.messages)]] == sub.messages
        assert all(p == sub.messages[i][2] for i, (_, _, p) in enumerate(again[:len(sub.messages)]))
    finally:
        sub.close()


async def test_evictions_are_removed_events(daemon_factory, ipc) -> None:
    pub, rep = ipc
    d = daemon_factory(node="evx", cpu=16, gpu=0, extra=THROUGH + events_toml(pub, rep))
    sub = Subscriber(pub)
    try:
        wait_until(lambda: stats(d).get("sent", 0) >= 1, 10)
        async with await Client.connect(d.runtime_dir) as c:
            for r in range(4):  # 48 blocks through a 16-block cpu tier: it sheds to Redis
                keys = c.block_keys("t", list(range(16 * 12)), salt=b"x%d" % r)
                await c.put("t", keys, make_kv(12, seed=r))
                last = block_hash(keys[-1])
                sub.wait_for(lambda evs, h=last: any(
                    h in e.get("block_hashes", ()) for e in evs if e["type"] == "BlockStored"), 10, "round stored")
        evs = sub.wait_for(lambda evs: any(e["type"] == "BlockRemoved" and e["medium"] == "CPU" for e in evs),
                           20, "BlockRemoved from CPU")
        removed = {h for e in evs if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
        stored_cpu = {h for e in evs if e["type"] == "BlockStored" and e["medium"] == "CPU"
                      for h in e["block_hashes"]}
        assert removed <= stored_cpu  # only what was announced is withdrawn
    finally:
        sub.close()


async def test_a_restart_clears_then_reannounces_what_the_arena_kept(daemon_factory, ipc) -> None:
    pub, rep = ipc
    d = daemon_factory(node="evr", gpu=0, persist_arena=True, extra=events_toml(pub, rep))  # the cpu arena persists
    async with await Client.connect(d.runtime_dir) as c:
        keys = c.block_keys("t", list(range(16 * 3)), salt=b"kept")
        assert (await c.put("t", keys, make_kv(3, seed=5))).staged == 3
        assert await c.wait_resident("t", keys, timeout=10)
    d.stop(10)
    d.start()
    want = {block_hash(k) for k in keys}

    def reannounced():
        """The replay once it names the kept blocks (READY does not wait for the arena's scan)."""
        msgs = replay(rep, 0)
        evs = [e for _, _, p in msgs for e in msgpack.unpackb(p)[1]]
        kept = {h for e in evs[1:] if e["type"] == "BlockStored" for h in e["block_hashes"]}
        return (msgs, evs) if want <= kept else None

    msgs, evs = wait_until(reannounced, timeout=15, interval=0.1, message="the kept blocks announced again")
    assert msgs[0][1] == 0  # a new publisher: the sequence starts again
    assert evs[0] == {"type": "AllBlocksCleared"}


def test_hostile_replay_requests_are_dropped_and_counted(daemon_factory, ipc) -> None:
    pub, rep = ipc
    d = daemon_factory(node="evh", extra=events_toml(pub, rep))
    for frames in ([b"x"], [b"", b"1234"], [b"", b"12345678", b"more"], [b"junk", b"12345678"]):
        assert send_raw(rep, frames) is False  # no answer to a malformed request
    wait_until(lambda: stats(d).get("bad_requests") == 4, 10, message="counted")
    assert d.alive
    assert replay(rep, 0)[0][1] == 0  # and the socket still serves a good one


def test_a_taken_endpoint_fails_the_start_clearly(daemon_factory) -> None:
    from kvtier.tools.daemon_process import DaemonStartError
    from kvtier.tools.redis_cluster import free_port

    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    daemon_factory(node="eva", extra=events_toml(pub, rep))
    second = daemon_factory(node="evb", start=False, extra=events_toml(pub, rep))
    with pytest.raises(DaemonStartError):
        second.start(timeout=20)
    assert "[events] cannot bind" in second.log_tail()


def test_the_endpoints_must_be_local() -> None:
    from kvtier.config import ConfigError, load_config

    for bad in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.5:5557", "ipc://relative"):
        with pytest.raises(ConfigError, match="endpoint"):
            load_config(None, {"KVTIER__EVENTS__ENDPOINT": bad})


async def test_a_put_without_tokens_is_announced_without_them(daemon_factory, ipc) -> None:
    from kvtier.errors import BadRequest

    pub, rep = ipc
    d = daemon_factory(node="evt", extra=events_toml(pub, rep))
    sub = Subscriber(pub)
    try:
        wait_until(lambda: stats(d).get("sent", 0) >= 1, 10)
        async with await Client.connect(d.runtime_dir) as c:
            keys = c.block_keys("t", list(range(32)), salt=b"no-tokens")
            with pytest.raises(BadRequest, match="token_ids"):
                await c.put("t", keys, make_kv(2, seed=4), token_ids=list(range(31)))
            with pytest.raises(BadRequest):
                await c.put("t", keys, make_kv(2, seed=4), token_ids=[-1] * 32)
            assert (await c.put("t", keys, make_kv(2, seed=4))).staged == 2
            h = block_hash(keys[1])
            evs = sub.wait_for(lambda evs: any(h in e.get("block_hashes", ()) for e in evs), 10, "stored")
        assert all(e["token_ids"] == [] for e in evs if e["type"] == "BlockStored")
    finally:
        sub.close()
