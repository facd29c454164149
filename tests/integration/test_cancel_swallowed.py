"""A cancel that redis-py swallows (Python 3.11 wait_for, see kvtier/bus/cancel.py) still stops
the daemon's chores that loop on Redis round trips: before the fix about a third of these stops
left the stream sampler running, and the manifest reader was left behind by an in-process
daemon's stop under load (test_inprocess_lifecycle.py). The prefix-index writer ended at every
point here even before it checked: its batches to one server go over kvtier's own bulk
connections (store/bulk_protocol.py), not redis-py's command path; the check is for a Redis
Cluster's, which this test does not run."""

from __future__ import annotations

import asyncio
import random

import pytest
import structlog
from structlog.testing import capture_logs

from kvtier.bus.connect import make_redis
from kvtier.config import PrefixIndexConfig
from kvtier.core.events import Cause, Stored, Tier
from kvtier.daemon.chores import Chores
from kvtier.daemon.manifest_reader import ManifestReader
from kvtier.daemon.prefix_index import PrefixIndexWriter
from kvtier.daemon.sampler import sample_streams

pytestmark = pytest.mark.integration

STREAMS = [f"kvtier:{{cancel}}:s{i}" for i in range(6)]


def _prefix_index(bus, log):
    """The prefix-index writer with 200 blocks to list (400 commands), sent 16 commands a batch."""
    writer = PrefixIndexWriter(bus, "cancel-node", {}, PrefixIndexConfig(enabled=True, batch_commands=16), log)
    writer.on_facts("p0", [Stored("p0", bytes([i % 256, i // 256]) * 16, None, Tier.CPU, i, Cause.STORE)
                           for i in range(200)])
    return writer.run()


CHORES = {
    "stream-sampler": lambda bus, log: sample_streams(bus, STREAMS, "kvtier", {}, 1e-6, 0.0, log),
    "manifest": lambda bus, log: ManifestReader(bus, ["p0", "p1", "p2"], 1e-6, log).run(),
    "prefix-index": _prefix_index,
}


@pytest.mark.parametrize("chore", sorted(CHORES))
async def test_a_chore_on_redis_ends_at_every_cancel_point(redis_url: str, chore: str) -> None:
    bus = make_redis(redis_url, socket_timeout=2.0, connect_timeout=2.0, retries=2)
    log = structlog.get_logger()
    rng = random.Random(12)
    left_running = 0
    try:
        with capture_logs() as logs:
            for _ in range(60):
                chores = Chores(log, stop_s=0.5)
                await chores.open()
                chores.start(chore, CHORES[chore](bus, log))
                for _ in range(rng.randrange(1, 200)):  # a random point in the pipeline's round trip
                    await asyncio.sleep(0)
                await chores.aclose()
                [task] = chores.tasks
                if not task.done():
                    left_running += 1
                    while not task.done():  # a cancel can be lost again: repeat until it takes
                        task.cancel()
                        await asyncio.wait([task], timeout=0.1)
    finally:
        await bus.aclose()
    assert left_running == 0
    assert not [e for e in logs if e["event"] == "daemon.chores_stuck"]
