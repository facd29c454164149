"""`kvtier bench`: every hot path measured against a bound for the same path, in the same run.

Each row is a ratio to its bound, both measured here and now, so the figures hold on a noisy
shared machine. The daemon rows run a real `kvtier daemon` on a private redis-server (unix
socket, no persistence) with a Llama-3-8B block layout (2 MiB blocks); the working set is
`--gib` GiB (1 by default). `--quick` shrinks everything and only checks that each path returns
the right bytes (CI runs it). The raw Redis bounds are the best of a grid of pipeline depths and
connection counts (kvtier/tools/bench_redis.py); Redis is reached over TCP on loopback.

| row | figure | bound | target |
|---|---|---|---|
| get | GB/s, cpu arena -> caller tensor (client.get) | numpy memcpy over the same bytes | >= 0.8x |
| put | GB/s, client.put until visible in the cpu tier | numpy memcpy | >= 0.5x |
| get / put, 64 and 256 KiB blocks | blocks/s and GB/s | memcpy of the same bytes | get >= 0.5x, put >= 0.3x |
| redis put / get | GB/s, the redis tier's write, and its verified read | best raw SETs / GETs (grid) | >= 0.8x |
| cross-node | GB/s, node B reads node A's cold 32-block chain through from Redis | raw GET + copy | >= 0.9x |
| bus | events/s published until the daemon applied them | raw pipelined XADD + XREADGROUP/XACK | >= 0.5x |
| lookup | ms, 32,768-token prompt: hashing + lookup | a bare SHA-256 chain over the same tokens | <= 2x |
| directory | lookup time with 1M blocks indexed / with 1k | | <= 1.5x |
| idle | daemon CPU % and RSS beyond the arenas, at rest | | < 2 %, < 200 MB |
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import uvloop

from kvtier.config import DaemonConfig
from kvtier.tiers.grants import CLIENT_SHARE
from kvtier.tools.bench_arena import arena_rows, arena_toml, header_scan_row
from kvtier.tools.bench_basics import LLAMA, memcpy_gbps, memcpy_gbps_by_block, say, sizes
from kvtier.tools.bench_cross_node import CHAIN, cross_node_row
from kvtier.tools.bench_daemon import daemon_rows, idle_row, small_block_rows
from kvtier.tools.bench_directory import directory_row
from kvtier.tools.bench_env import Env
from kvtier.tools.bench_redis import redis_row
from kvtier.tools.bench_report import finish, idle_note, render, table
from kvtier.tools.bench_where import where_row

# Imported from here by the CLI, benchmarks/gpu_check.py (LLAMA) and tests/unit/test_operator_text.py.
__all__ = ["LLAMA", "idle_note", "run_arena_bench", "run_bench"]
SMALL_BLOCKS_KIB = (64, 256)  # engines with small models or 16-token blocks hand over blocks this size


def run_arena(args, url: str, workdir: Path, out: dict) -> None:
    """The arena rows (kvtier/tools/bench_arena.py): cold and warm start, per GiB; huge pages when
    a mount is named; the header scan at a million slots (64k with --quick)."""
    gib = 0.25 if args.quick else args.arena_gib
    settle = 0.0 if args.quick else None  # --quick checks the shape, not the speed
    kw = {} if settle is None else {"settle_s": settle}
    arena_rows(url, workdir, gib, None, out, **kw)
    if args.arena_huge_dir:
        arena_rows(url, workdir, gib, args.arena_huge_dir, out, **kw)
    slots = 1 << 16 if args.quick else 1 << 20
    say(f"warm restart: scanning {slots:,} slot headers")
    header_scan_row(slots, out)


def arena_blocks(n: int, quick: bool, block_bytes: int) -> int:
    """Arena slots for a working set of n blocks (every put round's): below the high watermark, so
    nothing is shed; and, but with --quick, room for a client's default grants sixteen times over
    (kvtier/tiers/grants.py: a client holds a sixteenth of the arena at most), so that a toy
    arena's size does not cut them as a real one would not: 2,048 slots of 2 MiB, 65,536 of 64 KiB
    (4 GiB either way)."""
    d = DaemonConfig()
    grants = min(d.grant_blocks, d.grant_bytes // block_bytes)
    return int(n / 0.85) + 16 if quick else max(int(n / 0.85) + 16, CLIENT_SHARE * grants)


def small_rows(kib: int, quick: bool, repeat: int, workdir: Path, out: dict) -> None:
    """get and put of blocks of `kib` KiB (Llama-3-8B's heads with fewer layers), 256 MiB of them
    (64 blocks with --quick), on a daemon of their own, against memcpy of the same bytes."""
    layout = dict(LLAMA, layers=kib * 32 // 2048)
    bb = kib << 10
    n = 64 if quick else (256 << 20) // bb
    say(f"get and put of {n} blocks of {kib} KiB")
    (workdir / f"small{kib}").mkdir()
    env = Env(layout, arena_blocks(n * repeat, quick, bb), workdir / f"small{kib}")
    try:
        row = uvloop.run(small_block_rows(env, n, repeat))  # the SyncClient's loop: see run_bench
    finally:
        env.close()
    row["memcpy_gbps"], row["memcpy_block_gbps"] = memcpy_gbps_by_block(n * bb, repeat, bb)
    out.setdefault("small_blocks", {})[str(kib)] = row


def run_arena_bench(args) -> int:
    """`kvtier bench --arena`: the arena rows alone (with get/put on each backing when not --quick)."""
    if shutil.which("redis-server") is None:
        print("kvtier bench: redis-server is not on PATH", file=sys.stderr)
        return 1
    layout, bb, n, repeat = sizes(args, 64)
    out: dict = {"quick": args.quick, "blocks": n, "block_bytes": bb}
    out["memcpy_gbps"] = memcpy_gbps(n * bb, repeat)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        env = Env(layout, arena_blocks(n * repeat, args.quick, bb), Path(tmp))
        try:
            say(f"get and put over {n} blocks, arena on /dev/shm's pages")
            uvloop.run(daemon_rows(env, n, repeat, out))
            run_arena(args, env.url, Path(tmp), out)
        finally:
            env.close()
        if args.arena_huge_dir:
            (Path(tmp) / "huge").mkdir()
            env = Env(layout, arena_blocks(n * repeat, args.quick, bb), Path(tmp) / "huge",
                      policy_toml=arena_toml(args.arena_huge_dir))
            try:
                say(f"get and put over {n} blocks, arena on 2 MiB pages ({args.arena_huge_dir})")
                huge: dict = {}
                uvloop.run(daemon_rows(env, n, repeat, huge))
                out["get_huge"], out["put_huge"] = huge["get"], huge["put"]
            finally:
                env.close()
    rows = table(out)
    if "get_huge" in out:
        m = out["memcpy_gbps"]
        for op in ("get", "put"):
            g = out[f"{op}_huge"]["gbps"]
            rows.append({"path": f"{op} with the arena on 2 MiB pages", "figure": f"{g:.2f} GB/s",
                         "bound": f"memcpy {m:.2f} GB/s; 4 KiB pages {out[op]['gbps']:.2f} GB/s", "ratio": g / m,
                         "target": "(measured)", "meets": None})
    out["rows"] = rows
    correct = all(out[k].get("correct", True) for k in ("get", "put", "get_huge", "header_scan") if k in out)
    return finish(out, render(rows), args.json, correct)


def run_bench(args) -> int:
    quick = args.quick
    layout, bb, n, repeat = sizes(args, 64)
    if shutil.which("redis-server") is None:
        print("kvtier bench: redis-server is not on PATH", file=sys.stderr)
        return 1
    out: dict = {"quick": quick, "blocks": n, "block_bytes": bb, "working_set_bytes": n * bb}
    say(f"memcpy bound over {n * bb / (1 << 20):.0f} MiB")
    out["memcpy_gbps"], out["memcpy_block_gbps"] = memcpy_gbps_by_block(n * bb, repeat, bb)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        env = Env(layout, arena_blocks(n * repeat, quick, bb), Path(tmp))
        try:
            say(f"daemon up; put, get, lookup and bus over {n} blocks of {bb / (1 << 20):.2f} MiB")
            # The client on uvloop: the loop SyncClient, which every engine integration uses, runs
            # it on. On Python's own loop a put of 64 KiB blocks ran about 10 % slower here, its
            # Redis round trip the most (docs/performance.md, the fourteenth stop).
            uvloop.run(daemon_rows(env, n, repeat, out))
            for kib in SMALL_BLOCKS_KIB:
                small_rows(kib, quick, repeat, Path(tmp), out)
            say("redis tier against raw redis-py pipelines")
            # On uvloop, the daemon's loop, where the tier's pipelines run. Python 3.11's own loop
            # joins a pipeline's buffers into one bytes before the socket: a full extra copy.
            uvloop.run(redis_row(env.url, layout, n, repeat, out))
            say(f"cross-node: node B reads node A's {CHAIN}-block chains through from Redis")
            (Path(tmp) / "x").mkdir()
            out["cross_node"] = cross_node_row(env.url, layout, repeat, Path(tmp) / "x", 8 if quick else CHAIN)
            if not quick:
                say("daemon at idle (5 s)")
                idle_row(env, 5.0, out)
            run_arena(args, env.url, Path(tmp), out)
        finally:
            env.close()
    say("directory with 1M blocks vs 1k" if not quick else "directory (1k vs 1M skipped in --quick)")
    if not quick:
        directory_row(repeat, out)
    out["where"] = where_row(quick, repeat)
    out["rows"] = table(out)
    return finish(out, render(out["rows"]), args.json,
                  all(out[k].get("correct", True)
                      for k in ("get", "put", "redis", "cross_node", "where", "header_scan") if k in out)
                  and all(r[op]["correct"] for r in out.get("small_blocks", {}).values() for op in ("get", "put")))
