"""The daemon hears its node's engines (issue 16, ingest): their KV events put the engine's own
GPU blocks in the prefix index (tier `engine`); a gap is replayed, a restart withdraws what the
engine held, hostile frames are dropped and counted."""

from __future__ import annotations

import pytest

from kvtier.client import Client
from kvtier.tools.redis_cluster import free_port
from tests.support.kv_events import FakeEngine, block_stored
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration


def ingest_toml(pub: str, replay: str) -> str:
    return (f'[prefix_index]\nenabled = true\nttl_s = 60\nrefresh_s = 5.0\n'
            f'[ingest]\nengines = "e0 {pub} {replay}"\npool = "t"\n')


def ingest_stats(d) -> dict:
    """The daemon's ingest counters in stats.json ({} until the first write)."""
    try:
        return d.stats()["ingest"] or {}
    except (OSError, ValueError, KeyError):
        return {}


async def _holds(client: Client, keys, holder: str, n: int) -> bool:
    w = await client.where("t", keys)
    return any(r.node == holder and r.length == n and set(r.tiers) == {"engine"} for r in w.nodes)


async def test_engine_events_feed_where(daemon_factory) -> None:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    eng = FakeEngine(pub, rep)
    d = daemon_factory(node="ing", extra=ingest_toml(pub, rep))
    holder = f"{d.node}/e0"
    try:
        async with await Client.connect(d.runtime_dir) as c:
            tokens = list(range(5000, 5000 + 16 * 6))
            keys = c.block_keys("t", tokens)
            # the SUB joins after the daemon starts: publish until it is heard (slow joiner)
            eng.publish(0, [block_stored([101, 102], None, tokens[:32])])

            async def heard():
                if ingest_stats(d).get("messages", 0) == 0:
                    eng.publish(0, [block_stored([101, 102], None, tokens[:32])])
                return await _holds(c, keys, holder, 2)

            await async_wait_until(heard, 15, interval=0.2, message="the engine's first blocks indexed")
            # seq 1 and 2 are lost on the way: seq 3 reveals the gap, the replay brings them
            eng.publish(1, [block_stored([103], 102, tokens[32:48])], send=False)
            eng.publish(2, [block_stored([104], 103, tokens[48:64])], send=False)
            eng.publish(3, [block_stored([105, 106], 104, tokens[64:96])])
            await async_wait_until(lambda: _holds(c, keys, holder, 6), 15, message="the gap was replayed")
            assert eng.replay_requests >= 1
            wait_until(lambda: ingest_stats(d).get("gaps", 0) >= 1 and ingest_stats(d).get("replays", 0) >= 1, 10)
            # the engine drops its last block, then restarts (sequence back to 0)
            eng.publish(4, [{"type": "BlockRemoved", "block_hashes": [106], "medium": "GPU"}])
            await async_wait_until(lambda: _holds(c, keys, holder, 5), 15)
            eng.buffer.clear()
            eng.publish(0, [block_stored([201], None, tokens[:16])])
            await async_wait_until(lambda: _holds(c, keys, holder, 1), 15, message="a restart withdraws the rest")
            # hostile frames: dropped and counted, the daemon goes on
            for frames in ([b"x"], [b"t", b"short", b"p"], [b"t", b"\x00" * 8, b"\xc1\xc1\xc1"],
                           [b"t", b"\x00" * 7 + b"\x01", b"\x93\xcb@\x00\x00\x00\x00\x00\x00\x00\x91\xa3bad\x00"]):
                eng.send_raw(frames)
            wait_until(lambda: ingest_stats(d).get("bad_messages", 0) >= 4, 10)
            assert d.alive
            eng.publish(1, [{"type": "AllBlocksCleared"}])
            await async_wait_until(lambda: _check_empty(c, keys, holder), 15, message="AllBlocksCleared")
    finally:
        eng.close()


async def _check_empty(c: Client, keys, holder: str) -> bool:
    w = await c.where("t", keys)
    return all(r.node != holder for r in w.nodes)


def test_ingest_needs_the_prefix_index_and_a_pool() -> None:
    from kvtier.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="prefix_index.enabled"):
        load_config(None, {"KVTIER__INGEST__ENGINES": "e0 tcp://127.0.0.1:5557", "KVTIER__INGEST__POOL": "p"})
    with pytest.raises(ConfigError, match="ingest.pool"):
        load_config(None, {"KVTIER__INGEST__ENGINES": "e0 tcp://127.0.0.1:5557",
                           "KVTIER__PREFIX_INDEX__ENABLED": "true"})
    with pytest.raises(ConfigError, match="ingest.engines"):
        load_config(None, {"KVTIER__INGEST__ENGINES": "e0 tcp://10.1.2.3:5557"})
