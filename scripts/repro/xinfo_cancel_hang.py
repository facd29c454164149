"""Cancelling a redis-py asyncio command can be swallowed on Python 3.11: the task runs on.

Spawns a private redis-server on a unix socket, then over and over: start a task that loops
a pipeline of XINFO GROUPS (as kvtier's stream sampler does), cancel it at a random moment,
and see whether it ends. A cancelled task that is still running 0.5 s later had its
CancelledError swallowed: it goes on issuing commands until cancelled again.

Cause: redis.asyncio.Connection.send_packed_command wraps the write in asyncio.wait_for().
On Python < 3.12, wait_for returns the inner result when the outer task is cancelled after
the inner awaitable has finished (CPython gh-86296, fixed in 3.12 by rewriting wait_for on
asyncio.timeout). A small write to a local socket finishes in one step, so the window is one
loop iteration per command. `--fixed-wait-for` swaps in a timeout-based wait_for to show it.

    python scripts/repro/xinfo_cancel_hang.py [--n 300] [--uvloop] [--fixed-wait-for]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio

STREAMS = [f"s{i}" for i in range(6)]


def spawn_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = directory / "redis.sock"
    exe = shutil.which("redis-server") or sys.exit("redis-server not on PATH")
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            sys.exit("redis-server did not start")
        time.sleep(0.01)  # a script, not a test: polling the socket file is fine
    return proc, f"unix://{sock}"


async def sampler(r: redis.asyncio.Redis) -> None:
    while True:
        try:
            async with r.pipeline(transaction=False) as pipe:
                for s in STREAMS:
                    pipe.xinfo_groups(s)
                await pipe.execute(raise_on_error=False)
        except redis.RedisError:
            pass
        await asyncio.sleep(0)


async def main(url: str, n: int) -> int:
    r = redis.asyncio.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    for s in STREAMS:
        await r.xgroup_create(s, "g", id="0", mkstream=True)
    swallowed, slow = 0, 0
    for _ in range(n):
        t = asyncio.create_task(sampler(r))
        await asyncio.sleep(random.random() * 0.003)
        t0 = time.perf_counter()
        t.cancel()
        done, _ = await asyncio.wait([t], timeout=0.5)
        if not done:
            swallowed += 1
            while not t.done():  # cancel again until it takes (each try may be swallowed too)
                t.cancel()
                await asyncio.wait([t], timeout=0.1)
        elif time.perf_counter() - t0 > 0.1:
            slow += 1
    await r.aclose()
    print(f"python {sys.version.split()[0]}, redis-py {redis.__version__}, "
          f"loop {type(asyncio.get_running_loop()).__module__}: {n} cancels, "
          f"{swallowed} swallowed (task still running 0.5 s later), {slow} slower than 100 ms")
    return 1 if swallowed else 0


def fixed_wait_for() -> None:
    async def wait_for(aw, timeout):  # what Python 3.12's wait_for does
        async with asyncio.timeout(timeout):
            return await aw

    asyncio.wait_for = wait_for  # redis.asyncio.connection looks it up on the module at call time


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--fixed-wait-for", action="store_true")
    args = ap.parse_args()
    if args.fixed_wait_for:
        fixed_wait_for()
    factory = asyncio.new_event_loop
    if args.uvloop:
        import uvloop

        factory = uvloop.new_event_loop
    with tempfile.TemporaryDirectory(prefix="xinfo-repro-") as d:
        proc, url = spawn_redis(Path(d))
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                rc = runner.run(main(url, args.n))
        finally:
            proc.kill()
            proc.wait()
    sys.exit(rc)
