"""Granted slots (kvtier/tiers/grants.py): a client writes a put's blocks straight into cpu arena
slots the daemon granted it, and the daemon only checks the header. Real daemons, a real Redis,
client processes killed with SIGKILL.

What must hold: puts through grants read back exactly; a put that names a slot not granted to
it, or a block whose checksum lies, is refused or missed, never read as wrong bytes; a client
killed mid-write leaks nothing (its grants come back, no READY or torn header stays); a daemon
restart stamps a new epoch, and a put granted by the old daemon is refused with its slot left
alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.client import Client
from kvtier.client.pools import host_rows
from kvtier.core.events import Put, StagedBlock
from kvtier.shm.grant_ring import GrantRing
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Flags, Kind, SlotTable
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CPU = 256  # the smallest arena that grants: 16 slots per client, 64 in all


def stat(d, key: str):
    """A figure of the daemon's pool stats, once its stats file has been written."""
    wait_until(lambda: key in d.pool_stats(), timeout=10, message=f"stats.json with {key}")
    return d.pool_stats()[key]


def keys_for(client: Client, i: int, n: int) -> list[bytes]:
    return client.block_keys("t", list(range(i * 10**6, i * 10**6 + 16 * n)))


async def put_chain(client: Client, i: int, n: int) -> tuple[list[bytes], torch.Tensor]:
    keys, kv = keys_for(client, i, n), make_kv(n, seed=i)
    res = await client.put("t", keys, kv, wait_s=5)
    assert res.staged == n, res
    return keys, kv


async def read_back(client: Client, keys: list[bytes], kv: torch.Tensor) -> bool:
    out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
    return await client.get("t", keys, out) == len(keys) and same_bytes(out, kv)


async def take_granted(client: Client, keys: list[bytes], chain: int) -> StagedBlock:
    """A granted arena slot taken for keys[0] by hand (the client's own put path would fill it):
    while the client holds no grant, it puts a block of chain `chain`, `chain + 1`, ... so that
    the daemon tops its grants up."""
    w = client.pool("t").stager()
    for i in range(200):
        taken = w.take_slots(keys, None)
        if taken and taken[0].granted:
            return taken[0]
        w.unstage(taken)
        await put_chain(client, chain + i, 1)
    pytest.fail("the client was granted no slot")


def arena_headers(client: Client) -> np.ndarray:
    arena = client.pool("t").arena
    return arena.headers(0, arena.n).copy()


async def test_puts_through_grants_read_back_exactly_and_the_grants_stay_bounded(daemon_factory) -> None:
    d = daemon_factory(gpu=0, cpu=CPU)
    async with await Client.connect(d.runtime_dir) as c:
        chains = []
        for i in range(12):
            chains.append(await put_chain(c, i, 4))
            assert await c.wait_resident("t", chains[-1][0], timeout=10), f"chain {i}"
        # The first put is staged; the daemon grants after it, and the later puts use the grants.
        await async_wait_until(lambda: d.pool_stats().get("granted_puts", 0) > 0, timeout=10,
                               message="puts through grants counted")
        stats = d.pool_stats()
        assert 0 < stats["grants_held"] <= CPU // 16, stats
        for i, (keys, kv) in enumerate(chains):
            assert await read_back(c, keys, kv), f"chain {i}"
        h = arena_headers(c)
        assert not (h["gen"] % 2).any() and not (h["flags"] == Flags.READY).any()  # every put flipped VALID
        # A put of blocks already here hands their granted slots back (a duplicate, not a second copy).
        before = stat(d, "grants_reclaimed")
        keys, kv = chains[0]
        assert (await c.put("t", keys, kv)).staged == len(keys)
        await async_wait_until(lambda: stat(d, "grants_reclaimed") > before or
                               stat(d, "puts") >= 12 * 4 + 4, timeout=10, message="the duplicate handled")
        assert await read_back(c, keys, kv)


async def test_a_put_that_names_a_slot_not_granted_to_it_or_lies_about_its_checksum_never_reads_wrong(
        daemon_factory) -> None:
    d = daemon_factory(gpu=0, cpu=CPU)
    async with await Client.connect(d.runtime_dir) as a, await Client.connect(d.runtime_dir) as b:
        held_keys, held_kv = await put_chain(a, 1, 4)
        assert await a.wait_resident("t", held_keys, timeout=10)
        victim = a.pool("t").locate(held_keys[0])
        assert victim is not None
        # b names a's slot as if granted to it, with the right epoch: refused, the slot untouched.
        await put_chain(b, 2, 4)  # b's segment is known to the daemon now
        wb = b.pool("t").stager()
        await async_wait_until(lambda: GrantRing(wb.seg.buf).epoch != 0, timeout=10, message="b's ring begun")
        forged = StagedBlock(keys_for(b, 3, 1)[0], None, victim[1], 2, granted=True)
        dropped = stat(d, "puts_dropped")
        await b._publisher.publish(b._client_stream, Put("t", wb.seg.name, (forged,), None,
                                                         GrantRing(wb.seg.buf).epoch))
        await async_wait_until(lambda: stat(d, "puts_dropped") > dropped, timeout=10,
                               message="the forged put refused")
        assert await read_back(a, held_keys, held_kv)
        # A granted block whose header checksum lies: adopted (the daemon never reads the
        # payload), but every read verifies, so it is a miss, never these bytes.
        liar = keys_for(b, 4, 1)
        blk = await take_granted(b, liar, 5)
        row = host_rows(make_kv(1, seed=77), 1)[0]
        arena = wb.arena
        assert arena is not None
        arena.payloads()[blk.slot, : row.size] = row
        gen = arena.end_write(blk.slot, blk.gen, blk.key, row.size, 12345, Flags.READY, None)
        await b._publisher.publish(b._client_stream, Put("t", wb.seg.name, (StagedBlock(blk.key, None, blk.slot, gen,
                                                                                        granted=True),), None,
                                                         wb.grant_epoch))
        await async_wait_until(lambda: arena.header(blk.slot).flags == Flags.VALID, timeout=10,
                               message="the lying block adopted")
        out = torch.empty((1, *SHAPE), dtype=torch.float16)
        assert await a.get("t", liar, out) == 0 and await b.get("t", liar, out) == 0


async def test_a_granted_header_mixed_from_two_writers_is_refused_never_read_as_the_other_block(
        daemon_factory) -> None:
    """Two writers of one granted slot (a client that outlived a daemon restart, and the one the
    new daemon granted it to) can leave one's key beside the other's checksum and payload. The
    daemon must not certify that mix: its tag binds the other key, so the put is refused. Were
    the tag made afresh at adoption, a read of this key would return the other block's bytes."""
    d = daemon_factory(gpu=0, cpu=CPU)
    async with await Client.connect(d.runtime_dir) as b:
        await put_chain(b, 2, 4)  # b's segment is known to the daemon, and granted slots
        wb = b.pool("t").stager()
        mine, theirs = keys_for(b, 8, 1), keys_for(b, 9, 1)
        blk, arena = await take_granted(b, mine, 10), wb.arena
        assert arena is not None
        # The other writer's block, whole, under its key; then this writer's key lands on top.
        gen = arena.write_reserved(blk.slot, blk.gen, theirs[0], host_rows(make_kv(1, seed=91), 1)[0], Flags.READY)
        arena.headers(0, arena.n)["key"][blk.slot] = np.frombuffer(mine[0], dtype="V32")[0]
        dropped = stat(d, "puts_dropped")
        await b._publisher.publish(b._client_stream, Put("t", wb.seg.name, (StagedBlock(mine[0], None, blk.slot, gen,
                                                                                        granted=True),), None,
                                                         wb.grant_epoch))
        await async_wait_until(lambda: stat(d, "puts_dropped") > dropped, timeout=10,
                               message="the mixed header refused")
        assert arena.header(blk.slot).flags == Flags.EMPTY
        out = torch.empty((1, *SHAPE), dtype=torch.float16)
        assert await b.get("t", mine, out) == 0


def _spawn_writer(rdir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.grant_writer", str(rdir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


async def test_a_client_killed_in_the_middle_of_writing_granted_slots_leaks_nothing(daemon_factory) -> None:
    d = daemon_factory(gpu=0, cpu=CPU)
    proc = _spawn_writer(d.runtime_dir)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        caught = json.loads(line)
        wait_until(lambda: d.pool_stats().get("grants_held", 0) >= 2, timeout=10, message="grants counted")
        held = stat(d, "grants_held")
        reclaimed = stat(d, "grants_reclaimed")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Within the reaper's period: the segment is gone, every grant it held is back, the READY
    # slot it never handed over and the half-written one are emptied.
    wait_until(lambda: stat(d, "grants_held") == 0, timeout=20, message="the dead client's grants back")
    assert stat(d, "grants_reclaimed") - reclaimed == held
    assert not ShmSegment.exists(caught["segment"])
    async with await Client.connect(d.runtime_dir) as c:
        h = arena_headers(c)
        for slot in (caught["ready"], caught["torn"]):
            assert h["flags"][slot] == Flags.EMPTY and h["gen"][slot] % 2 == 0, slot
        assert not (h["gen"] % 2).any() and not (h["flags"] == Flags.READY).any()
        cpu = stat(d, "tiers")["cpu"]
        assert cpu["blocks"] + cpu["incoming"] <= CPU
        keys, kv = await put_chain(c, 40, 8)  # the slots serve the next client
        assert await c.wait_resident("t", keys, timeout=10) and await read_back(c, keys, kv)


async def test_a_restarted_daemon_refuses_what_the_old_one_granted_and_keeps_no_half_written_slot(
        daemon_factory) -> None:
    d = daemon_factory(gpu=0, cpu=CPU, persist_arena=True)
    proc = _spawn_writer(d.runtime_dir)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, proc.stderr.read() if proc.stderr else ""
        caught = json.loads(line)
        ring = GrantRing(ShmSegment.attach(caught["segment"]).buf)
        old_epoch = ring.epoch
        d.kill()  # the daemon dies with the client still holding its grants
        d.start()
        # The new daemon stamped its epoch on the client's ring before serving: the client drops
        # the old grants before it writes into one again.
        assert ring.epoch not in (0, old_epoch)
        async with await Client.connect(d.runtime_dir) as c:
            arena = c.pool("t").arena
            for slot in (caught["ready"], caught["torn"]):  # neither restored as a block
                assert arena.header(slot).flags != Flags.VALID, slot
            # A put granted by the old daemon, arriving now: refused, and its slot left alone.
            dropped = stat(d, "puts_dropped")
            keys, kv = await put_chain(c, 50, 4)
            assert await c.wait_resident("t", keys, timeout=10)
            victim = c.pool("t").locate(keys[0])
            assert victim is not None
            stale = StagedBlock(keys_for(c, 51, 1)[0], None, victim[1], 2, granted=True)
            await c._publisher.publish(c._client_stream, Put("t", caught["segment"], (stale,), None, old_epoch))
            await async_wait_until(lambda: stat(d, "puts_dropped") > dropped, timeout=10,
                                   message="the stale put refused")
            assert await read_back(c, keys, kv)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_the_arena_table_is_writable_by_its_clients_only_through_their_mapping(tmp_path) -> None:
    """Grants need a writable client mapping; the daemon makes the arena 0600 (0660 with a shm
    group), never writable by others, which attach refuses anyway."""
    seg = ShmSegment.create(f"kvtier.test-arena-{os.getpid()}", 4 << 20, mode=0o600)
    try:
        SlotTable.format(seg, Kind.ARENA, 2, 8192, b"\0" * 32)
        w = ShmSegment.attach(seg.name, writable=True, trusted_uid=os.geteuid())
        assert w.writable and not ShmSegment.attach(seg.name).writable
        w.close()
        os.chmod(Path("/dev/shm") / seg.name, 0o662)
        with pytest.raises(Exception, match="writable by others"):
            ShmSegment.attach(seg.name, writable=True)
    finally:
        seg.close()
        seg.unlink()
