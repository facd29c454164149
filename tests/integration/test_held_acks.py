"""A fresh read's batch is acked with the consumer's next read, in one round trip (bus/batch.py,
`ack_then_read`), against a real, private redis-server: the acks still go only after the batch's
effects, and what may not have landed is held again, never dropped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.exceptions import ResponseError
from structlog.testing import capture_logs

from kvtier.bus.connect import make_redis
from kvtier.bus.consumer import Consumer
from kvtier.bus.failures import REDIS_ERRORS, is_outage
from kvtier.bus.publisher import Publisher
from tests.integration.test_bus import GROUP, STREAM, Recorder, access, make_consumer, pending, running
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration
NO_CLAIM_MS = 60_000  # no periodic claim comes due during the test: the held ack goes with a read


class Gated(Recorder):
    """A Recorder whose handler returns only once `release` is set (a slow handler)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def __call__(self, d) -> None:
        await super().__call__(d)
        await self.release.wait()


@asynccontextmanager
async def clients(redis_url: str, socket_timeout: float, connect_timeout: float = 2.0) -> AsyncIterator[tuple]:
    """The consumer's client (`socket_timeout`, no retries) and another that pauses Redis and looks
    at it; any pause lifted and both closed after."""
    client = make_redis(redis_url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=0)
    other = make_redis(redis_url, socket_timeout=5.0, connect_timeout=2.0, retries=0)
    try:
        yield client, other
    finally:
        await other.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()
        await other.aclose()


@asynccontextmanager
async def run_task(consumer: Consumer) -> AsyncIterator[asyncio.Task]:
    """`consumer.run()` as a task, cancelled after if the test left it running."""
    task = asyncio.create_task(consumer.run())
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()


async def cancel(task: asyncio.Task) -> None:
    """Cancel the consumer's task and wait for it to end, as cancelled."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def publish_p0(r) -> bytes:
    return await Publisher(r, "client-1", epoch=1, maxlen=1000).publish(STREAM, access("p0"))


async def one_batch_held(r, rec: Recorder, **kw) -> tuple[Consumer, Publisher, bytes]:
    """A consumer that has read and handled one entry, "p0", its ack held: (it, a publisher, the id)."""
    pub = Publisher(r, "client-1", epoch=1, maxlen=1000)
    consumer = make_consumer(r, rec, **kw)
    await consumer._ensure_groups()
    entry = await pub.publish(STREAM, access("p0"))
    assert await consumer._read_new(block=False)
    return consumer, pub, entry


async def test_a_batch_is_acked_by_the_next_read(aredis, monkeypatch) -> None:
    rec = Recorder()
    consumer, pub, _ = await one_batch_held(aredis, rec)
    # handled, its effects done, its ack held for the next read: still pending in Redis
    assert [d.envelope.event.pool for d in rec.seen] == ["p0"]
    assert await pending(aredis) == 1 and consumer.stats.acked == 0
    await pub.publish(STREAM, access("p1"))
    xacks = await _calls(aredis, "xack")
    direct: list[object] = []  # commands sent on their own (a pipeline's go another way)
    sent = aredis.execute_command

    async def counted(*args, **kwargs):
        direct.append(args[0])
        return await sent(*args, **kwargs)

    monkeypatch.setattr(aredis, "execute_command", counted)
    assert await consumer._read_new(block=False)  # p0's XACK rode with this read: one round trip
    monkeypatch.undo()
    assert direct == [] and await _calls(aredis, "xack") == xacks + 1
    assert rec.pools() == ["p0", "p1"] and await pending(aredis) == 1 and consumer.stats.acked == 1
    assert not await consumer._read_new(block=False)  # nothing new: p1's ack went with the empty read
    assert await pending(aredis) == 0 and consumer.stats.acked == 2


async def test_a_stop_acks_what_is_held(aredis) -> None:
    consumer, _, _ = await one_batch_held(aredis, Recorder())
    assert await pending(aredis) == 1
    consumer.stop()
    await consumer.run()  # stopped before it reads again: the held ack goes out on its own
    assert await pending(aredis) == 0 and consumer.stats.acked == 1


async def test_a_refused_read_still_lands_the_acks(aredis) -> None:
    """Redis runs the XACKs before the read it refuses (no such group): they landed, so they are
    not held again, and the read's error is the caller's."""
    consumer, _, _ = await one_batch_held(aredis, Recorder())
    with pytest.raises(ResponseError, match="NOGROUP"):
        await consumer._batches.ack_then_read(lambda pipe: pipe.xreadgroup("no-such-group", "c", {STREAM: ">"}))
    assert await pending(aredis) == 0 and consumer.stats.acked == 1 and not consumer._batches.holding


async def test_acks_an_outage_cut_off_are_held_and_sent_later(redis_url) -> None:
    """Redis stops answering while the held acks go out with a read (its clients paused past the
    consumer's socket timeout): they are held again, since they may not have landed, and the
    outage ledger keeps that delivery from counting against the entry. They land with the next
    read once Redis answers."""
    async with clients(redis_url, 0.5, connect_timeout=0.5) as (client, other):
        consumer, _, entry = await one_batch_held(client, Recorder(), block_ms=100)
        await other.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        with pytest.raises(REDIS_ERRORS) as err:
            await consumer._read_new(block=False)
        assert is_outage(err.value), err.value
        assert consumer._batches.holding and consumer.stats.acked == 0
        assert consumer._batches.outages.counted(STREAM, entry, 2) == 1  # that delivery is not held against it
        await other.execute_command("CLIENT", "UNPAUSE")
        assert not await consumer._read_new(block=False)
        assert await pending(client) == 0 and consumer.stats.acked == 1 and not consumer._batches.holding


async def _calls(r, command: str) -> int:
    stats = await r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_stop_in_an_outage_leaves_the_held_acks_pending_and_says_so(redis_url) -> None:
    """Redis not answering when a stopped consumer sends its held acks: they cannot land, so
    their entries stay pending (the next start handles them again) and a line says how many."""
    async with clients(redis_url, 0.5, connect_timeout=0.5) as (client, other):
        consumer, _, _ = await one_batch_held(client, Recorder(), block_ms=100)
        await other.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        consumer.stop()
        with capture_logs() as logs:
            await consumer.run()
        left = [e for e in logs if e["event"] == "bus.acks_left_pending"]
        assert [e["entries"] for e in left] == [1] and consumer.stats.acked == 0
        await other.execute_command("CLIENT", "UNPAUSE")
        assert await pending(client) == 1  # the entry waits for the next start, not lost, not acked


async def test_held_acks_go_before_a_periodic_claim(aredis) -> None:
    """When the claim comes due right after a batch (a handler slower than claim_idle_ms), the
    batch's held ack goes first, on its own: the claim must not find that entry pending and hand
    it back to be handled twice."""
    rec = Gated()
    consumer = make_consumer(aredis, rec, block_ms=50, claim_idle_ms=100)
    async with running(consumer):
        await publish_p0(aredis)
        await async_wait_until(lambda: rec.seen, message="p0 delivered")

        async def idle_ms() -> int:
            rows = await aredis.xpending_range(STREAM, GROUP, "-", "+", 1)
            return rows[0]["time_since_delivered"] if rows else 0
        # Idle past claim_idle_ms (so past the claim's due time too): the claim would take it.
        await async_wait_until(lambda: _at_least(idle_ms(), 150), message="p0 idle past claim_idle_ms")
        rec.release.set()
        await async_wait_until(lambda: consumer.stats.acked == 1, message="p0 acked")
        claims = await _calls(aredis, "xautoclaim")
        await async_wait_until(lambda: _at_least(_calls(aredis, "xautoclaim"), claims + 1), message="a claim after p0")
    assert rec.pools() == ["p0"] and consumer.stats.reclaimed == 0 and await pending(aredis) == 0


async def test_a_cancel_mid_read_settles_the_held_acks_on_the_way_out(redis_url) -> None:
    """The consumer cancelled while its held ack rides with a blocking read: that ack may not have
    landed, so it is held again, and the consumer's exit sends it (bounded, as it was cancelled).
    (Redis ran the pipeline's XACK before the read blocked, so the entry is not pending either
    way: the exit's own XACK is what shows the ack was held again.)"""
    rec = Recorder()
    async with clients(redis_url, 10.0) as (client, other):
        consumer = make_consumer(client, rec, block_ms=8000, claim_idle_ms=NO_CLAIM_MS)  # the read outlasts the test
        async with run_task(consumer) as task:
            await publish_p0(client)
            await async_wait_until(lambda: rec.seen, message="p0 delivered")
            # The next read, with p0's ack, blocked in Redis.
            await async_wait_until(lambda: _blocked(other), message="the consumer's read blocked")
            xacks = await _calls(other, "xack")
            with capture_logs() as logs:
                await cancel(task)
        assert await _calls(other, "xack") == xacks + 1  # the exit's, for the ack held again
        assert not [e for e in logs if e["event"] == "bus.acks_left_pending"]
        assert consumer.stats.acked == 1 and not consumer._batches.holding and await pending(other) == 0


async def test_a_cancel_while_redis_stalls_keeps_the_ack_and_says_so(redis_url) -> None:
    """Cancelled while Redis holds every write (paused far past the exit's 1 s bound) and the held
    ack waits in it with the next read: the exit gives up after its bound, not the client's 8 s
    socket timeout; the ack cannot land, so its entry stays pending for the next start, and a line
    says so. Nothing is counted acked that was not."""
    rec = Gated()
    async with clients(redis_url, 8.0) as (client, other):
        consumer = make_consumer(client, rec, block_ms=100, claim_idle_ms=NO_CLAIM_MS)
        async with run_task(consumer) as task:
            await publish_p0(client)
            await async_wait_until(lambda: rec.seen, message="p0 delivered")
            await other.execute_command("CLIENT", "PAUSE", "20000", "WRITE")  # lifted below, once cancelled
            rec.release.set()  # p0 done: its ack goes with the next read, into the pause
            await async_wait_until(lambda: _blocked(other), message="the ack and read held by the pause")
            with capture_logs() as logs:
                t0 = time.monotonic()
                await cancel(task)
                took = time.monotonic() - t0
        assert took < 4.0, took  # the exit's 1 s bound, well short of the 8 s socket timeout
        left = [e for e in logs if e["event"] == "bus.acks_left_pending"]
        assert [e["entries"] for e in left] == [1] and consumer.stats.acked == 0
        await other.execute_command("CLIENT", "UNPAUSE")
        assert await pending(client) == 1  # not lost: the next start handles it again


async def _at_least(count, n: int) -> bool:
    return await count >= n


async def _blocked(r) -> bool:
    return int((await r.info("clients"))["blocked_clients"]) >= 1
