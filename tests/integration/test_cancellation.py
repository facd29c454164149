"""Cancellation never hands one caller another caller's data (the redis-py CVE-2023-28858 pattern:
a command cancelled after it was sent leaves its reply on a pooled connection, and the next
command on that connection reads it as its own).

Many concurrent get / locate / put calls share one Client; a random subset is cancelled at a
random point (after 0-5 loop iterations, or by a wait_for with a tiny timeout). Every answer is a
function of what its own caller asked: each key has distinct bytes, and each caller's `locate`
has its own expected redis_length. Afterwards the client still works and no staging slot leaks.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from kvtier.client import Client, SyncClient
from kvtier.shm.slots import Flags, checksum
from kvtier.store.redis_blocks import pack_block, redis_block_key
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

LOCAL, REMOTE = 12, 12  # chains resident on the node; chains whose blocks are in Redis only
ROUNDS, CALLS = 12, 60
SENTINEL = 7.0


def tokens(c: int, n: int) -> list[int]:
    return [c * 10_000 + i for i in range(16 * n)]


class World:
    """What every caller may ask, and the one right answer to each question."""

    def __init__(self, block_keys, fingerprint: bytes, r) -> None:
        self.block_keys = block_keys
        self.local = [block_keys("t", tokens(c, 2), salt=b"cancel") for c in range(LOCAL)]
        self.local_kv = [make_kv(2, seed=1000 + c) for c in range(LOCAL)]
        # Remote chain j: its first j + 1 blocks are in Redis, the rest nowhere, so each locate
        # has its own answer (0, j + 1), and a reply meant for another caller shows.
        self.remote = [block_keys("t", tokens(100 + j, j + 3), salt=b"cancel") for j in range(REMOTE)]
        for j, keys in enumerate(self.remote):
            payload = make_kv(1, seed=5000 + j)[0].contiguous().view(torch.uint8).reshape(-1).numpy()
            for k in keys[: j + 1]:
                r.set(redis_block_key("t", k), bytes(pack_block(fingerprint, k, payload, checksum(payload))))
        self.puts: dict[int, tuple[list[bytes], torch.Tensor]] = {}  # every put attempted, cancelled or not

    def new_put(self) -> tuple[int, list[bytes], torch.Tensor]:
        pid = len(self.puts)
        keys = self.block_keys("t", tokens(1000 + pid, 2), salt=b"cancel-put")
        self.puts[pid] = (keys, make_kv(2, seed=20_000 + pid))
        return (pid, *self.puts[pid])


async def one_call(client: Client, world: World, kind: str, j: int, done: list, started: list) -> None:
    started.append(kind)
    if kind == "get":
        out = torch.full((3, *SHAPE), SENTINEL, dtype=torch.float16)
        keys = [*world.local[j], world.remote[0][-1]]  # two resident blocks, then one that is nowhere
        n = await client.get("t", keys, out)
        done.append(("get", j, n, out))
    elif kind == "locate":
        found = await client.locate("t", world.remote[j])
        done.append(("locate", j, found))
    else:
        pid, keys, kv = world.new_put()
        res = await client.put("t", keys, kv)
        done.append(("put", pid, res))


async def cancel_after_yields(coro, yields: int) -> None:
    task = asyncio.ensure_future(coro)
    for _ in range(yields):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def check_done(world: World, done: list) -> dict[str, int]:
    seen = {"get": 0, "locate": 0, "put": 0, "full_gets": 0}
    for item in done:
        kind = item[0]
        seen[kind] += 1
        if kind == "get":
            _, j, n, out = item
            # A transient miss is allowed (n < 2); other bytes never are.
            assert same_bytes(out[:n], world.local_kv[j][:n]), f"get of chain {j} returned other bytes"
            if n == 2:
                assert torch.all(out[2] == SENTINEL), "get wrote past the hit prefix"
                seen["full_gets"] += 1
        elif kind == "locate":
            _, j, found = item
            assert (found.length, found.redis_length) == (0, j + 1), f"locate of chain {j}: {found}"
        else:
            _, pid, res = item
            assert res.staged + res.dropped == 2, res
    return seen


async def verify_puts(client: Client, world: World, done: list) -> None:
    """Completed puts land with their own bytes; a cancelled one lands whole and right, or not at all."""
    landed = [pid for kind, pid, *rest in done if kind == "put" and rest[0].staged == 2]
    assert landed, "some puts completed"
    for pid in landed:
        keys, _ = world.puts[pid]
        assert await client.wait_resident("t", keys, timeout=10), f"put {pid} never became resident"
    for pid, (keys, kv) in world.puts.items():
        out = torch.full((2, *SHAPE), SENTINEL, dtype=torch.float16)
        n = await client.get("t", keys, out)
        assert same_bytes(out[:n], kv[:n]), f"put {pid}: the blocks it stored hold other bytes"


@pytest.mark.parametrize("copies", ["inline", "threads"])
async def test_cancelled_calls_never_get_another_callers_data(daemon_factory, redis_server, copies):
    """`threads`: every get and put copies in the client's copy threads (big blocks do), so a
    cancellation also lands while threads write into the caller's tensor and the staging."""
    d = daemon_factory(node=f"cancel-{copies}", gpu=512, cpu=16)  # room for everything: no demotions
    r = redis_server.client()
    rng = random.Random(2823)
    try:
        async with await Client.connect(d.runtime_dir, staging_blocks=1024) as client:
            if copies == "threads":
                client.off_loop_bytes = client.inline_put_bytes = 0
            world = World(client.block_keys, client.pool("t").fingerprint, r)
            for keys, kv in zip(world.local, world.local_kv):
                assert (await client.put("t", keys, kv)).dropped == 0
            for keys in world.local:
                assert await client.wait_resident("t", keys, timeout=10)

            done: list = []
            started: list[str] = []
            cancelled = {"get": 0, "locate": 0, "put": 0}
            for _ in range(ROUNDS):
                calls = []
                for _ in range(CALLS):
                    kind = rng.choice(("get", "locate", "locate", "put"))
                    j = rng.randrange(LOCAL if kind == "get" else REMOTE)
                    coro = one_call(client, world, kind, j, done, started)
                    mode = rng.random()
                    if mode < 0.35:
                        calls.append(cancel_after_yields(coro, rng.randrange(6)))
                    elif mode < 0.7:
                        calls.append(asyncio.wait_for(coro, timeout=rng.choice((0, 1e-4, 5e-4, 2e-3))))
                    else:
                        calls.append(coro)
                results = await asyncio.gather(*calls, return_exceptions=True)
                for res in results:
                    assert res is None or isinstance(res, (asyncio.TimeoutError, asyncio.CancelledError)), res
            seen = check_done(world, done)
            for kind in cancelled:
                cancelled[kind] = started.count(kind) - seen[kind]
            print(f"cancellation: completed {seen}, cancelled after starting {cancelled}")
            # Cancellation really landed mid-flight for the calls that wait on Redis.
            assert cancelled["locate"] > 0 and cancelled["put"] > 0, cancelled
            assert seen["locate"] > 0 and seen["put"] > 0 and seen["full_gets"] > 0, seen

            await verify_puts(client, world, done)
            # The client keeps working: uncancelled calls all right, a fresh put lands.
            done.clear()
            await asyncio.gather(*(one_call(client, world, k, j, done, [])
                                   for k in ("get", "locate") for j in range(LOCAL)))
            after = check_done(world, done)
            assert (after["get"], after["locate"], after["full_gets"]) == (LOCAL, LOCAL, LOCAL), after
            pid, keys, kv = world.new_put()
            assert (await client.put("t", keys, kv)).staged == 2
            assert await client.wait_resident("t", keys, timeout=10)
            # No staging slot leaks: the daemon frees what it stored, a cancelled put frees its own.
            staging = client.pool("t").staging.table
            await async_wait_until(lambda: all(staging.flags(s) == Flags.EMPTY for s in range(staging.n)),
                                   timeout=10, message="every staging slot free again")
        assert d.alive
    finally:
        r.close()


def test_sync_client_from_many_threads_returns_each_callers_own_data(daemon_factory, redis_server):
    """SyncClient runs every call on its one loop thread; callers on many threads must still each
    get their own answer."""
    d = daemon_factory(node="cancel-sync", gpu=256, cpu=16)
    r = redis_server.client()
    errors: list[BaseException] = []
    try:
        async def fingerprint() -> bytes:
            async with await Client.connect(d.runtime_dir) as c:
                return c.pool("t").fingerprint

        fp = asyncio.run(fingerprint())
        with SyncClient(d.runtime_dir, staging_blocks=1024) as client:
            world = World(client.block_keys, fp, r)
            for keys, kv in zip(world.local, world.local_kv):
                assert client.put("t", keys, kv).dropped == 0
            for keys in world.local:
                assert client.wait_resident("t", keys, timeout=10)
            lock = threading.Lock()  # World.new_put numbers puts; the calls themselves are unlocked

            def worker(seed: int) -> None:
                rng = random.Random(seed)
                try:
                    for _ in range(40):
                        kind = rng.choice(("get", "locate", "put"))
                        if kind == "get":
                            j = rng.randrange(LOCAL)
                            out = torch.full((2, *SHAPE), SENTINEL, dtype=torch.float16)
                            assert client.get("t", world.local[j], out) == 2
                            assert same_bytes(out, world.local_kv[j]), f"thread {seed}: chain {j} bytes"
                        elif kind == "locate":
                            j = rng.randrange(REMOTE)
                            found = client.locate("t", world.remote[j])
                            assert (found.length, found.redis_length) == (0, j + 1), (j, found)
                        else:
                            with lock:
                                pid, keys, kv = world.new_put()
                            assert client.put("t", keys, kv).staged == 2
                except BaseException as e:  # reported by the main thread
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), "a worker thread hung"
            assert not errors, errors[0]
            for pid, (keys, kv) in world.puts.items():
                assert client.wait_resident("t", keys, timeout=10), f"put {pid}"
                out = torch.empty((2, *SHAPE), dtype=torch.float16)
                assert client.get("t", keys, out) == 2 and same_bytes(out, kv), f"put {pid} bytes"
        assert d.alive
    finally:
        r.close()
