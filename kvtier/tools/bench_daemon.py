"""`kvtier bench` rows measured against a running daemon (kvtier/tools/bench_env.py): put, get,
lookup and the bus, each against its bound in the same run (the targets: kvtier/tools/bench.py,
the table: kvtier/tools/bench_report.py); and the daemon's CPU and memory at rest."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid

import numpy as np

from kvtier.tools.bench_basics import GB, best_time
from kvtier.tools.bench_env import Env


def process_cpu_s(pid: int) -> float:
    """CPU time of `pid`'s threads so far, in seconds, from schedstat (nanoseconds, where
    /proc/PID/stat counts 10 ms ticks: a 2 MiB put round takes a few of them)."""
    total, read = 0, 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            read += 1
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9 if read else stat_cpu_s(pid)  # a kernel without schedstat: its ticks


def stat_cpu_s(pid: int) -> float:
    """CPU time of `pid` so far from /proc/PID/stat: user and system, in 10 ms ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def warm_up(client, kv, salt: bytes) -> None:
    """One block put first, untimed: the client's staging segment is created and paged in then.
    And its view of the arena mapped (kvtier/shm/prefault.py, a background thread from connect):
    an engine connects once and puts for hours; a put timed beside the mapping measures both."""
    p = client.pool("b")
    warm = client.block_keys("b", list(range(p.layout.block_tokens)), salt=salt + b"-warm")
    await client.put("b", warm, kv[:1])
    if not await client.wait_resident("b", warm, timeout=60):
        raise RuntimeError("put: the warm-up block did not become visible")
    deadline = time.monotonic() + 60
    while (f := p.prefault) is not None and f.done < f.size and f.error is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def put_chains(client, keys: list[bytes], kv, per_put: int = 64) -> None:
    """One put round: `keys` (a chain) with kv's blocks, in puts of `per_put`, each dropped rest
    handed again, until every block is visible in the cpu tier."""
    for i in range(0, len(keys), per_put):
        end = i + per_put
        res = await client.put("b", keys[i:end], kv[i:end], parent=keys[i - 1] if i else None)
        j = i + res.staged  # handed over so far
        while res.dropped:  # staging full: the daemon has not caught up; hand the rest again
            await asyncio.sleep(0.001)
            res = await client.put("b", keys[j:end], kv[j:end], parent=keys[j - 1] if j else None)
            j += res.staged
    if not await client.wait_resident("b", keys, timeout=120):
        raise RuntimeError("put: blocks did not become visible")


async def put_get(client, n: int, repeat: int, salt: bytes = b"bench", daemon_pid: int | None = None
                  ) -> tuple[dict, dict]:
    """put (sustained, in chains of 64 blocks, until every block is visible in the cpu tier) and
    get (all blocks into one caller tensor) of n blocks of the client's pool "b", each best of
    `repeat`, as the memcpy bound is: a put round is a new chain of the same bytes (its figure
    per round is kept too). The pool is sized for every round's blocks, so that none is shed:
    every block read must be exactly the block put. The best put round's CPU per block, of this
    process (the client, copy threads included) and of the daemon (`daemon_pid`), says whether a
    put is bound by the copy or by per-block work."""
    import torch

    p = client.pool("b")
    bb = p.block_bytes
    data = np.random.default_rng(1).integers(0, 255, (n, bb), dtype=np.uint8)
    kv = torch.from_numpy(data).view(p.dtype).reshape(n, *p.shape)
    tokens = list(range(n * p.layout.block_tokens))
    await warm_up(client, kv, salt)
    rounds: list[float] = []
    cpu: list[tuple[float, float | None]] = []  # each round's (client, daemon) CPU seconds
    chains = []
    for r in range(max(1, repeat)):
        keys = client.block_keys("b", tokens, salt=salt if r == 0 else salt + b"-%d" % r)
        chains.append(keys)
        c0, d0 = time.process_time(), 0.0 if daemon_pid is None else process_cpu_s(daemon_pid)
        t0 = time.perf_counter()
        await put_chains(client, keys, kv)
        rounds.append(time.perf_counter() - t0)
        cpu.append((time.process_time() - c0, None if daemon_pid is None else process_cpu_s(daemon_pid) - d0))
    put_s = min(rounds)
    client_s, daemon_s = cpu[rounds.index(put_s)]
    dst = torch.empty_like(kv)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        got_n = await client.get("b", chains[0], dst)
        best = min(best, time.perf_counter() - t0)
    ok = bool(np.array_equal(dst.view(torch.uint8).reshape(n, bb).numpy()[:got_n], data[:got_n]))
    kept = all(client.lookup("b", keys).length == n for keys in chains)  # no round shed another's blocks
    put = {"gbps": n * bb / put_s / GB, "blocks_per_s": n / put_s, "correct": ok and kept,
           "rounds_blocks_per_s": [round(n / s) for s in rounds], "client_cpu_us_per_block": 1e6 * client_s / n}
    if daemon_s is not None:
        put["daemon_cpu_us_per_block"] = 1e6 * daemon_s / n
    get = {"gbps": got_n * bb / best / GB, "blocks_per_s": got_n / best, "correct": ok, "blocks_read": got_n,
           "all_resident": got_n == n}
    return put, get


async def daemon_rows(env: Env, n: int, repeat: int, out: dict) -> None:
    from kvtier.client import Client

    env.wait_populated()
    async with await Client.connect(env.rdir, staging_blocks=min(n, 256)) as client:
        out["put"], out["get"] = await put_get(client, n, repeat, daemon_pid=env.daemon.proc.pid)
        out["put"]["granted_blocks"] = granted(env)
        rng = np.random.default_rng(1)
        keys = client.block_keys("b", list(range(client.pool("b").layout.block_tokens)), salt=b"bench")
        # lookup: a 32,768-token prompt (2,048 blocks of 16), hashing included
        tokens = rng.integers(0, 128_000, 32_768).tolist()
        t_lookup = best_time(lambda: client.lookup("b", client.block_keys("b", tokens)), repeat * 3)
        raw = np.asarray(tokens, dtype="<u4").tobytes()

        def bare() -> None:
            prev = b"\0" * 32
            for i in range(0, len(raw), 64):
                prev = hashlib.sha256(prev + raw[i:i + 64]).digest()

        out["lookup"] = {"ms": t_lookup * 1000, "bound_ms": best_time(bare, repeat * 3) * 1000}
        # bus: access events published until the daemon has applied (counted) them
        from kvtier.bus.publisher import Publisher
        from kvtier.core.events import Access

        events = 5000 if n > 64 else 200
        r = client._redis
        pub = Publisher(r, "bench/client", time.time_ns(), 1_000_000)
        stream = f"kvtier:{{{env.node}}}:client"

        async def applied() -> bool:  # the coordinator acks an entry only after its effects
            g = next(g for g in await r.xinfo_groups(stream) if g["name"] in (b"kvtier", "kvtier"))
            return g["lag"] == 0 and g["pending"] == 0

        t0 = time.perf_counter()
        for _ in range(0, events, 100):
            await pub.publish_many([(stream, Access("b", (keys[0],), 0))] * 100)
        while not await applied():
            await asyncio.sleep(0.001)
        out["bus"] = {"events_per_s": events / (time.perf_counter() - t0)}
        t0 = time.perf_counter()
        raw_stream = f"bench-raw-{uuid.uuid4().hex[:6]}"
        await r.xgroup_create(raw_stream, "g", id="0", mkstream=True)
        payload = {"e": b"x" * 120}
        for _ in range(0, events, 100):
            async with r.pipeline(transaction=False) as pipe:
                for _ in range(100):
                    pipe.xadd(raw_stream, payload)
                await pipe.execute()
        seen = 0
        while seen < events:
            reply = await r.xreadgroup("g", "c", {raw_stream: ">"}, count=256)
            for _s, entries in reply:
                await r.xack(raw_stream, "g", *[e[0] for e in entries])
                seen += len(entries)
        out["bus"]["bound_per_s"] = events / (time.perf_counter() - t0)
        await r.delete(raw_stream)


def granted(env: Env) -> int | None:
    """Blocks the bench's puts wrote into granted slots (kvtier/tiers/grants.py); the rest went
    through staging. Read once the daemon has written its stats again (every stats_interval_s)."""
    time.sleep(1.5 * float(env.stats().get("stats_interval_s") or 1.0))
    got = ((env.stats().get("pools") or {}).get("b") or {}).get("granted_puts")
    return got if isinstance(got, int) else None


def idle_row(env: Env, seconds: float, out: dict) -> None:
    pid = env.daemon.proc.pid
    c0, t0 = stat_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    pct = 100 * (stat_cpu_s(pid) - c0) / (time.monotonic() - t0)
    status = dict(ln.split(":", 1) for ln in open(f"/proc/{pid}/status") if ":" in ln)
    kb = lambda k: int(status.get(k, "0 kB").split()[0])  # noqa: E731
    out["idle"] = {"cpu_pct": pct, "rss_beyond_arenas_mb": (kb("RssAnon") + kb("RssFile")) / 1024}


async def small_block_rows(env: Env, n: int, repeat: int) -> dict:
    """put and get of n small blocks (the pool's layout sets their size): blocks per second, where
    per-block work shows rather than bandwidth."""
    from kvtier.client import Client

    env.wait_populated()
    async with await Client.connect(env.rdir, staging_blocks=256) as client:
        put, get = await put_get(client, n, repeat, daemon_pid=env.daemon.proc.pid)
        put["granted_blocks"] = granted(env)
    return {"put": put, "get": get, "block_bytes": client.pool("b").block_bytes}
