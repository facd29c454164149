"""The disk tier in a real daemon (issue 30): the cpu tier sheds into it what admission lets in,
clients read its blocks themselves from the block file, it holds its capacity under a flood,
it is adopted again after a kill -9, damaged blocks are misses, and an I/O error (injected EIO,
a full disk, or a real read-only remount) turns it off while the other tiers keep serving.

The block file lives under pytest's tmp_path (ext4 here) or on a tmpfs the test mounts; the
blockfile's own rules are tested in tests/integration/test_disk_blockfile.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.client import Client
from kvtier.core.events import Tier
from kvtier.disk.blockfile import DiskBlockFile
from kvtier.shm.slots import HEADER_OFF, SLOT_HDR, checksum
from kvtier.store.redis_blocks import redis_block_key
from tests.support.blocks import SHAPE, make_kv, same_bytes, stored_somewhere
from tests.support.mounts import mounted
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.integration

BB = 8192  # the test pool's block: 8 KiB, one page
DISK_BYTES = 1 << 20  # ~125 blocks with their headers
ADMIT_ALL = '[policy]\ndisk_admit_after = 0\n'
CPU = 16  # 4-block chains, one at a time: above 14 blocks (its high watermark) cpu sheds down to 12


def disk(d) -> dict:
    return d.pool_stats().get("tiers", {}).get("disk", {})


def disk_state(d) -> dict:
    return d.pool_stats().get("disk") or {}


def block_file(d) -> Path:
    wait_until(lambda: "path" in disk_state(d), timeout=10, message="the disk tier in stats.json")
    return Path(disk_state(d)["path"])


async def put_chains(client: Client, d, n: int, base: int, seed: int = 0, blocks: int = 4
                     ) -> list[tuple[list, torch.Tensor]]:
    """n chains, one at a time: each stored and the cpu tier back at its low watermark before the
    next, so that what it sheds goes down through the disk tier (a put into a full cpu tier
    spills its tail straight to Redis instead)."""
    chains = []
    for i in range(n):
        dropped = _dropped(d)
        keys = client.block_keys("t", list(range(base + i * 10**5, base + i * 10**5 + 16 * blocks)))
        kv = make_kv(blocks, seed=seed + i)
        res = await client.put("t", keys, kv)
        assert res.dropped == 0, res
        # Stored, or its drop counted (a put into a full cpu tier can lose the race for a clean
        # slot: a miss later, reported, never wrong bytes; see the flood test).
        await async_wait_until(lambda keys=keys, before=dropped: _dropped(d) > before or stored_somewhere(client, keys),
                               timeout=10, message="put stored")
        await async_wait_until(lambda: _settled(d), timeout=10, message="cpu at or below its high watermark")
        chains.append((keys, kv))
    return chains


def adopted(d) -> None:
    """Wait for this daemon process's stats to show its adoption of the block file done."""
    wait_until(lambda: d.stats().get("pid") == d.proc.pid and disk_state(d).get("adopt_s") is not None,
               timeout=20, message="the restarted daemon adopted its block file")


def _dropped(d) -> int:
    return d.pool_stats().get("puts_dropped", 0)


def _settled(d) -> bool:
    cpu = d.pool_stats().get("tiers", {}).get("cpu")
    return cpu is not None and cpu["blocks"] <= 14 and cpu["incoming"] == 0


async def read_whole(client: Client, keys, kv, remote: bool = False) -> int:
    """How many leading blocks of the chain a get returns; every one of them must be exact."""
    out = torch.empty((len(keys), *SHAPE), dtype=torch.float16)
    n = await client.get("t", keys, out, remote=remote)
    assert same_bytes(out[:n], kv[:n]), "wrong bytes"
    return n


async def test_cpu_sheds_reused_blocks_to_disk_and_clients_read_them_from_the_file(daemon_factory, tmp_path):
    """Admission by reuse (read once: admitted; never read: on to Redis, counted), the block file
    allocated in full, and a client reading disk-resident blocks itself, byte-exact."""
    d = daemon_factory(gpu=0, cpu=CPU, disk_dir=tmp_path / "disk", disk_bytes=DISK_BYTES)
    f = block_file(d)
    assert f.stat().st_size <= DISK_BYTES and f.stat().st_blocks * 512 >= f.stat().st_size - 4096
    async with await Client.connect(d.runtime_dir) as c:
        hot = await put_chains(c, d, 2, base=0)
        for keys, kv in hot:  # read once: admitted to disk when cpu sheds them
            assert await read_whole(c, keys, kv) == 4
        # The reads are reported a few ms later, on their own: counted before the next puts, or
        # the cold chains come in older than the hot ones and cpu sheds them first.
        await async_wait_until(lambda: d.pool_stats().get("hits", 0) >= 8, timeout=10, message="the reads counted")
        cold = await put_chains(c, d, 4, base=10**7)  # 16 blocks more: cpu sheds the hot ones, then these
        # Tail first: cpu sheds a chain's leaves, so the hot chains' tails reach the disk first.
        await async_wait_until(lambda: disk(d).get("blocks", 0) >= 2, timeout=20, message="hot chains' tails on disk")
        adm = disk_state(d)["admission"]
        assert adm["reused"] >= 1 and adm["cold"] >= 1, adm
        assert disk_state(d)["state"] == "on" and disk_state(d)["direct"], disk_state(d)
        on_disk = [k for keys, _ in hot for k in keys if (c.pool("t").locate(k) or (None,))[0] == Tier.DISK]
        assert len(on_disk) >= 2, "the client finds disk-resident blocks in the directory"
        # The engines' path (the vLLM connector's worker half, SGLang's pages): get_with copies a
        # block out in pieces of the caller's layout and checks the caller's digest of them.
        want = {k: kv[i].contiguous().view(torch.uint8).reshape(-1).numpy() for keys, kv in hot
                for i, k in enumerate(keys)}
        pieces: dict[int, list[np.ndarray]] = {}
        got = await c.get_with("t", on_disk[:2], lambda i, src: pieces.__setitem__(i, [src[:BB // 2].copy(),
                                                                                        src[BB // 2:].copy()]),
                               lambda i: checksum(np.concatenate(pieces[i])))
        assert got == 2 and all(np.array_equal(np.concatenate(pieces[i]), want[k]) for i, k in enumerate(on_disk[:2]))
        for keys, kv in hot:
            assert await read_whole(c, keys, kv, remote=True) == 4, "a chain partly on disk read back whole"
        await async_wait_until(lambda: disk(d).get("hits", 0) >= 2, timeout=10, message="reads counted as disk hits")
        for keys, kv in cold:
            assert await read_whole(c, keys, kv, remote=True) == 4, "the cold chains, from Redis or the node"


async def test_the_disk_holds_its_capacity_under_a_write_flood(daemon_factory, tmp_path):
    """Ten times the disk tier's capacity through a small node: the file never grows, the tier
    never holds more than its slots, and every block is still read back exact from some tier."""
    d = daemon_factory(gpu=0, cpu=CPU, disk_dir=tmp_path / "disk", disk_bytes=256 << 10,
                       extra=ADMIT_ALL)
    size = block_file(d).stat().st_size
    cap = disk(d)["capacity"]
    assert cap == DiskBlockFile.slots_for(256 << 10, BB) and cap > 10
    peak = 0
    async with await Client.connect(d.runtime_dir) as c:
        chains = []
        for i in range(10 * cap // 4):
            chains += await put_chains(c, d, 1, base=i * 10**6)
            peak = max(peak, disk(d).get("blocks", 0))
        await async_wait_until(lambda: disk(d).get("blocks", 0) >= cap // 2, timeout=20, message="the disk filled")
        assert disk(d)["demoted_in"] > cap, "more went through the disk than it holds"
        broken = sum([await read_whole(c, keys, kv, remote=True) < 4 for keys, kv in chains])
        peak = max(peak, disk(d)["blocks"])
    assert peak <= cap and block_file(d).stat().st_size == size
    # Every chain is read back whole and exact, and no put was dropped. (A full cpu tier used to
    # count as room a parent it may not drop once its child stays on disk: 0-2 of 77 puts were
    # dropped here before Room._clean_spares learned that; 0 in 12 runs since.)
    assert broken == 0 and _dropped(d) == 0, (broken, _dropped(d))


async def test_blocks_are_adopted_after_kill_9_and_damaged_ones_are_misses(daemon_factory, tmp_path, redis_server):
    """kill -9 with blocks on disk only (cpu sheds into a disk with room: Redis never gets them),
    then a restart with a fresh cpu arena: READY first, adoption after it, and the chains are read
    whole from the file. Then, with the daemon stopped, one block's payload is flipped and
    another's header left odd (a torn write): both are misses, never wrong bytes."""
    d = daemon_factory(gpu=0, cpu=CPU, disk_dir=tmp_path / "disk", disk_bytes=DISK_BYTES, extra=ADMIT_ALL)
    async with await Client.connect(d.runtime_dir) as c:
        chains = await put_chains(c, d, 10, base=0)
        await async_wait_until(lambda: disk(d).get("blocks", 0) >= 12, timeout=20, message="chains shed to disk")
    d.kill()
    d.start()
    adopted(d)
    lines = d.log_path.read_text().splitlines()
    ready = max(i for i, x in enumerate(lines) if '"daemon.ready"' in x)
    assert any('"disk.adopted"' in x for x in lines[ready:]), "adopted after READY, by this start"
    assert disk_state(d)["adopted"] >= 12, disk_state(d)
    async with await Client.connect(d.runtime_dir) as c:
        on_disk = [(keys, kv) for keys, kv in chains if all(c.pool("t").locate(k) for k in keys)]
        assert len(on_disk) >= 2, [[bool(c.pool("t").locate(k)) for k in keys] for keys, _ in chains]
        r = redis_server.client()
        assert not any(r.exists(redis_block_key("t", k)) for keys, _ in on_disk for k in keys), \
            "Redis holds none of them: what is read comes from the block file"
        r.close()
        for keys, kv in on_disk:
            assert await read_whole(c, keys, kv) == 4
    f, fp = block_file(d), _fingerprint(d)
    d.stop()
    # Damage two blocks in the file while the daemon is down: find their slots by key.
    (k1, kv1), (k2, kv2) = on_disk[0], on_disk[1]
    bf, _ = DiskBlockFile.open_or_create(f, DiskBlockFile.slots_for(DISK_BYTES, BB), BB, fp)
    try:
        slots = {bytes(h["key"]): s for s, h in enumerate(bf.headers(0, bf.n)) if h["flags"]}
        s_flip, s_torn = slots[k1[2]], slots[k2[1]]
        payload_off, stride = bf.payload_off, bf.stride
    finally:
        bf.close()
    with open(f, "r+b") as fh:
        fh.seek(payload_off + s_flip * stride + 100)
        b = fh.read(1)
        fh.seek(payload_off + s_flip * stride + 100)
        fh.write(bytes([b[0] ^ 0xFF]))
        gen_at = HEADER_OFF + SLOT_HDR * s_torn + 8
        fh.seek(gen_at)
        gen = int.from_bytes(fh.read(8), "little")
        fh.seek(gen_at)
        fh.write((gen + 1).to_bytes(8, "little"))  # odd: a write that never finished
    d.start()
    adopted(d)
    async with await Client.connect(d.runtime_dir) as c:
        assert await read_whole(c, k1, kv1) == 2, "the flipped block is a miss: the chain stops before it"
        assert await read_whole(c, k2, kv2) == 1, "the torn block is not adopted"


def _fingerprint(d) -> bytes:
    from kvtier.runtime import DESCRIPTOR, read_json

    return bytes.fromhex(read_json(d.runtime_dir / DESCRIPTOR)["pools"]["t"]["fingerprint"])


@pytest.mark.parametrize("fault", ["eio:read:2", "enospc:write:3", "erofs:write:5"])
async def test_an_injected_io_error_turns_the_disk_off_and_the_node_serves_on(daemon_factory, tmp_path, fault):
    """EIO on a read (the device failing), ENOSPC on a write (a thin or COW filesystem full) or
    EROFS (remounted read-only after an error, as ext4's errors=remount-ro does):
    one disk.tier_off line, the tier off in status and metrics, its blocks reported gone, and
    puts and gets go on through cpu and Redis with no wrong byte and no dropped put."""
    d = daemon_factory(gpu=0, cpu=CPU, disk_dir=tmp_path / "disk", disk_bytes=DISK_BYTES,
                       extra=ADMIT_ALL, disk_extra=f'inject_fault = "{fault}"')
    async with await Client.connect(d.runtime_dir) as c:
        chains = await put_chains(c, d, 6, base=0)
        if fault.startswith("eio"):  # reads of disk-resident blocks (the daemon's, promoting them)
            await async_wait_until(lambda: disk(d).get("blocks", 0) >= 4, timeout=20, message="blocks on disk")
            for _ in range(3):
                for keys, kv in chains:
                    await read_whole(c, keys, kv, remote=True)
        await async_wait_until(lambda: disk_state(d).get("state") == "off", timeout=20, message="the disk tier off")
        off = [x for x in d.log_path.read_text().splitlines() if '"disk.tier_off"' in x]
        assert len(off) == 1 and fault.split(":")[0].upper() in off[0], off
        assert disk(d)["capacity"] == 0 and disk(d)["blocks"] == 0
        more = await put_chains(c, d, 6, base=10**8, seed=100)
        for keys, kv in chains[-2:] + more:
            assert await read_whole(c, keys, kv, remote=True) == 4, "served by cpu and Redis"
        metrics = urllib.request.urlopen(d.stats()["metrics_url"], timeout=5).read().decode()
        assert 'kvtier_disk_up{pool="t"} 0.0' in metrics
    assert d.pool_stats()["puts_dropped"] == 0


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")


async def test_a_read_only_filesystem_at_start_leaves_the_pool_serving_without_its_disk(daemon_factory, tmp_path):
    """A real EROFS: the disk tier's directory on a tmpfs mounted read-only (as a failed NVMe
    comes back after a reboot). The daemon starts all the same, says why its disk tier is off,
    and serves from cpu and Redis. (A filesystem remounted read-only under the running daemon is
    the injected "erofs" case above: tmpfs refuses a read-only remount while the file is open.)"""
    need_root()
    with mounted("tmpfs", tmp_path / "mnt", "size=8m,mode=0700") as mnt:
        (mnt / "disk").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        d = daemon_factory(gpu=0, cpu=CPU, disk_dir=mnt / "disk", disk_bytes=DISK_BYTES)
        wait_until(lambda: disk_state(d).get("state") == "off", timeout=10, message="the disk tier off in stats")
        assert "Read-only file system" in disk_state(d)["error"]
        off = [x for x in d.log_path.read_text().splitlines() if '"disk.tier_off"' in x]
        assert len(off) == 1 and "EROFS" in off[0], off
        assert "OFF since an I/O error" in subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "status", "--runtime-dir", str(d.runtime_dir)],
            capture_output=True, text=True, timeout=30).stdout
        async with await Client.connect(d.runtime_dir) as c:
            for keys, kv in await put_chains(c, d, 6, base=0):
                assert await read_whole(c, keys, kv, remote=True) == 4
        d.stop()
