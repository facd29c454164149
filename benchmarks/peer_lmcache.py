"""kvtier's Redis tier against LMCache's RESP connector on the same redis-server and bytes.

The method of issue 14's side-by-side run: one redis-server (TCP, loopback), 1 GiB per pass
(`--gib`), the median of `--repeat` passes (9 by default). LMCache 0.5.6's RESPConnector is its
native client (`lmcache.lmcache_redis.LMCacheRedisClient`, C++, 8 worker threads) moving 32 MiB
chunks with submit_batch_set / submit_batch_get into memoryviews; it runs in .venv-lmcache
(scripts/setup-lmcache-venv.sh). kvtier is RedisBlocks.put_many and the verified fetch (landing
in a buffer already paged in) with 2 MiB and 32 MiB blocks, in .venv, on uvloop (the daemon's
loop, where the tier's writes run: Python 3.11's own loop joins a pipeline's buffers into one
bytes, a full copy, and put 32 MiB values at 0.63 GB/s against uvloop's 1.51 here). The two take
turns, pass by pass, so the machine's noise falls on both alike.

    scripts/setup-lmcache-venv.sh
    .venv/bin/python benchmarks/peer_lmcache.py [--gib 1] [--repeat 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LMCACHE_PASS = r"""
import json, os, selectors, sys, time
import numpy as np
from lmcache.lmcache_redis import LMCacheRedisClient
port, total, chunk, workers = (int(a) for a in sys.argv[1:5])
n = total // chunk
bufs = [np.random.default_rng(i).integers(0, 255, chunk, dtype=np.uint8) for i in range(n)]
dst = [np.ones(chunk, dtype=np.uint8) for _ in range(n)]
keys = [f"lmc:{i}" for i in range(n)]
c = LMCacheRedisClient("127.0.0.1", port, workers, "", "")
sel = selectors.DefaultSelector(); sel.register(c.event_fd(), selectors.EVENT_READ)
def wait(fid):
    while True:
        for f, ok, err, _ in c.drain_completions():
            if f == fid:
                if not ok: raise RuntimeError(err)
                return
        sel.select(60)
t0 = time.perf_counter(); wait(c.submit_batch_set(keys, [b.data for b in bufs])); put = time.perf_counter() - t0
t0 = time.perf_counter(); wait(c.submit_batch_get(keys, [b.data for b in dst])); get = time.perf_counter() - t0
ok = all(np.array_equal(a, b) for a, b in zip(bufs, dst))
c.close()
print(json.dumps({"put_gbps": total / put / 1e9, "get_gbps": total / get / 1e9, "correct": ok}))
"""


async def kvtier_pass(url: str, total: int, block_bytes: int) -> dict:
    import numpy as np
    import structlog

    from kvtier.bus.connect import make_blocks_redis
    from kvtier.layout import BlockLayout
    from kvtier.shm.slots import checksum
    from kvtier.store.redis_blocks import RedisBlocks

    # A layout whose block is block_bytes (uint8 "model" of one layer): what the tier moves.
    lay = BlockLayout("peer", 1, 1, block_bytes // 64, 16, "float16")  # 1 x 2 x 1 x 16 x dim x 2 bytes
    assert lay.block_bytes == block_bytes
    n = total // block_bytes
    client = make_blocks_redis(url, socket_timeout=60, connect_timeout=5, retries=1)
    try:
        blocks = RedisBlocks(client, "peer", lay.fingerprint, block_bytes, 0, structlog.get_logger())
        data = np.random.default_rng(5).integers(0, 255, (n, block_bytes), dtype=np.uint8)
        keys = [i.to_bytes(32, "big") for i in range(n)]
        values = []
        for k, row in zip(keys, data):
            v, view = blocks.new_value()
            view[:] = row
            values.append(blocks.seal(v, k, checksum(row)))
        dst = np.ones_like(data)
        t0 = time.perf_counter()
        errors = await blocks.put_many(list(zip(keys, values)))
        put = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = await blocks.fetch(keys, into=lambda i: dst[i])
        get = time.perf_counter() - t0
        ok = not any(errors) and all(isinstance(g, tuple) for g in got) and bool(np.array_equal(dst, data))
        await blocks.aclose()
        return {"put_gbps": n * block_bytes / put / 1e9, "get_gbps": n * block_bytes / get / 1e9, "correct": ok}
    finally:
        await client.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    lmc = ROOT / ".venv-lmcache" / "bin" / "python"
    if not lmc.exists():
        print("peer_lmcache: run scripts/setup-lmcache-venv.sh first", file=sys.stderr)
        return 2
    from kvtier.tools.redis_cluster import free_port

    total = int(args.gib * (1 << 30)) // (32 << 20) * (32 << 20)
    port = free_port()
    work = tempfile.mkdtemp(prefix="kvtier-peer-")
    redis = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", work, "--maxmemory", "0"], stdout=subprocess.DEVNULL)
    peer = "lmcache RESPConnector (32 MiB chunks, 8 threads)"
    runs: dict[str, list[dict]] = {peer: [], "kvtier, 2 MiB blocks": [], "kvtier, 32 MiB blocks": []}
    try:
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}"
        for r in range(args.repeat):
            out = subprocess.run([str(lmc), "-c", LMCACHE_PASS, str(port), str(total), str(32 << 20), "8"],
                                 capture_output=True, text=True, timeout=600)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            runs[peer].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for mib in (2, 32):
                runs[f"kvtier, {mib} MiB blocks"].append(uvloop.run(kvtier_pass(url, total, mib << 20)))
            print(f"peer_lmcache: pass {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    finally:
        redis.kill()
    table = {name: {"put_gbps": statistics.median(x["put_gbps"] for x in rs),
                    "get_gbps": statistics.median(x["get_gbps"] for x in rs),
                    "correct": all(x["correct"] for x in rs)} for name, rs in runs.items()}
    print(f"| path ({args.gib:g} GiB per pass, median of {args.repeat}) | put GB/s | get GB/s | bytes right |")
    print("|---|---|---|---|")
    for name, t in table.items():
        print(f"| {name} | {t['put_gbps']:.2f} | {t['get_gbps']:.2f} | {'yes' if t['correct'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "table": table}, indent=1))
    return 0 if all(t["correct"] for t in table.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
