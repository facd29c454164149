"""The disk tier on a real daemon (issue 30): write-back throughput, and the two ways a client can
read a disk-resident block.

- write-back: a cpu tier of 192 blocks filled at once, with watermarks that shed nearly all of it
  into the disk tier in one go; blocks per second from the last put to the disk tier holding
  them, with the disk worker's copy threads at 1 and at 4 (`[daemon] copy_threads`);

- direct: the client reads the block file itself (kvtier/disk/reader.py), the path kvtier keeps;
- promote-ahead: the client asks the daemon to bring the blocks into the cpu arena (a prefetch:
  the daemon reads the file, verifies, writes the arena slot), waits until they are there, then
  reads them from shared memory.

A daemon on the embedded Redis with a 2 MiB-block pool, a 16-block cpu arena and a disk tier in
a temporary directory (ext4 here: O_DIRECT). Chains are put one at a time so that the cpu tier
sheds them into the disk tier; each round then reads the chains found only on disk, once by each
path (the page cache dropped before each), and reports per-block latency and GB/s.

    .venv/bin/python benchmarks/disk_read_paths.py [--dir /var/tmp] [--chains 24] [--skip-writeback]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.client import Client
from kvtier.core.events import Tier
from kvtier.runtime import STATS, read_json
from kvtier.tools.daemon_process import DaemonProcess

POOL = """
[disk]
dir = "{disk}"
reserve_bytes = 0

[policy]
disk_admit_after = 0

[pools.b]
model = "bench"
layers = 32
kv_heads = 8
head_dim = 128
block_tokens = 16
dtype = "float16"
device = "cpu"
gpu_blocks = 0
cpu_blocks = 16
disk_bytes = "512MiB"
"""
BLOCKS = 4  # per chain


def where(c: Client, k: bytes) -> Tier | None:
    hit = c.pool("b").locate(k)
    return None if hit is None else hit[0]


async def until(pred, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)


def _settled(rdir: Path, puts: int) -> bool:
    try:
        p = read_json(rdir / STATS)["pools"]["b"]
    except (OSError, ValueError, KeyError):
        return False
    cpu, disk = p["tiers"]["cpu"], p["tiers"]["disk"]
    return p["puts"] >= puts and cpu["blocks"] <= 14 and cpu["incoming"] == 0 and disk["incoming"] == 0


def drop_caches(disk_dir: Path) -> None:
    import os

    for f in disk_dir.glob("*.blocks"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


async def run(rdir: Path, disk_dir: Path, chains: int) -> dict:
    async with await Client.connect(rdir) as c:
        shape = c.pool("b").shape
        kv = torch.randint(-30000, 30000, (BLOCKS, *shape), dtype=torch.int16).view(torch.float16)
        all_keys = []
        for i in range(chains):
            keys = c.block_keys("b", list(range(i * 10**5, i * 10**5 + 16 * BLOCKS)))
            await c.put("b", keys, kv)
            # Handed over, and cpu back at or below its high watermark (14 of 16) with nothing in
            # flight: the next chain then lands in cpu, and what cpu sheds goes down to disk.
            await until(lambda i=i: _settled(rdir, (i + 1) * BLOCKS))
            all_keys.append(keys)
        on_disk = [k for keys in all_keys for k in keys if where(c, k) == Tier.DISK]
        out = torch.empty((1, *shape), dtype=torch.float16)
        direct, ahead = [], []
        for k in on_disk:
            drop_caches(disk_dir)
            t0 = time.perf_counter()
            assert await c.get("b", [k], out) == 1
            direct.append(time.perf_counter() - t0)
        # Promote-ahead: the same blocks, brought into cpu by the daemon, then read from shm. The cpu
        # tier holds 16: a batch of 8 at a time, read, then left to be shed again.
        for i in range(0, len(on_disk), 8):
            batch = [k for k in on_disk[i:i + 8] if where(c, k) == Tier.DISK]
            if not batch:
                continue
            drop_caches(disk_dir)
            t0 = time.perf_counter()
            for k in batch:
                await c.prefetch("b", [k])
            try:
                await until(lambda batch=batch: all(where(c, k) == Tier.CPU for k in batch), 10)
            except TimeoutError:
                continue  # cpu had no room for all of them: not timed
            for k in batch:
                assert await c.get("b", [k], out) == 1
            ahead.append((time.perf_counter() - t0) / len(batch))
        bb = c.pool("b").block_bytes
    med = statistics.median
    return {"block_bytes": bb, "disk_blocks": len(on_disk),
            "direct_ms": med(direct) * 1e3 if direct else None,
            "direct_gbps": bb / med(direct) / 1e9 if direct else None,
            "promote_ahead_ms": med(ahead) * 1e3 if ahead else None,
            "promote_ahead_gbps": bb / med(ahead) / 1e9 if ahead else None, "promote_batches": len(ahead)}


WRITEBACK = POOL.replace("cpu_blocks = 16", "cpu_blocks = 192") + """
[daemon]
copy_threads = {threads}
stats_interval_s = 0.02
"""


async def writeback(rdir: Path, blocks: int = 192) -> float:
    """Blocks per second into the disk tier, from the last put to the tier holding them."""
    async with await Client.connect(rdir, staging_blocks=blocks) as c:
        shape = c.pool("b").shape
        kv = torch.randint(-30000, 30000, (BLOCKS, *shape), dtype=torch.int16).view(torch.float16)
        for i in range(blocks // BLOCKS):
            keys = c.block_keys("b", list(range(i * 10**5, i * 10**5 + 16 * BLOCKS)))
            assert (await c.put("b", keys, kv)).dropped == 0
        t0 = time.perf_counter()

        def landed() -> int:
            try:
                return int(read_json(rdir / STATS)["pools"]["b"]["tiers"]["disk"]["demoted_in"])
            except (OSError, ValueError, KeyError):
                return 0
        target = int(blocks * 0.85)
        await until(lambda: landed() >= target, 120)
        return target / (time.perf_counter() - t0)


def run_writeback(base: Path, threads: int) -> float:
    t = base / f"wb{threads}"
    t.mkdir()
    cfg = t / "b.toml"
    # Watermarks that send nearly every block down at once: 192 blocks put, ~180 shed in one go.
    cfg.write_text(WRITEBACK.format(disk=t / "disk", threads=threads).replace(
        "disk_admit_after = 0", "disk_admit_after = 0\nhigh_watermark = 0.1\nlow_watermark = 0.05"))
    d = DaemonProcess(cfg, t / "rt", {"KVTIER__NODE__ID": f"diskwb-{threads}-{int(time.time())}",
                                      "KVTIER__NODE__RUNTIME_DIR": str(t / "rt"),
                                      "KVTIER__DAEMON__PERSIST_ARENA": "false"})
    d.start()
    try:
        return asyncio.run(writeback(t / "rt"))
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--chains", type=int, default=24)
    ap.add_argument("--skip-writeback", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-diskread-") as tmp:
        t = Path(tmp)
        if not args.skip_writeback:
            for threads in (1, 4):
                rate = run_writeback(t, threads)
                print(json.dumps({"writeback_copy_threads": threads, "blocks_per_s": round(rate, 1),
                                  "gbps": round(rate * (2 << 20) / 1e9, 3)}))
        cfg = t / "b.toml"
        cfg.write_text(POOL.format(disk=t / "disk"))
        d = DaemonProcess(cfg, t / "rt", {"KVTIER__NODE__ID": f"diskread-{int(time.time())}",
                                          "KVTIER__NODE__RUNTIME_DIR": str(t / "rt"),
                                          "KVTIER__DAEMON__PERSIST_ARENA": "false"})
        d.start()
        try:
            print(json.dumps(asyncio.run(run(t / "rt", t / "disk", args.chains)), indent=1))
        finally:
            d.stop()


if __name__ == "__main__":
    main()
