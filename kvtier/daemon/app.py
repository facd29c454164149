"""The composition root: build every component from the config, run them in one TaskGroup, stop cleanly.

Reads top to bottom: start (runtime dir, Redis, pools, workers), serve (READY, watchdog, stats),
stop (STOPPING, stop intake, let in-flight work finish within the grace period, tear down).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import redis.exceptions
import structlog

from kvtier.bus.connect import make_redis
from kvtier.core.events import Tier
from kvtier.bus.streams import StreamNames
from kvtier.bus.transport import BusStats, Consumer, Publisher
from kvtier.config import Config
from kvtier.daemon.coordinator import Coordinator
from kvtier.runtime import DESCRIPTOR, FORMAT_VERSION, STATS, write_json_atomic
from kvtier.daemon.embedded_redis import EmbeddedRedis
from kvtier.daemon.looplag import LoopLag
from kvtier.daemon.metrics import MetricsServer
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.daemon.sdnotify import Notifier
from kvtier.shm.staging import StagingSegments
from kvtier.errors import KvtierError
from kvtier.failpoints import Failpoints
from kvtier.offload import default_copy_threads
from kvtier.tiers.pool import PoolRuntime
from kvtier.tiers.worker import TierWorker

GROUP = "kvtier"
CHORE_STOP_S = 1.0  # how long the chores get to wind down at the stop
REAP_INTERVAL_S = 5.0


def _ensure_runtime_dir(path: Path) -> None:
    path.mkdir(mode=0o750, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.geteuid():
        # Someone else made it (e.g. pre-created /tmp/kvtier-<uid>): clients would trust it.
        raise KvtierError(f"runtime directory {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
    if st.st_mode & 0o027:
        path.chmod(0o750)  # never writable by the group or open to others


@contextlib.contextmanager
def node_lock(node: str):
    """One live daemon per node id: its segments' names carry the id, so a second daemon would
    replace the first one's segments under its clients. An abstract unix socket is the lock:
    the kernel releases it when we die, and it leaves no file behind in /dev/shm."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.bind(f"\0kvtier.{node}.lock")
        except OSError:
            raise KvtierError(f"another kvtier daemon is running with node id {node!r}") from None
        yield
    finally:
        sock.close()


def pool_snapshot(rt: PoolRuntime) -> dict:
    tiers = {}
    for t in Tier:
        idx = rt.placement.tiers[t]
        c = rt.counters.tiers[t.label]
        # Redis: blocks this daemon wrote and has not deleted (TTL expiry and other nodes'
        # writes are not seen); local tiers: blocks resident now.
        blocks = max(0, c.stored + c.demoted_in + c.copied_in - c.evicted) if t == Tier.REDIS else idx.used
        tiers[t.label] = {
            "blocks": blocks,
            "capacity": idx.capacity,
            "bytes": blocks * rt.layout.block_bytes,
            "capacity_bytes": None if idx.capacity is None else idx.capacity * rt.layout.block_bytes,
            "incoming": rt.placement.incoming(t) if t != Tier.REDIS else 0,
            **{k: getattr(c, k) for k in c.__slots__},
        }
    return {
        "block_bytes": rt.layout.block_bytes,
        "puts": rt.counters.puts,
        "puts_dropped": rt.counters.puts_dropped,
        "hits": rt.counters.hits,
        "misses": rt.counters.misses,
        "redis_corrupt": rt.redis.stats.corrupt,
        "redis_errors": rt.redis.stats.errors,
        "tiers": tiers,
    }


class Daemon:
    def __init__(self, cfg: Config, environ: Mapping[str, str], log=None) -> None:
        self.cfg = cfg
        self.environ = environ
        self.log = (log or structlog.get_logger("kvtier")).bind(node=cfg.node.id)
        self.notifier = Notifier(environ)
        self.names = StreamNames(cfg.node.id)
        self.runtime_dir = cfg.node.runtime_dir
        self.epoch = time.time_ns()
        self.failpoints = Failpoints(cfg.daemon.failpoint)
        self.loop_lag = LoopLag()
        self.stream_info: dict[str, dict] = {}
        self.metrics: MetricsServer | None = None
        if cfg.daemon.failpoint:
            self.log.warning("daemon.failpoint_armed", failpoint=cfg.daemon.failpoint)
        self.started = time.monotonic()
        self.bus_stats = BusStats()
        self.pools: dict[str, PoolRuntime] = {}
        self.consumers: list[Consumer] = []

    async def run(self, stop: asyncio.Event) -> None:
        with node_lock(self.cfg.node.id):
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        _ensure_runtime_dir(self.runtime_dir)
        try:
            gid = grp.getgrnam(cfg.node.shm_group).gr_gid if cfg.node.shm_group else None
        except KeyError:
            raise KvtierError(f"node.shm_group: no group named {cfg.node.shm_group!r}") from None
        embedded = None
        clients = []
        staging = StagingSegments(cfg.node.id, self.log)
        try:
            url = cfg.redis.url
            if not url:
                embedded = EmbeddedRedis(cfg.embedded_redis, self.runtime_dir, self.log)
                url = await embedded.start()
            bus_url = cfg.redis.bus_url or url
            opts = dict(socket_timeout=cfg.redis.socket_timeout_s, connect_timeout=cfg.redis.connect_timeout_s,
                        retries=cfg.redis.retries)
            bus = make_redis(bus_url, **opts)
            blocks = bus if bus_url == url else make_redis(url, **opts)
            clients = [bus] if blocks is bus else [bus, blocks]
            for c in clients:
                await c.ping()
            for p in cfg.pools:  # one at a time, so a failure still closes the ones opened
                self.pools[p.name] = open_pool(p, cfg.node.id, cfg.policy, blocks, cfg.redis.block_ttl_s, gid,
                                               self.log)
            publisher = Publisher(bus, f"{cfg.node.id}/daemon", self.epoch, cfg.bus.stream_maxlen, self.bus_stats)
            coordinator = Coordinator(self.pools, staging, publisher, self.names, self.log)
            self.consumers = [self._consumer(bus, [self.names.client, self.names.facts], "coordinator",
                                             coordinator.handle, coordinator.flush)]
            for t in Tier:
                worker = TierWorker(t, self.pools, staging, publisher, self.names.facts, self.log,
                                    off_loop_bytes=cfg.daemon.off_loop_copy_bytes,
                                    copy_threads=cfg.daemon.copy_threads or default_copy_threads(),
                                    pipeline_bytes=cfg.redis.pipeline_bytes, failpoints=self.failpoints)
                self.consumers.append(self._consumer(bus, [self.names.tier(t)], t.label, worker.handle,
                                                     worker.flush))
            if cfg.metrics.listen:
                self.metrics = MetricsServer(cfg.metrics.listen, self.snapshot)
                self.log.info("daemon.metrics", url=self.metrics.url)
            self._write_descriptor(url, bus_url, gid)
            await self._serve(stop, embedded, staging, bus)
        finally:
            if self.metrics is not None:
                await self._bounded("metrics", asyncio.to_thread(self.metrics.close))
            (self.runtime_dir / DESCRIPTOR).unlink(missing_ok=True)
            for rt in self.pools.values():
                close_pool(rt, cfg.daemon.persist_arena)
            staging.close()
            for c in clients:
                await self._bounded("redis", c.aclose())
            if embedded is not None:
                await embedded.stop()
            self.log.info("daemon.stopped")

    def _consumer(self, bus, streams: list[str], role: str, handler, after_batch) -> Consumer:
        b = self.cfg.bus
        return Consumer(
            bus, streams, GROUP, f"{self.cfg.node.id}-{role}", handler,
            dlq=self.names.dlq, read_count=b.read_count, block_ms=b.block_ms, claim_idle_ms=b.claim_idle_ms,
            max_deliveries=b.max_deliveries, publisher_maxlen=b.stream_maxlen, stats=self.bus_stats,
            log=self.log.bind(worker=role), after_batch=after_batch, failpoints=self.failpoints,
        )

    async def _serve(self, stop: asyncio.Event, embedded: EmbeddedRedis | None, staging: StagingSegments,
                     bus) -> None:
        grace = self.cfg.daemon.shutdown_grace_s
        # Chores (stats, reaper, lag sampler, stream sampler, watchdog) run beside the TaskGroup:
        # they never end the daemon, and at the stop they get a bounded time to wind down, so
        # one stuck in a Redis call cannot hold the stop up.
        chores = [
            asyncio.create_task(self._every(self.cfg.daemon.stats_interval_s, self._write_stats), name="stats"),
            asyncio.create_task(self._every(REAP_INTERVAL_S, staging.reap), name="reaper"),
            asyncio.create_task(self.loop_lag.run(), name="loop-lag"),
            asyncio.create_task(self._sample_streams(bus), name="stream-sampler"),
        ]
        if self.notifier.watchdog_s:
            interval = self.notifier.watchdog_s * self.cfg.daemon.watchdog_fraction
            chores.append(asyncio.create_task(self._every(interval, lambda: self.notifier.notify("WATCHDOG=1")),
                                              name="watchdog"))
        try:
            await self._serve_work(stop, embedded, grace)
        finally:
            for t in chores:
                t.cancel(msg="daemon stopping")
            _done, stuck = await asyncio.wait(chores, timeout=CHORE_STOP_S)
            if stuck:
                self.log.warning("daemon.chores_stuck", chores=sorted(t.get_name() for t in stuck))
            self._write_stats()

    async def _serve_work(self, stop: asyncio.Event, embedded: EmbeddedRedis | None, grace: float) -> None:
        async with asyncio.TaskGroup() as tg:
            work = [tg.create_task(c.run(), name=f"consumer-{i}") for i, c in enumerate(self.consumers)]
            watch = [tg.create_task(self._watch_embedded(embedded))] if embedded is not None else []
            self.notifier.notify("READY=1", f"STATUS=serving {len(self.pools)} pool(s)", f"MAINPID={os.getpid()}")
            self.log.info("daemon.ready", pools=sorted(self.pools), pid=os.getpid())
            await stop.wait()
            self.notifier.notify("STOPPING=1")
            self.log.info("daemon.stopping", grace_s=grace)
            for c in self.consumers:
                c.stop()  # finish and ack the batch in hand, take no more
            _done, pending = await asyncio.wait(work, timeout=grace)
            for t in pending:
                t.cancel(msg="shutdown grace period expired")
            for t in watch:
                t.cancel(msg="daemon stopping")

    async def _bounded(self, what: str, aw, timeout: float = 2.0) -> None:
        """A teardown step that may not hold the stop up for long."""
        try:
            await asyncio.wait_for(aw, timeout)
        except (TimeoutError, Exception) as e:
            self.log.warning("daemon.teardown_step_failed", step=what, error=f"{type(e).__name__}: {e}")

    async def _every(self, interval: float, fn) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                fn()
            except Exception:
                self.log.exception("daemon.chore_failed", chore=getattr(fn, "__name__", repr(fn)))

    async def _watch_embedded(self, embedded: EmbeddedRedis) -> None:
        code = await embedded.wait()
        raise RuntimeError(f"embedded redis-server exited with code {code}")

    def _write_descriptor(self, url: str, bus_url: str, gid: int | None) -> None:
        desc = {
            "version": FORMAT_VERSION,
            "node": self.cfg.node.id,
            "pid": os.getpid(),
            "epoch": self.epoch,
            "redis": {"url": url, "bus_url": bus_url},
            "streams": {"client": self.names.client, "facts": self.names.facts, "dlq": self.names.dlq},
            "shm_gid": gid,
            "pools": {name: rt.descriptor() for name, rt in self.pools.items()},
        }
        write_json_atomic(self.runtime_dir / DESCRIPTOR, desc)

    async def _sample_streams(self, bus) -> None:
        """Every `metrics.stream_sample_s`: each stream's pending entries and lag for our group."""
        names = [self.names.client, self.names.facts, *(self.names.tier(t) for t in Tier)]
        while True:
            try:
                async with bus.pipeline(transaction=False) as pipe:
                    for n in names:
                        pipe.xinfo_groups(n)
                    replies = await pipe.execute(raise_on_error=False)
                for n, groups in zip(names, replies):
                    g = next((g for g in groups if g.get("name") in (GROUP, GROUP.encode())), None) \
                        if isinstance(groups, list) else None
                    if g is not None:
                        self.stream_info[n] = {"pending": g.get("pending", 0), "lag": g.get("lag")}
            except redis.exceptions.RedisError as e:
                self.log.debug("daemon.stream_sample_failed", error=str(e))
            await asyncio.sleep(self.cfg.metrics.stream_sample_s)

    def snapshot(self) -> dict:
        """What stats.json and the metrics endpoint show."""
        return {
            "node": self.cfg.node.id,
            "pid": os.getpid(),
            "epoch": self.epoch,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "written_at": time.time(),
            "bus": self.bus_stats.as_dict(),
            "loop": self.loop_lag.as_dict(),
            "pools": {name: pool_snapshot(rt) for name, rt in self.pools.items()},
            "streams": dict(self.stream_info),
            "metrics_url": self.metrics.url if self.metrics is not None else None,
        }

    def _write_stats(self) -> None:
        self.failpoints.reached("block_loop")
        write_json_atomic(self.runtime_dir / STATS, self.snapshot())
