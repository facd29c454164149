"""A client process caught in the middle of writing granted slots, for tests/integration/test_grants.py.

    python -m tests.support.grant_writer RUNTIME_DIR

It puts until the daemon has granted it cpu slots, then takes two: it writes the first whole
(READY, never published) and the second half way (its gen left odd), prints one JSON line with
the slots and its staging segment, and waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kvtier.client import Client
from kvtier.client.pools import host_rows
from tests.support.blocks import make_kv


async def main(rdir: str) -> None:
    client = await Client.connect(rdir)
    p = client.pool("t")
    deadline = time.monotonic() + 30
    i = 0
    while True:
        keys = client.block_keys("t", list(range(i * 10**6, i * 10**6 + 16 * 4)))
        await client.put("t", keys, make_kv(4, seed=i), wait_s=5)
        await client.wait_resident("t", keys, timeout=10)
        i += 1
        w = p.stager()
        mine = client.block_keys("t", list(range(7 * 10**8, 7 * 10**8 + 32)))
        taken = w.take_slots(mine, None)
        if len(taken) == 2 and all(b.granted for b in taken):
            break
        w.unstage(taken)
        if time.monotonic() > deadline:
            raise SystemExit("no grants came")
        await asyncio.sleep(0.05)
    whole, half = taken
    w.fill_slot(whole, host_rows(make_kv(1, seed=99), 1)[0])
    w.arena.payloads()[half.slot, : p.block_bytes // 2] = 0xA5  # ... and dies here
    print(json.dumps({"segment": w.seg.name, "ready": whole.slot, "torn": half.slot}), flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
