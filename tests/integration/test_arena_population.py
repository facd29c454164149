"""An 8 GiB cpu arena (a million 8 KiB slots) through a real daemon: READY before the arena is
populated, put and get served meanwhile, exact bytes or misses during population, and a kill -9
mid-population followed by a warm restart that serves nothing torn. (The restarted population
running to its end over the holes a kill left: test_arena_population_threads.py, in-process.)

The order of events is read from the daemon's own log and stats ("daemon.ready", the arena's
state, "arena.populated"), never from a timing threshold.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvtier.client import Client
from kvtier.runtime import DESCRIPTOR, read_json
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import SLOT_MAGIC, Flags, Kind, SlotTable, checksum
from tests.support.blocks import SHAPE, make_kv, put_and_read_back, same_bytes
from tests.support.daemon_proc import POOL_TOML
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

BIG_POOL = POOL_TOML.format(name="t", gpu=0, cpu=1).replace("cpu_blocks = 1", 'cpu_bytes = "8GiB"')


def events(d) -> list[dict]:
    return d.log_events()


def names(d) -> list[str]:
    return [e.get("event", "") for e in events(d)]


def arena(d) -> dict:
    return d.pool_stats().get("arena") or {}


def check_arena(node: str, runtime_dir) -> int:
    """Every slot the arena's headers call valid holds exactly the bytes its checksum names."""
    pool = read_json(runtime_dir / DESCRIPTOR)["pools"]["t"]
    seg = ShmSegment.attach(f"kvtier.{node}.t.cpu", trusted_uid=os.geteuid())
    table = SlotTable.open(seg, Kind.ARENA, bytes.fromhex(pool["fingerprint"]), pool["block_bytes"])
    h = table.headers(0, table.n).copy()
    valid = np.flatnonzero((h["magic"] == SLOT_MAGIC) & (h["flags"] == Flags.VALID) & (h["gen"] % 2 == 0))
    try:
        for slot in valid:
            assert checksum(table.payload(int(slot))) == int(h["checksum"][slot]), f"slot {slot} is corrupt"
    finally:
        table.close()
    return len(valid)


@pytest.mark.timeout(300)
@pytest.mark.slow
async def test_an_8gib_arena_serves_while_it_populates_and_a_kill_9_mid_population_serves_nothing_torn(
        daemon_factory):
    d = daemon_factory(node="big", persist_arena=True, pools_toml=BIG_POOL,
                       extra="\n[arena]\npopulate_threads = 1\npopulate_chunk = \"64MiB\"\n")
    arena_name = f"kvtier.{d.node}.t.cpu"
    try:
        # READY came, and the daemon says its arena is not populated yet.
        seen = names(d)
        assert "daemon.ready" in seen and "arena.populated" not in seen, seen
        a = wait_until(lambda: arena(d), message="the first stats snapshot")
        assert a["bytes"] >= 8 << 30 and a["slots"] >= 1 << 20, a
        assert a["state"] == "populating" and a["populated_bytes"] < a["bytes"], a

        async with await Client.connect(d.runtime_dir) as client:
            keys, kv = await put_and_read_back(client, b"first", 8, seed=1)
            out = torch.empty((8, *SHAPE), dtype=torch.float16)
            # A put and a get served, and only now: is the population still under way? The
            # daemon's own report says so (a stats snapshot written after the get).
            wait_until(lambda: arena(d).get("in_service", 0) >= 1, message="a fresh stats snapshot")
            seen = names(d)
            assert "arena.populated" not in seen and arena(d)["state"] == "populating", (
                "the arena was fully populated before the put and get; nothing was shown")

            # Gets racing the population (and the puts they follow): exact bytes or a miss.
            rounds = hits = 0
            while arena(d).get("state") == "populating" and rounds < 40:
                ks = client.block_keys("t", list(range(16 * 4)), salt=f"race-{rounds}".encode())
                data = make_kv(4, seed=100 + rounds)
                await client.put("t", ks, data)
                got = torch.zeros((4, *SHAPE), dtype=torch.float16)
                n = await client.get("t", ks, got)
                assert same_bytes(got[:n], data[:n]), f"round {rounds}: wrong bytes for a block got during population"
                if rounds % 2:  # and once it is in: a hit, exact
                    assert await client.wait_resident("t", ks, timeout=20)
                    n = await client.get("t", ks, got)
                    assert n == 4 and same_bytes(got, data), f"round {rounds}: a resident block read wrong"
                hits += n
                assert await client.get("t", keys, out) == 8 and same_bytes(out, kv)
                rounds += 1
            assert rounds > 0 and hits > 0

            # kill -9 with a put in flight, before the population ends.
            tail = client.block_keys("t", list(range(16 * 32)), salt=b"in-flight")
            tail_kv = make_kv(32, seed=7)
            await client.put("t", tail, tail_kv)
            assert "arena.populated" not in names(d), "population ended before the kill: the kill proves nothing"
            d.kill()
        assert "arena.populated" not in names(d), "the daemon died mid-population"
        populated_before = arena(d)["populated_bytes"]

        d.start()  # warm: re-attaches the arena, READY again before the rest is populated
        seen = names(d)
        assert seen.count("arena.reattached") == 1 and seen.count("daemon.ready") == 2, seen
        async with await Client.connect(d.runtime_dir) as client:
            # Kept blocks come back as the population reaches their chunk; until then, a miss.
            async def kept_back() -> bool:
                out = torch.zeros((8, *SHAPE), dtype=torch.float16)
                n = await client.get("t", keys, out)
                assert same_bytes(out[:n], kv[:n]), "a kept block came back wrong"
                got = torch.zeros((32, *SHAPE), dtype=torch.float16)
                m = await client.get("t", tail, got)
                assert same_bytes(got[:m], tail_kv[:m]), "a block put as the daemon died came back wrong"
                return n == 8

            await async_wait_until(kept_back, timeout=120, interval=0.05, message="the kept blocks restored")
            a = wait_until(lambda: arena(d).get("kept", 0) >= 8 and arena(d), message="the restored blocks counted")
            assert a["state"] == "populating", a  # still filling the holes the kill left
            # The slot headers agree: every block the arena holds verifies (the headers are
            # populated before READY; a valid slot's pages exist, as it was written).
            assert check_arena(d.node, d.runtime_dir) >= 8
            # And the arena takes new blocks in the slots the restart populated.
            await put_and_read_back(client, b"after", 4, seed=9)
        print(f"\n8 GiB arena: {rounds} racing rounds, {hits} blocks got during population, "
              f"{populated_before >> 20} MiB populated at the kill, {a['kept']} blocks restored so far")
    finally:
        d.stop_or_kill(20)
        ShmSegment.unlink_name(arena_name)


async def test_an_arena_bigger_than_dev_shm_fails_the_start_clearly(daemon_factory):
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (4 << 30)
    pool = POOL_TOML.format(name="t", gpu=0, cpu=1).replace("cpu_blocks = 1", f"cpu_bytes = {too_big}")
    d = daemon_factory(node="huge", start=False, pools_toml=pool)
    d.start(wait_ready=False)
    wait_until(lambda: not d.alive, timeout=30, message="the daemon gives up")
    assert d.proc.returncode != 0
    log = d.log_tail(20000)
    assert "needs" in log and "/dev/shm has" in log and "free" in log, log
    assert not ShmSegment.exists(f"kvtier.{d.node}.t.cpu"), "a refused arena must leave no file behind"
