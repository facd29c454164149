"""Where a sustained put's time goes: the client's phases, both processes' CPU, Redis commands.

    .venv/bin/python benchmarks/put_phases.py [--kib 64] [--mib 256] [--rounds 4] [--per-put 64] [--redis-calls]
                                              [--quick] [--loop uvloop|asyncio]

Starts a daemon of `kvtier bench`'s kind (kvtier/tools/bench_env.py) and puts `--mib` of blocks of
`--kib` KiB, `--rounds` times, in puts of `--per-put` blocks (64, as the bench does), each round
until every block is visible (kvtier/tools/bench_daemon.py's `warm_up` and `put_chains`, the
bench's own). Per round and per block:
- the wall time, and the ratio to a memcpy of the same bytes measured in the same run;
- the CPU of the client (this process) and of the daemon (schedstat, every thread);
- the client's phases, timed by wrapping the methods that run them: taking the granted slots,
  the copy threads' fill (awaited), encoding the put (during the fill), publishing it (awaited),
  the closing `wait_resident`;
- the Redis commands a put cost (INFO commandstats of the bench's own redis-server).

`--per-put` splits a put's cost into what each put costs and what each block does: at 64 KiB
and 64 blocks a put, about a third of both processes' CPU was per put (docs/performance.md,
the fifteenth stop).

The wrappers cost a few microseconds a put, not a block. `--redis-calls` also prints what one
Redis command costs this process in CPU: through redis-py's client, through a redis-py
`Connection` directly, and on a bare asyncio stream (docs/performance.md, the tenth stop).
The client runs on uvloop, as SyncClient and `kvtier bench` run it; `--loop asyncio` puts it on
Python's own loop. Every round's blocks are checked visible before the next round starts. `--quick` sizes the
arena for the working set alone, as `kvtier bench --quick` does (seconds; the smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import uvloop

import kvtier.bus.publisher as publisher
import kvtier.client.client as client_mod
import kvtier.shm.staging as staging
from kvtier.client import Client
from kvtier.processes import stop_processes
from kvtier.runtime import STATS
from kvtier.tools.bench import arena_blocks
from kvtier.tools.bench_basics import LLAMA, memcpy_gbps
from kvtier.tools.bench_daemon import process_cpu_s, put_chains, warm_up
from kvtier.tools.bench_env import Env, start_redis


class Phases:
    """Seconds spent in each wrapped method, summed over a round."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str, started: bool = False) -> None:
        """Time owner.name under `label`; `started`: it returns a coroutine to await (a copy
        started now), timed from the call until that coroutine has finished."""
        f = getattr(owner, name)
        spent = self.spent
        if started:
            def timed_started(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                inner = f(*a, **k)

                async def waited() -> Any:
                    try:
                        return await inner
                    finally:
                        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
                return waited()
            setattr(owner, name, timed_started)
            return

        if asyncio.iscoroutinefunction(f):
            async def timed_async(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await f(*a, **k)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
            setattr(owner, name, timed_async)
        else:
            def timed(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
            setattr(owner, name, timed)


async def rounds(env: Env, n: int, count: int, bound_gbps: float, blocks_per_put: int) -> None:
    phases = Phases()
    phases.wrap(staging.StagingWriter, "take_slots", "take slots")
    phases.wrap(client_mod.Client, "_start_copy", "fill (copy threads)", started=True)
    phases.wrap(publisher.Publisher, "prepare", "encode (during the fill)")
    phases.wrap(publisher.Publisher, "publish_prepared", "publish")
    phases.wrap(client_mod.Client, "wait_resident", "wait_resident")
    stats = redis.Redis.from_url(env.url)
    pid = env.daemon.proc.pid

    def commands() -> dict[str, int]:
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.info("commandstats").items()}

    env.wait_populated()
    async with await Client.connect(env.rdir, staging_blocks=256) as client:
        import torch

        p = client.pool("b")
        bb = p.block_bytes
        data = np.random.default_rng(1).integers(0, 255, (n, bb), dtype=np.uint8)
        kv = torch.from_numpy(data).view(p.dtype).reshape(n, *p.shape)
        await warm_up(client, kv, b"phases")
        tokens = list(range(n * p.layout.block_tokens))
        for r in range(count):
            keys = client.block_keys("b", tokens, salt=b"phases-%d" % r)
            phases.spent.clear()
            before = commands()
            c0, d0, t0 = time.process_time(), process_cpu_s(pid), time.perf_counter()
            await put_chains(client, keys, kv, blocks_per_put)  # as `kvtier bench` puts a round
            wall = time.perf_counter() - t0
            client_s, daemon_s = time.process_time() - c0, process_cpu_s(pid) - d0
            after = commands()
            puts = -(-n // blocks_per_put)
            per_put = {k: (v - before.get(k, 0)) / puts for k, v in after.items()
                       if k != "info" and v > before.get(k, 0)}
            us = lambda s: 1e6 * s / n  # noqa: E731
            print(f"round {r}: {n / wall:,.0f} blocks/s, {n * bb / wall / 1e9 / bound_gbps:.2f}x memcpy; a block: "
                  f"wall {us(wall):.1f} us, CPU client {us(client_s):.1f} us, daemon {us(daemon_s):.1f} us")
            print("  phases (us a block): " + ", ".join(f"{k} {us(v):.1f}" for k, v in phases.spent.items()))
            print(f"  Redis commands a put of {blocks_per_put}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_put.items())))
    time.sleep(1.5)  # the daemon writes stats.json each second (the bench's stats_interval_s)
    c = json.loads((env.rdir / STATS).read_text())["pools"]["b"]
    print(f"daemon, all rounds and the warm-up: {c['puts']:,} blocks put, {c['granted_puts']:,} of them into granted "
          f"slots (one pass), {c['puts_dropped']:,} dropped")


def redis_calls(workdir: Path, calls: int = 3000) -> None:
    """CPU of one Redis command in this process, three ways, on uvloop."""
    from redis.asyncio import Redis
    from redis.asyncio.connection import Connection

    proc, url = start_redis(workdir)
    host, port = url.rsplit("//", 1)[1].split(":")

    async def measure(label: str, call: Callable[[], Any]) -> None:
        c0 = time.process_time()
        for _ in range(calls):
            await call()
        print(f"  {label}: {1e6 * (time.process_time() - c0) / calls:.1f} us of CPU a call")

    async def main() -> None:
        r = Redis.from_url(url)
        await measure("redis-py client, PING", r.ping)
        conn = Connection(host=host, port=int(port))
        await conn.connect()

        async def conn_ping() -> None:
            await conn.send_command("PING")
            await conn.read_response()
        await measure("redis-py Connection, PING", conn_ping)
        reader, writer = await asyncio.open_connection(host, int(port))

        async def raw_ping() -> None:
            writer.write(b"*1\r\n$4\r\nPING\r\n")
            await reader.readline()
        await measure("bare asyncio stream, PING", raw_ping)
        writer.close()
        await conn.disconnect()
        await r.aclose()

    try:
        print(f"one Redis command, {calls} times each:")
        uvloop.run(main())
    finally:
        stop_processes([proc], 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kib", type=int, default=64, help="block size: Llama-3-8B's heads, kib/64 layers")
    ap.add_argument("--mib", type=int, default=256, help="bytes put a round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-put", type=int, default=64, help="blocks a put (the bench's: 64)")
    ap.add_argument("--redis-calls", action="store_true", help="also the CPU of one Redis command, three ways")
    ap.add_argument("--quick", action="store_true", help="an arena for the working set alone (a smoke run)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the client's event loop: uvloop (SyncClient's, and the bench's) or Python's own")
    a = ap.parse_args()
    if a.kib < 64 or a.kib % 64 or a.kib > 2048:
        ap.error("--kib must be a multiple of 64 up to 2048 (a layer of Llama-3-8B's 16-token block is 64 KiB)")
    if not 1 <= a.per_put <= 4096:
        ap.error("--per-put must be 1 to 4096 blocks (a client holds up to 4,096 granted slots of 64 KiB here)")
    bb = a.kib << 10
    n = max(64, (a.mib << 20) // bb)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        bound = memcpy_gbps(n * bb, 3)
        print(f"{a.rounds} rounds of {n:,} blocks of {a.kib} KiB, {a.per_put} a put; "
              f"memcpy {bound:.2f} GB/s (the bound)")
        (workdir / "env").mkdir()
        env = Env(dict(LLAMA, layers=a.kib // 64), arena_blocks(n * (a.rounds + 1), a.quick, bb), workdir / "env")
        try:
            run = uvloop.run if a.loop == "uvloop" else asyncio.run
            run(rounds(env, n, a.rounds, bound, a.per_put))
        finally:
            env.close()
        if a.redis_calls:
            (workdir / "calls").mkdir()
            redis_calls(workdir / "calls")


if __name__ == "__main__":
    main()
