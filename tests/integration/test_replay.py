"""Replaying a recorded event log with duplicates and swapped neighbours leaves the same final state.

Streams deliver at least once: after a consumer crash or an XAUTOCLAIM an entry comes again,
possibly after entries that were behind it. This test runs the real coordinator and the real
tier workers of one pool (real shared-memory arenas, the session's real redis-server) over an
in-process stand-in for the node's streams, so that delivery can be scripted:

1. The original run drives a seeded workload (puts of prompt chains, reads, prefetches) through
   the pool with in-order, exactly-once delivery, recording the client events it published.
2. Each replay builds a fresh pool and feeds it the recorded client log, while the stand-in
   perturbs every stream: entries are delivered twice (at once, or late, after later entries
   and even after later client steps) and neighbours in a stream are swapped.
3. The final state (which blocks each tier holds, with their exact bytes) must equal the
   original's. Workers fence commands per block by their (epoch, seq) stamp
   (kvtier/core/fence.py); the last check shows the perturbations do diverge without it.

The replayed client log is the original's, except that the client stages the same blocks again
in a fresh staging segment (the original one has been released and reused), and Put entries
are pointed at it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import uuid
from collections import deque

import numpy as np
import pytest
import structlog
import torch

from kvtier.bus.connect import make_redis
from kvtier.bus.consumer import Delivery
from kvtier.bus.dedup import AppliedEntries
from kvtier.bus.streams import StreamNames
from kvtier.client.pools import ClientPool
from kvtier.config import PolicyConfig, PoolConfig, RedisConfig
from kvtier.core.events import Access, Envelope, Evict, Prefetch, Promote, Put, StagedBlock, Tier
from kvtier.core.fence import CommandFence
from kvtier.daemon.coordinator import Coordinator
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.shm.slots import checksum
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.worker import TierWorker

pytestmark = pytest.mark.integration

POOL = PoolConfig(name="r", model="replay", layers=1, kv_heads=1, head_dim=8, block_tokens=4,
                  dtype="float16", device="cpu", gpu_blocks=4, cpu_blocks=8)
# Leases and in-flight marks must not expire during a run: the replay runs slower than the original.
POLICY = PolicyConfig(prefetch_lease_s=3600.0, transfer_timeout_s=3600.0)
STEPS = 120


def _forest(rng: random.Random) -> tuple[list[list[bytes]], dict[bytes, bytes | None]]:
    """Prompts as key chains; many share their first blocks, as system prompts do."""
    heads = [[hashlib.sha256(f"sys{i}/{j}".encode()).digest() for j in range(2)] for i in range(3)]
    prompts, parent = [], {}
    for n in range(8):
        chain = list(heads[n % 3]) + [hashlib.sha256(f"p{n}/{j}".encode()).digest()
                                      for j in range(rng.randint(1, 4))]
        prompts.append(chain)
        for i, k in enumerate(chain):
            parent[k] = chain[i - 1] if i else None
    return prompts, parent


def block_bytes_of(key: bytes, n: int) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(key).digest(n), dtype=np.uint8)


class Streams:
    """The node's streams, in process: FIFO queues per stream, stamped like the daemon's Publisher."""

    def __init__(self, names: StreamNames, epoch: int) -> None:
        self.names = names
        self.epoch = epoch
        self.seq = 0
        self.queues: dict[str, deque[Envelope]] = {
            s: deque() for s in (names.client, names.facts, *(names.tier(t) for t in Tier))}

    async def publish(self, stream: str, event) -> bytes:
        await self.publish_many([(stream, event)])
        return b"0-0"

    async def publish_many(self, items) -> list[bytes]:
        for stream, event in items:
            self.seq += 1
            self.queues[stream].append(Envelope(event=event, producer="n/daemon", epoch=self.epoch, seq=self.seq))
        return [b"0-0"] * len(items)


@dataclasses.dataclass
class Perturb:
    """How a replay's deliveries are disturbed; None: in order, exactly once."""

    rng: random.Random
    dup: float = 0.15  # an entry is delivered twice in its batch
    late: float = 0.15  # an entry comes again after this many other deliveries (a redelivery)
    swap: float = 0.25  # two neighbours in a batch trade places
    swap_in: tuple[str, ...] = ("client", "facts", "tier")  # in which streams
    withhold: float = 0.0  # an entry's first delivery fails; it comes after later ones
    counts: dict = dataclasses.field(default_factory=lambda: {"dup": 0, "late": 0, "swap": 0})


class Node:
    """One pool's coordinator and tier workers, wired to `Streams`."""

    def __init__(self, redis_client, perturb: Perturb | None, off_loop_bytes: int = 256 << 10,
                 flush_bytes: int = 32 << 20) -> None:
        self.node = f"replay-{uuid.uuid4().hex[:10]}"
        log = structlog.get_logger().bind(node=self.node)
        self.rt = open_pool(POOL, self.node, POLICY, redis_client, RedisConfig(block_ttl_s=3600), None, log)
        pools = {POOL.name: self.rt}
        self.staging = StagingSegments(self.node, log)
        self.names = StreamNames(self.node)
        self.streams = Streams(self.names, epoch=1)
        self.coordinator = coordinator = Coordinator(pools, self.staging, self.streams, self.names, log)
        self.workers = {t: TierWorker(t, pools, self.staging, self.streams, self.names.facts, log,
                                      off_loop_bytes=off_loop_bytes, flush_bytes=flush_bytes)
                        for t in Tier}
        self.consumers = {self.names.client: coordinator, self.names.facts: coordinator,
                          **{self.names.tier(t): w for t, w in self.workers.items()}}
        self.perturb = perturb
        self.late: list[list] = []  # [deliveries to go, stream, envelope]
        self.client = ClientPool(POOL.name, self.rt.descriptor(), self.node, daemon_uid=os.geteuid(), shm_gid=None,
                                 staging_blocks=STEPS * 8)

    async def settle(self, drain_late: bool) -> None:
        """Deliver until every queue is empty (and, if asked, every late copy has come)."""
        while True:
            ready = [s for s, q in self.streams.queues.items() if q]
            if not ready:
                if not (drain_late and self.late):
                    return
                for item in self.late:
                    item[0] = 0
            else:
                await self._deliver(ready[0])  # the same schedule across streams as the original
            for item in self.late:
                item[0] -= 1
            for item in [i for i in self.late if i[0] <= 0]:
                self.late.remove(item)
                self.streams.queues[item[1]].append(item[2])

    async def _deliver(self, stream: str) -> None:
        q, p = self.streams.queues[stream], self.perturb
        batch = [q.popleft() for _ in range(min(len(q), 4))]
        if p is not None:
            out = []
            for env in batch:
                if any(f":{w}" in stream for w in p.swap_in) and p.rng.random() < p.withhold:
                    self.late.append([p.rng.randint(1, 30), stream, env])
                    p.counts["withheld"] = p.counts.get("withheld", 0) + 1
                    continue
                out.append(env)
                if p.rng.random() < p.dup:
                    out.append(env)
                    p.counts["dup"] += 1
                if p.rng.random() < p.late:
                    self.late.append([p.rng.randint(1, 30), stream, env])
                    p.counts["late"] += 1
            for i in range(len(out) - 1):
                if any(f":{w}" in stream for w in p.swap_in) and p.rng.random() < p.swap:
                    out[i], out[i + 1] = out[i + 1], out[i]
                    p.counts["swap"] += 1
            batch = out
        consumer = self.consumers[stream]
        for env in batch:
            await consumer.handle(Delivery(stream, b"0-0", env))
        await consumer.flush()

    def stage(self, put: Put) -> Put:
        """Stage the put's blocks (same bytes, same order) in this node's client staging."""
        keys = [b.key for b in put.blocks]
        kv = torch.from_numpy(np.stack([block_bytes_of(k, self.client.block_bytes) for k in keys]).copy())
        staged = self.client.stage(keys, put.blocks[0].parent, kv.view(self.client.dtype).reshape(
            len(keys), *self.client.shape))
        assert len(staged) == len(keys), "staging ran out of slots"
        return Put(POOL.name, self.client.staging.seg.name, tuple(staged))

    def local_hits(self, chain: list[bytes]) -> int:
        n = 0
        for k in chain:
            if self.client.locate(k) is None:
                break
            n += 1
        return n

    async def state(self, universe: list[bytes]) -> dict[str, dict[bytes, bytes]]:
        """Which blocks each tier holds, with their bytes, read back and verified."""
        out: dict[str, dict[bytes, bytes]] = {}
        buf = np.empty(self.rt.layout.block_bytes, dtype=np.uint8)
        for t in (Tier.GPU, Tier.CPU):
            local = self.rt.local(t)
            held = {}
            for e in local.index.ready():
                assert local.read(e.key, buf) is not None, f"{t.label} holds an unreadable block"
                held[e.key] = buf.tobytes()
            out[t.label] = held
        redis_held = {}
        for k in universe:
            got = await self.rt.redis.get(k)
            if got is not None:
                redis_held[k] = got[0].tobytes()
        out["redis"] = redis_held
        return out

    def close(self) -> None:
        self.client.close()  # unlinks its staging segment
        self.staging.close()
        close_pool(self.rt, persist_arena=False)


async def _original(redis_client, seed: int, **knobs) -> tuple[list, dict, list[bytes]]:
    """Run the seeded workload in order, exactly once; return the client log and the final state."""
    rng = random.Random(seed)
    prompts, parent = _forest(rng)
    universe = sorted(parent)
    node = Node(redis_client, None, **knobs)
    log: list = []
    try:
        for _ in range(STEPS):
            chain = rng.choice(prompts[:3] * 3 + prompts)  # a few hot prompts
            hit = node.local_hits(chain)
            roll = rng.random()
            if roll < 0.25 and hit < len(chain):  # what Redis holds past the local prefix
                there = await node.rt.redis.exists(chain[hit:])
                run = chain[hit:hit + (there.index(False) if False in there else len(there))]
                ev = (Prefetch(POOL.name, tuple(run), parent[run[0]]) if run
                      else Access(POOL.name, tuple(chain[:hit]), len(chain) - hit))
            elif hit < len(chain):  # read the cached prefix, compute and put the rest
                if hit:
                    log.append(Access(POOL.name, tuple(chain[:hit]), 0))
                    await _step(node, log[-1])
                ev = Put(POOL.name, "-", tuple(StagedBlock(k, parent[k], 0, 0) for k in chain[hit:]))
            else:
                ev = Access(POOL.name, tuple(chain), 0)
            log.append(ev)
            await _step(node, ev)
        await node.settle(drain_late=True)
        return log, await node.state(universe), universe
    finally:
        node.close()


async def _step(node: Node, ev) -> None:
    """Publish one client event (a put is staged first) and let the node act on it."""
    await node.streams.publish(node.names.client, node.stage(ev) if isinstance(ev, Put) else ev)
    await node.settle(drain_late=False)


async def _replay(redis_client, log: list, universe: list[bytes], perturb: Perturb, **knobs) -> tuple[dict, dict]:
    node = Node(redis_client, perturb, **knobs)
    try:
        for ev in log:
            await _step(node, ev)
        await node.settle(drain_late=True)
        skipped = {t.label: node.rt.counters.tiers[t.label].stale for t in Tier}
        skipped["coordinator"] = node.coordinator.applied.skipped
        return await node.state(universe), skipped
    finally:
        node.close()


@pytest.fixture
async def redis_client(redis_url):
    client = make_redis(redis_url, socket_timeout=5.0, connect_timeout=5.0, retries=1)
    yield client
    await client.aclose()


def _diff(a: dict, b: dict) -> str:
    lines = []
    for tier in a:
        for k in sorted(set(a[tier]) | set(b[tier])):
            if a[tier].get(k) != b[tier].get(k):
                lines.append(f"{tier} {k.hex()[:12]}: original {'has' if k in a[tier] else 'lacks'}, "
                             f"replay {'has' if k in b[tier] else 'lacks'}"
                             + (" (bytes differ)" if k in a[tier] and k in b[tier] else ""))
    return "\n".join(lines)


def _held(state: dict) -> dict[bytes, bytes]:
    """Every block held anywhere on the node or in Redis, with its bytes (checked exact)."""
    out: dict[bytes, bytes] = {}
    for tier, held in state.items():
        for k, data in held.items():
            assert data == block_bytes_of(k, len(data)).tobytes(), f"wrong bytes for {k.hex()[:12]} in {tier}"
            out[k] = data
    return out


def _put_keys(log: list) -> set[bytes]:
    return {b.key for e in log if isinstance(e, Put) for b in e.blocks}


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_duplicated_and_swapped_deliveries_reach_the_original_state(redis_client, seed: int) -> None:
    """Duplicates in every stream, at once or late (after later entries and later client steps),
    and swapped neighbours in the client and facts streams: exactly the original final state.
    Seed 2 runs every copy in a thread and sends Redis I/O in pipelines of a few blocks."""
    knobs = {"off_loop_bytes": 0, "flush_bytes": 512} if seed == 2 else {}
    await redis_client.flushall()
    log, original, universe = await _original(redis_client, seed, **knobs)
    assert original["gpu"] and original["cpu"] and original["redis"], "the workload should use every tier"
    assert sum(isinstance(e, Put) for e in log) >= 10 and any(isinstance(e, Prefetch) for e in log)
    assert _held(original).keys() == _put_keys(log), "the original run lost blocks"

    await redis_client.flushall()
    again, _ = await _replay(redis_client, log, universe, Perturb(random.Random(0), dup=0, late=0, swap=0), **knobs)
    assert again == original, "an unperturbed replay must be exact:\n" + _diff(original, again)

    for r in range(2):
        await redis_client.flushall()
        perturb = Perturb(random.Random(1000 * seed + r), swap_in=("client", "facts"))
        replay, skipped = await _replay(redis_client, log, universe, perturb, **knobs)
        assert min(perturb.counts.values()) > 0 and sum(skipped.values()) > 0, (perturb.counts, skipped)
        _held(replay)
        assert replay == original, f"replay {r} ({perturb.counts}, skipped {skipped}) diverged:\n" + _diff(
            original, replay)


async def test_without_skipping_redeliveries_the_replay_diverges(redis_client, monkeypatch) -> None:
    """The check above has teeth: with redeliveries applied again, the final state differs."""
    await redis_client.flushall()
    log, original, universe = await _original(redis_client, 1)
    monkeypatch.setattr(AppliedEntries, "duplicate", lambda self, env: False)
    monkeypatch.setattr(CommandFence, "stale", lambda self, pool, key, stamp: False)
    diverged = 0
    for r in range(2):
        await redis_client.flushall()
        replay, _ = await _replay(redis_client, log, universe, Perturb(random.Random(r), swap_in=("client", "facts")))
        diverged += replay != original
    assert diverged, "duplicates applied twice should have changed the outcome"


@pytest.mark.parametrize("seed", [1, 2])
async def test_reordered_commands_lose_nothing(redis_client, seed: int) -> None:
    """Tier commands swapped, and first deliveries that fail and come after later entries. LRU age
    follows arrival order, so which tier ends up holding a block may differ from the original;
    what may not: every block put is still held somewhere, with exactly its bytes."""
    await redis_client.flushall()
    log, original, universe = await _original(redis_client, seed)
    for r in range(2):
        await redis_client.flushall()
        perturb = Perturb(random.Random(77 * seed + r), swap_in=("tier",), withhold=0.1)
        replay, skipped = await _replay(redis_client, log, universe, perturb)
        assert perturb.counts["withheld"] and perturb.counts["swap"], perturb.counts
        assert _held(replay).keys() == _put_keys(log), f"lost: {_put_keys(log) - _held(replay).keys()}"


async def test_a_late_command_does_not_undo_a_newer_one(redis_client) -> None:
    """The per-block fence: a promote delivered for the first time after the evict the coordinator
    decided later is skipped, so the block stays out, as the newer decision said."""
    await redis_client.flushall()
    node = Node(redis_client, None)
    try:
        key = hashlib.sha256(b"fenced").digest()
        await _step(node, Put(POOL.name, "-", (StagedBlock(key, None, 0, 0),)))
        cpu = node.rt.placement.tiers[Tier.CPU]
        gpu = node.rt.placement.tiers[Tier.GPU]
        assert key in gpu
        buf = block_bytes_of(key, node.rt.layout.block_bytes)
        await node.rt.redis.put(key, buf, checksum(buf))
        node.rt.placement.tiers[Tier.REDIS].add(key, None)
        epoch = node.streams.epoch
        promote = Envelope(Promote(POOL.name, key, None, Tier.REDIS, Tier.CPU, -1, 0), "n/daemon", epoch, 10_000)
        evict = Envelope(Evict(POOL.name, key, Tier.CPU, "clean"), "n/daemon", epoch, 10_001)
        worker = node.workers[Tier.CPU]
        await worker.handle(Delivery(node.names.tier(Tier.CPU), b"1-0", promote))  # the block comes up
        await worker.flush()
        assert key in cpu
        cpu.mark_leaving(key)  # what the coordinator does when it decides the evict
        await worker.handle(Delivery(node.names.tier(Tier.CPU), b"2-0", evict))
        await worker.flush()
        assert key not in cpu
        late = Envelope(Promote(POOL.name, key, None, Tier.REDIS, Tier.CPU, -1, 0), "n/daemon", epoch, 9_999)
        await worker.handle(Delivery(node.names.tier(Tier.CPU), b"0-1", late))  # older than the evict
        await worker.flush()
        assert key not in cpu, "a late promote undid the newer evict"
        assert node.rt.counters.tiers["cpu"].stale == 1
        newer = Envelope(Promote(POOL.name, key, None, Tier.REDIS, Tier.CPU, -1, 0), "n/daemon", epoch, 10_002)
        await worker.handle(Delivery(node.names.tier(Tier.CPU), b"3-0", newer))  # a new decision applies
        await worker.flush()
        assert key in cpu
    finally:
        node.close()
