"""The client's batched read reports (kvtier/client/access.py), against a stand-in publisher that
records each round trip. Waits are on conditions (tests/support/waiting.py), never fixed sleeps."""

from __future__ import annotations

import time

import redis.exceptions
import structlog

from kvtier.client.access import ACCESS_FLUSH_S, AccessReports
from kvtier.client.results import ClientStats
from kvtier.core.events import Access
from kvtier.keys import BlockKey
from kvtier.logs import LogThrottle
from tests.support.waiting import async_wait_until

K1, K2, K3 = (BlockKey(bytes([i]) * 32) for i in (1, 2, 3))


class FakePublisher:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[tuple[str, Access]]] = []
        self.fail = fail

    async def publish_many(self, items):
        self.calls.append(list(items))
        if self.fail:
            raise redis.exceptions.ConnectionError("down")
        return [b"0-1"] * len(items)


def reports(pub: FakePublisher, stats: ClientStats) -> AccessReports:
    return AccessReports(pub, "n/client", stats, LogThrottle(structlog.get_logger("test")))


async def test_reads_within_the_window_go_in_one_round_trip_per_pool_batch():
    pub, stats = FakePublisher(), ClientStats()
    acc = reports(pub, stats)
    t0 = time.monotonic()
    acc.note("a", [K1], 0)
    acc.note("a", [K2], 2)
    acc.note("b", [], 1)
    assert pub.calls == [], "nothing is sent before the window closes"
    await async_wait_until(lambda: pub.calls, timeout=5, interval=0.001, message="the first window's report")
    assert time.monotonic() - t0 >= ACCESS_FLUSH_S, "sent before the window closed"
    assert pub.calls == [[("n/client", Access("a", (K1, K2), 2)), ("n/client", Access("b", (), 1))]]
    acc.note("a", [K3], 0)  # a new window, a new report
    await async_wait_until(lambda: len(pub.calls) == 2, timeout=5, interval=0.001, message="the second report")
    assert pub.calls[1] == [("n/client", Access("a", (K3,), 0))]
    await acc.close()  # waits for any flush still due: none, so no third round trip
    assert len(pub.calls) == 2
    assert stats.event_errors == 0


async def test_close_sends_what_is_pending_and_an_empty_batch_sends_nothing():
    pub, stats = FakePublisher(), ClientStats()
    acc = reports(pub, stats)
    await acc.flush()
    assert pub.calls == []
    acc.note("a", [K1], 0)
    await acc.close()
    assert pub.calls == [[("n/client", Access("a", (K1,), 0))]]


async def test_a_failed_report_is_counted_not_raised():
    pub, stats = FakePublisher(fail=True), ClientStats()
    acc = reports(pub, stats)
    acc.note("a", [K1], 0)
    await acc.close()
    assert len(pub.calls) == 1 and stats.event_errors == 1
