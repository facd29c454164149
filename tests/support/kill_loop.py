"""Client processes killed again and again in the middle of their work, for
tests/integration/test_client_kills.py.

    python -m tests.support.kill_loop RUNTIME_DIR OUT KILLS SEED

Imports kvtier and torch once, then KILLS times: forks a client that connects and puts, gets and
pins chains of blocks (each chain's bytes a function of its number, so any reader can tell a
wrong block), and SIGKILLs it as it starts its n-th operation, n drawn from 0 (while it
connects) to OPS (the child tells each start down a pipe). Every read a client verifies is
one line in OUT ("ok <n>" or "WRONG <chain> <row>"), written with one O_APPEND write, so a kill
loses at most the line being written. Prints one JSON line when done.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import signal
import sys
import time

import torch

from kvtier.client import Client
from tests.support.blocks import SHAPE, make_kv

CHAINS = 12  # chains the clients share: later clients read what earlier ones put
BLOCKS = 6  # blocks per chain
OPS = 40  # a client is killed as it starts one of its first OPS operations
STARTED_S = 20.0  # the most a client may take to reach that operation


def chain_keys(client: Client, chain: int) -> list[bytes]:
    return client.block_keys("t", list(range(16 * BLOCKS)), salt=b"kill-%d" % chain)


async def work(rdir: str, seed: int, out: int, started: int) -> None:
    rng = random.Random(seed)
    kv = {c: make_kv(BLOCKS, seed=1000 + c) for c in range(CHAINS)}
    got = torch.empty((BLOCKS, *SHAPE), dtype=torch.float16)
    async with await Client.connect(rdir) as client:
        while True:
            os.write(started, b".")  # the parent may kill us from here on, in this operation
            chain = rng.randrange(CHAINS)
            keys = chain_keys(client, chain)
            op = rng.random()
            if op < 0.4:
                await client.put("t", keys, kv[chain], wait_s=0.5)
                continue
            if op < 0.55:
                await client.pin("t", keys, 3, tenant="killed")  # short: the test sees them expire
            n = await client.get("t", keys, got, remote=rng.random() < 0.3)
            want = kv[chain].view(torch.int16)
            bad = next((i for i in range(n) if not torch.equal(got[i].view(torch.int16), want[i])), None)
            os.write(out, b"ok %d\n" % n if bad is None else b"WRONG %d %d\n" % (chain, bad))


def child(rdir: str, seed: int, out: int, started: int) -> None:
    try:
        asyncio.run(work(rdir, seed, out, started))
    finally:
        os._exit(0)


def wait_started(started: int, n: int) -> None:
    """Until the child has started its n-th operation (0: at once, while it connects)."""
    deadline = time.monotonic() + STARTED_S
    while n > 0:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([started], [], [], left)[0]:
            raise SystemExit(f"a client did not reach its operation {n} within {STARTED_S} s")
        got = os.read(started, n)
        if not got:
            raise SystemExit("a client exited before it was killed")
        n -= len(got)


def main(rdir: str, out_path: str, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for i in range(kills):
        started, tell = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(started)
            child(rdir, seed * 1000 + i, out, tell)
        os.close(tell)
        try:
            wait_started(started, rng.randrange(OPS + 1))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(started)
    print(json.dumps({"kills": kills}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
