"""The engine seam (issue 26): the one link every integration reaches the daemon through
(kvtier/integrations/link.py), and the client contract it rests on, against real daemons."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import numpy as np
import pytest
import structlog
import torch

from kvtier.client import DropReason, ManifestEntry, SyncClient
from kvtier.errors import CallTimeout, KvtierError, RedisUnavailable
from kvtier.integrations.counters import Counters
from kvtier.integrations.link import LINK_COUNTERS, EngineLink
from kvtier.integrations.pool_spec import PoolMismatch, PoolSpec
from tests.support.blocks import SHAPE, make_kv, same_bytes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

BLOCK_BYTES = 8192  # the test pool's


def link_for(runtime_dir, spec: PoolSpec | None = None, **kw) -> EngineLink:
    return EngineLink(runtime_dir=str(runtime_dir), spec=spec or PoolSpec("t", block_bytes=BLOCK_BYTES),
                      counters=Counters(LINK_COUNTERS), log=structlog.get_logger("test"),
                      **{"retry_s": 0.2, "watch_s": 0.1, "call_timeout_s": 2.0, **kw})


def test_a_missing_daemon_is_a_miss_then_the_link_connects_when_it_comes(daemon_factory):
    d = daemon_factory(start=False)
    link = link_for(d.runtime_dir).start(first=True)  # no daemon: not an error at start
    try:
        assert link.client() is None
        assert link.guard("lookup", "miss", lambda c: "hit") == "miss"
        assert link.counters.snapshot()["connect_failures"] >= 1
        d.start()
        c = wait_until(link.client, timeout=10, message="the link's thread connects once the daemon is up")
        assert link.guard("lookup", "miss", lambda c: c.lookup("t", [bytes(32)]).length) == 0
        d.kill()
        wait_until(lambda: link.client() is None, timeout=5, message="the link notices the daemon died")
        assert link.counters.snapshot()["daemon_lost"] == 1
        d.start()
        assert wait_until(link.client, timeout=10, message="and follows it back") is not c
    finally:
        link.close()


def test_start_waits_for_the_first_try_so_the_first_call_finds_a_healthy_daemon(daemon_factory):
    """`start(wait_s)` (the vLLM connector's): the watcher's first try is over when start returns.
    With the daemon up the link is connected; with none, start returns on the failed try, well
    before its bound."""
    d = daemon_factory()
    link = link_for(d.runtime_dir).start(wait_s=30)
    try:
        assert link.client() is not None
        assert link.guard("lookup", "miss", lambda c: c.lookup("t", [bytes(32)]).length) == 0
    finally:
        link.close()
    down = daemon_factory(start=False)
    t0 = time.monotonic()
    link = link_for(down.runtime_dir).start(wait_s=30)
    try:
        assert time.monotonic() - t0 < 30 and link.client() is None
        assert link.counters.snapshot()["connect_failures"] >= 1
    finally:
        link.close()


def test_a_first_connection_slower_than_the_wait_is_said_and_made_later(daemon_factory, redis_server):
    """A first connection that takes longer than `start(wait_s)`: here its manifest entry is
    written to a Redis that does not answer (SIGSTOP). start returns at its bound with no client
    and says so (the engine's first requests then recompute); the connection is made later."""
    d = daemon_factory()
    link = link_for(d.runtime_dir, call_timeout_s=30.0)
    link.register(ManifestEntry(namespace="0123456789abcdef0123456789abcdef", engine="test-engine",
                                engine_version="1.0", model="m", weights={}, page={"page_bytes": BLOCK_BYTES}))
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            link.start(wait_s=0.3)
            waited = time.monotonic() - t0
        assert link.client() is None and waited < 10
        slow = [x for x in logs if x["event"] == "kvtier.connect_slow"]
        assert len(slow) == 1 and slow[0]["log_level"] == "warning" and slow[0]["waited_s"] == 0.3
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    try:
        wait_until(link.client, timeout=30, message="the link connects once Redis answers")
    finally:
        link.close()


def test_a_call_in_flight_when_the_daemon_is_lost_ends_as_a_miss(daemon_factory):
    """The watcher drops the client of a dead daemon and closes it: calls still running on it are
    cancelled (once their copies have finished), so they end as misses instead of hanging."""
    import threading

    d = daemon_factory()
    link = link_for(d.runtime_dir).start(first=True)
    try:
        c = link.client()
        assert c is not None
        keys = [bytes(range(32))]
        outcome = []
        worker = threading.Thread(target=lambda: outcome.append(link.guard(
            "wait", "miss", lambda c: c.wait_resident("t", keys, timeout=60))))  # never resident
        worker.start()
        job = c.submit(lambda client: client.wait_resident("t", keys, timeout=60))
        d.kill()
        worker.join(20)
        assert not worker.is_alive() and outcome == ["miss"]
        with pytest.raises(concurrent.futures.CancelledError):
            job.result(20)
    finally:
        link.close()


def test_one_pool_check_in_the_engines_words(daemon_factory):
    d = daemon_factory()
    spec = PoolSpec("t", block_bytes=2 * BLOCK_BYTES, howto=lambda: "HOWTO",
                    bytes_msg="my pages are {want} bytes, pool {name!r} has {have}")
    with pytest.raises(PoolMismatch, match=r"my pages are 16384 bytes, pool 't' has 8192.*HOWTO"):
        link_for(d.runtime_dir, spec).start(first=True)
    with pytest.raises(PoolMismatch, match="'nope' is not served"):
        link_for(d.runtime_dir, PoolSpec("nope")).start(first=True)
    # Found by the link's thread (not at the first connection): the link stays down and says why,
    # once, and tries again only every mismatch_retry_s.
    with structlog.testing.capture_logs() as logs:
        link = link_for(d.runtime_dir, spec, mismatch_retry_s=0.2).start()
        try:
            wait_until(lambda: link.mismatch, timeout=5, message="the mismatch found")
            assert link.client() is None and link.counters.snapshot()["pool_mismatches"] == 1
            # The engine's blocks change (a worker registers its pages): the next try connects.
            link.spec = PoolSpec("t", block_bytes=BLOCK_BYTES)
            wait_until(link.client, timeout=5, message="a pool that fits")
        finally:
            link.close()
        # Connected by name, then told the engine's blocks (vLLM's worker registers its pages after
        # the link is up): a pool that does not fit is dropped before the setter returns, so no
        # call in between can use it.
        link = link_for(d.runtime_dir, PoolSpec("t")).start(first=True)
        try:
            assert link.client() is not None
            link.spec = spec
            assert link.client() is None and "my pages are 16384 bytes" in link.mismatch
        finally:
            link.close()
    assert [x["event"] for x in logs if x["event"].endswith("pool_mismatch")] == ["kvtier.pool_mismatch"] * 2


def test_the_guard_turns_every_failure_into_a_miss_a_counter_and_a_throttled_line(daemon_factory):
    d = daemon_factory()
    link = link_for(d.runtime_dir).start(first=True)
    try:
        assert link.client() is not None

        def fail(error: BaseException):
            def fn(c: SyncClient):
                raise error
            return fn

        with structlog.testing.capture_logs() as logs:
            for _ in range(5):
                assert link.guard("get", None, fail(CallTimeout("slow"))) is None
            assert link.guard("get", None, fail(RedisUnavailable("down"))) is None
            assert link.guard("get", None, fail(RuntimeError("a bug"))) is None
        c = link.counters.snapshot()
        assert (c["timeouts"], c["redis_errors"], c["errors"]) == (5, 1, 1)
        failed = [x["kind"] for x in logs if x["event"] == "kvtier.call_failed"]
        assert failed == ["timeouts", "redis_errors", "errors"], "one line per kind, not per call"
    finally:
        link.close()


def test_put_with_waits_for_staging_room_within_its_deadline(daemon_factory):
    d = daemon_factory(gpu=0, cpu=64)
    link = link_for(d.runtime_dir, staging_blocks=4).start(first=True)  # 12 blocks through 4 staging slots
    kv = make_kv(12, seed=7)
    rows = kv.view(torch.uint8).reshape(12, -1).numpy()
    try:
        c = link.client()
        keys = c.block_keys("t", list(range(16 * 12)))
        at_once = c.put_with("t", keys, lambda i, dst: np.copyto(dst, rows[i]))
        assert (at_once.staged, at_once.reason) == (4, DropReason.STAGING_FULL)
        more = c.block_keys("t", list(range(10**5, 10**5 + 16 * 12)))
        assert link.put_with(c, more, lambda i, dst: np.copyto(dst, rows[i]), parent=None, wait_s=10.0) == 12
        assert c.wait_resident("t", more, timeout=10)
        out = torch.empty((12, *SHAPE), dtype=torch.float16)
        assert c.get("t", more, out) == 12 and same_bytes(out, kv)
    finally:
        link.close()


def test_the_client_contract_errors_timeouts_and_submit(daemon_factory, redis_server):
    d = daemon_factory()
    with SyncClient(d.runtime_dir, timeout=5.0) as c:
        keys = c.block_keys("t", list(range(16 * 3)))
        fut = c.submit(lambda client: client.put("t", keys, make_kv(3, seed=1)))
        assert isinstance(fut, concurrent.futures.Future) and fut.result(10).staged == 3
        # Keys never put: locate must ask Redis, and the call's own timeout ends it there (the
        # keys just put may already be resident, and a locate that finds them all here returns
        # without waiting on anything a timeout could cut).
        with pytest.raises(CallTimeout) as e:
            c.locate("t", c.block_keys("t", list(range(900, 948))), timeout=1e-6)
        assert isinstance(e.value, KvtierError) and isinstance(e.value, TimeoutError)
        redis_server.stop()
        for call in (lambda: c.prefetch("t", keys), lambda: c.where("t", keys), lambda: c.epoch("t", "x")):
            with pytest.raises(RedisUnavailable):
                call()
        gone = c.put("t", c.block_keys("t", list(range(500, 548))), make_kv(3, seed=2))
        assert (gone.staged, gone.dropped, gone.reason) == (0, 3, DropReason.BUS_UNREACHABLE)
        d.kill()
        dead = c.put("t", c.block_keys("t", list(range(600, 648))), make_kv(3, seed=3))
        assert (dead.staged, dead.dropped, dead.reason) == (0, 3, DropReason.DAEMON_GONE)


def test_a_descriptor_of_another_release_is_one_clear_error(daemon_factory):
    """The descriptor is one typed, versioned record (kvtier/descriptor.py): a client of another
    kvtier release than its daemon is told so, rather than failing on a missing key later."""
    import json

    from kvtier.descriptor import DescriptorError
    from kvtier.runtime import DESCRIPTOR, write_json_atomic

    d = daemon_factory()
    path = d.runtime_dir / DESCRIPTOR
    good = json.loads(path.read_text())
    write_json_atomic(path, {**good, "version": good["version"] + 1})
    with pytest.raises(DescriptorError, match="different kvtier releases") as e:
        SyncClient(d.runtime_dir)
    assert isinstance(e.value, KvtierError)
    write_json_atomic(path, good)
    with SyncClient(d.runtime_dir) as c:
        assert c.node == good["node"] and c.prefix_index is False


@pytest.mark.parametrize("puts", [True, False], ids=["saves", "loads-only"])
def test_a_link_that_saves_asks_for_grants_as_it_connects(daemon_factory, puts):
    """An engine that saves (the link's `puts`, a producer's vLLM worker) is granted cpu slots as
    it connects (Client.prepare_puts), so its first save is one pass; one that only loads makes
    no staging segment and holds no grants, which would sit idle in the arena."""
    d = daemon_factory(cpu=256)
    link = link_for(d.runtime_dir, puts=puts).start(wait_s=30)
    try:
        c = link.client()
        assert c is not None
        pool = c.pool("t")
        if puts:
            wait_until(lambda: pool.staging is not None and pool.staging.grants_waiting() > 0, timeout=10,
                       message="the daemon granted the saving link's segment slots")
        else:
            assert pool.staging is None, "a loading link makes no staging segment"
        assert link.counters.snapshot()["errors"] == 0
    finally:
        link.close()
