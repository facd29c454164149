"""The composition root: build every component from the config, serve until told to stop, tear down.

The lifecycle reads like uvicorn's: `startup()` acquires the resources in order (node lock,
Redis, segments, metrics, descriptor, chores) and registers each one's teardown on an
AsyncExitStack the moment it is acquired; `serve()` runs the consumers (tasks of its TaskGroup)
until the stop event, then lets in-flight work finish within the grace period; `shutdown()`
unwinds the stack, so teardown is the exact reverse of acquisition, and a startup that fails
halfway releases just what it had acquired. `run()` is the three in a row. The chores are tasks
of a second TaskGroup, which startup() opens and shutdown() closes, since they must run through
serve()'s drain (daemon/chores.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import structlog

from kvtier.bus.connect import AsyncRedis, check_reachable, is_cluster, make_blocks_redis, make_redis, resolve_url
from kvtier.bus.consumer import Consumer
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.publisher import BusStats, Publisher
from kvtier.bus.streams import StreamNames
from kvtier.config import Config, redact_url
from kvtier.core.events import Tier
from kvtier.daemon.caches import daemon_caches
from kvtier.daemon.chores import Chores, bounded
from kvtier.daemon.coordinator import Coordinator
from kvtier.daemon.disk_adoption import DiskAdoption
from kvtier.daemon.embedded_redis import EmbeddedRedis
from kvtier.daemon.engine_ingest import EngineIngest, parse_engines
from kvtier.daemon.kv_event_publisher import KvEventPublisher, RouterEvents
from kvtier.daemon.looplag import LoopLag
from kvtier.daemon.manifest_reader import ManifestReader
from kvtier.daemon.metrics import MetricsServer
from kvtier.daemon.node import descriptor, ensure_runtime_dir, node_lock, runtime_dir_lock, shm_gid
from kvtier.daemon.pools import close_pool, open_pool
from kvtier.daemon.population import Activity, ArenaPopulation
from kvtier.daemon.prefix_index import PrefixIndexWriter
from kvtier.daemon.resync import resync_loop
from kvtier.daemon.sampler import sample_streams
from kvtier.daemon.sdnotify import Notifier
from kvtier.daemon.snapshot import expire_pins, pool_snapshot
from kvtier.descriptor import Descriptor, RedisEndpoints, Streams
from kvtier.errors import KvtierError
from kvtier.failpoints import Failpoints
from kvtier.offload import default_copy_threads
from kvtier.runtime import STATS, write_json_atomic
from kvtier.shm.staging_files import StagingSegments
from kvtier.tiers.granted_puts import GrantedPuts
from kvtier.tiers.grants import GrantBook
from kvtier.tiers.pool import PoolRuntime
from kvtier.tiers.worker import TierWorker

GROUP = "kvtier"
T = TypeVar("T")
REAP_INTERVAL_S = 5.0


class Daemon:
    def __init__(self, cfg: Config, environ: Mapping[str, str], log: Any = None) -> None:
        self.cfg = cfg
        self.environ = environ
        self.log = (log or structlog.get_logger("kvtier")).bind(node=cfg.node.id)
        self.notifier = Notifier(environ)
        self.names = StreamNames(cfg.node.id)
        self.runtime_dir = cfg.node.runtime_dir
        self.epoch = time.time_ns()
        self.failpoints = Failpoints(cfg.daemon.failpoint)
        self.loop_lag = LoopLag()
        self.stream_info: dict[str, dict[str, Any]] = {}
        self.metrics: MetricsServer | None = None
        if cfg.daemon.failpoint:
            self.log.warning("daemon.failpoint_armed", failpoint=cfg.daemon.failpoint)
        self.started = time.monotonic()
        self.ready_s: float | None = None  # start to READY=1
        self.bus_stats = BusStats()
        self.pools: dict[str, PoolRuntime] = {}
        self.consumers: list[Consumer] = []
        self.handlers: dict[str, Coordinator | TierWorker] = {}  # by role, in the order of their consumers
        self.embedded: EmbeddedRedis | None = None
        self.ready = asyncio.Event()  # set once serving (READY=1 sent)
        self._stack = contextlib.AsyncExitStack()
        self.router_events: RouterEvents | None = None  # [events] enabled: KV events for routers
        self.prefix_index: PrefixIndexWriter | None = None  # [prefix_index] enabled
        self.ingest: EngineIngest | None = None  # [ingest] engines
        self.manifests: ManifestReader | None = None  # which models' KV the pools hold (status)
        self.populations: dict[str, ArenaPopulation] = {}  # arenas still populating after READY

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` is set, stop. What cli.py runs."""
        await self.startup()
        try:
            await self.serve(stop)
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        """Acquire everything in order; on failure, release what was acquired and re-raise."""
        cfg = self.cfg
        async with contextlib.AsyncExitStack() as stack:
            stack.enter_context(node_lock(cfg.node.id))
            stack.callback(self.log.info, "daemon.stopped")  # the last line of any teardown
            ensure_runtime_dir(self.runtime_dir)
            stack.enter_context(runtime_dir_lock(self.runtime_dir, cfg.node.id))
            gid = shm_gid(cfg.node.shm_group)
            url = cfg.redis.url
            if not url:
                self.embedded = EmbeddedRedis(cfg.embedded_redis, self.runtime_dir, self.log)
                stack.push_async_callback(self.embedded.stop)  # before start: a half-started server too
                url = await self.embedded.start()
            url_key = "[redis] url" if cfg.redis.url else "the embedded redis-server"
            url = await self._reach(url_key, url, self._resolve(url))
            bus_key = "[redis] bus_url" if cfg.redis.bus_url else url_key
            bus_url = await self._reach(bus_key, cfg.redis.bus_url, self._resolve(cfg.redis.bus_url)) \
                if cfg.redis.bus_url else url
            bus = self._client(stack, bus_url, make_redis)
            # A cluster's block I/O gets its own client (bus/connect.py: no cluster-level retry).
            blocks = bus if bus_url == url and not is_cluster(bus) else self._client(stack, url, make_blocks_redis)
            await self._reach(bus_key, bus_url, check_reachable(bus))
            if blocks is not bus:
                await self._reach(url_key, url, check_reachable(blocks))
            staging = StagingSegments(cfg.node.id, self.log)
            stack.callback(staging.close)
            for p in cfg.pools:  # one at a time, so a failure still closes the ones opened
                rt = self.pools[p.name] = open_pool(p, cfg.node.id, cfg.policy, blocks, cfg.redis, gid, self.log,
                                                    cfg.arena, cfg.disk, cfg.pins, cfg.tenants)
                stack.callback(close_pool, rt, cfg.daemon.persist_arena)
            if cfg.events.enabled:  # before the consumers: no fact may go unannounced
                kv = KvEventPublisher(cfg.events, self.log)
                stack.callback(kv.close)
                kv.start()
                self.router_events = RouterEvents(kv, self.pools, cfg.node.id, cfg.events.topic)
                self.router_events.announce_start()
            if cfg.prefix_index.enabled:
                self.prefix_index = PrefixIndexWriter(blocks, cfg.node.id, self.pools, cfg.prefix_index, self.log)
                self.prefix_index.refresh()  # what a warm restart kept, listed again at once
                if cfg.ingest.engines.strip():
                    if cfg.ingest.pool not in self.pools:
                        raise KvtierError(f"[ingest] pool {cfg.ingest.pool!r} is not one of this daemon's pools "
                                         f"({', '.join(sorted(self.pools))})")
                    self.ingest = EngineIngest(parse_engines(cfg.ingest.engines), cfg.node.id,
                                               self.pools[cfg.ingest.pool], cfg.prefix_index.ttl_s,
                                               self.prefix_index.enqueue, asyncio.get_running_loop(), self.log)
                    stack.callback(self.ingest.close)
                    self.ingest.start()
            self._build_consumers(bus, staging)
            if cfg.metrics.listen:
                try:
                    self.metrics = metrics = MetricsServer(cfg.metrics.listen, self.snapshot)
                except OSError as e:
                    raise KvtierError(f"[metrics] listen = {cfg.metrics.listen!r}: cannot serve there: {e}") from None
                stack.push_async_callback(lambda: bounded(self.log, "metrics", asyncio.to_thread(metrics.close)))
                self.log.info("daemon.metrics", url=metrics.url)
            stack.enter_context(descriptor(self.runtime_dir, self._descriptor(url, bus_url, gid).to_json()))
            stack.callback(self._write_stats)  # the final stats, once the chores have stopped
            stack.callback(lambda: staging.reap(self._client_drops))  # ... with the clients' last drops
            # The chores' TaskGroup lives until shutdown(): past serve()'s drain (daemon/chores.py).
            chores = await stack.enter_async_context(Chores(self.log))
            self._start_chores(chores, bus, staging)
            self._stack = stack.pop_all()

    async def serve(self, stop: asyncio.Event) -> None:
        """Run the consumers until `stop`; then let in-flight work finish within the grace period."""
        grace = self.cfg.daemon.shutdown_grace_s
        async with asyncio.TaskGroup() as tg:
            work = [tg.create_task(c.run(), name=f"consumer-{i}") for i, c in enumerate(self.consumers)]
            watch = [tg.create_task(self._watch_embedded(self.embedded))] if self.embedded is not None else []
            self.ready_s = round(time.monotonic() - self.started, 3)
            # The line first: whoever hears READY=1 may read the log for it at once.
            self.log.info("daemon.ready", pools=sorted(self.pools), pid=os.getpid(), ready_s=self.ready_s,
                          populating=sorted(self.populations))
            self.notifier.notify("READY=1", f"STATUS=serving {len(self.pools)} pool(s)", f"MAINPID={os.getpid()}")
            self.ready.set()
            await stop.wait()
            self.notifier.notify("STOPPING=1")
            self.log.info("daemon.stopping", grace_s=grace)
            await self._drain(work, grace)
            for t in [t for t in work if not t.done()]:
                t.cancel(msg="shutdown grace period expired")
            for t in watch:
                t.cancel(msg="daemon stopping")

    async def _drain(self, work: list[asyncio.Task[None]], grace: float) -> None:
        """Within `grace`: the coordinator handles what clients sent before the stop (their puts
        become store commands), then the tier workers carry out every command sent so far, so
        that a block a client was told is staged is stored before the daemon exits. What clients
        send after the stop began is left in the streams for the next start."""
        deadline = time.monotonic() + grace
        coordinator, workers = self.consumers[0], self.consumers[1:]
        coordinator.drain()
        await asyncio.wait(work[:1], timeout=grace)
        for c in workers:
            c.drain()
        left = [t for t in work if not t.done()]
        if left:
            await asyncio.wait(left, timeout=max(0.0, deadline - time.monotonic()))
        if any(not t.done() for t in work):
            self.log.warning("daemon.drain_incomplete", grace_s=grace,
                             note="work still queued at the end of the grace period is redone by the next start")

    async def shutdown(self) -> None:
        """Release everything startup() acquired, in reverse order. Idempotent."""
        await self._stack.aclose()

    # --- pieces of startup ------------------------------------------------------------------

    def _client(self, stack: contextlib.AsyncExitStack, url: str, make: Callable[..., AsyncRedis]) -> AsyncRedis:
        r = self.cfg.redis
        client = make(url, socket_timeout=r.socket_timeout_s, connect_timeout=r.connect_timeout_s, retries=r.retries)
        stack.push_async_callback(lambda: bounded(self.log, "redis", client.aclose()))
        return client

    async def _reach(self, setting: str, url: str, ask: Awaitable[T]) -> T:
        """`ask` Redis at `url`; a Redis that cannot be reached or refuses us is an expected start
        error, which names the setting (one log line, no traceback: cli.py)."""
        try:
            return await ask
        except (*REDIS_ERRORS, OSError) as e:
            raise KvtierError(f"cannot use Redis at {setting} = {redact_url(url)!r}: {type(e).__name__}: {e}") from None

    async def _resolve(self, url: str) -> str:
        """A redis:// URL naming a cluster node becomes the cluster's URL (bus/connect.py)."""
        r = self.cfg.redis
        resolved = await resolve_url(url, socket_timeout=r.socket_timeout_s, connect_timeout=r.connect_timeout_s)
        if resolved != url:
            self.log.info("redis.cluster_detected", url=redact_url(url), using=redact_url(resolved))
        return resolved

    def _build_consumers(self, bus: AsyncRedis, staging: StagingSegments) -> None:
        cfg = self.cfg
        publisher = self.publisher = Publisher(bus, f"{cfg.node.id}/daemon", self.epoch, cfg.bus.stream_maxlen,
                                               self.bus_stats)
        router, index = self.router_events, self.prefix_index
        sinks = [s for s in (router.emit if router else None, index.on_facts if index else None) if s is not None]

        def on_facts(pool: str, facts: list[Any]) -> None:
            for sink in sinks:
                sink(pool, facts)

        grants = self.grants = GrantBook(self.pools, staging, cfg.daemon.grant_blocks, self.log, cfg.daemon.grant_bytes)
        grants.renew(sorted(staging.present()))  # before serving: clients drop an earlier daemon's grants
        no_disk = all(rt.disk is None for rt in self.pools.values())  # then no command goes to a disk worker
        workers = {t: TierWorker(
            t, self.pools, staging, publisher, self.names.facts, self.log,
            off_loop_bytes=0 if t == Tier.DISK else cfg.daemon.off_loop_copy_bytes,
            copy_threads=cfg.daemon.copy_threads or default_copy_threads(),
            flush_bytes=cfg.redis.pipeline_bytes * cfg.redis.connections, failpoints=self.failpoints, grants=grants)
            for t in Tier if not (t == Tier.DISK and no_disk)}
        cpu = workers[Tier.CPU]  # its fence and queue: a put's granted blocks are adopted by the coordinator
        adopter = GrantedPuts(grants, cpu.fence, cpu.queued, publisher.stamp, self.log.bind(worker="coordinator"))
        coordinator = Coordinator(self.pools, staging, publisher, self.names, self.log, on_facts if sinks else None,
                                  router.note_tokens if router is not None else None, grants, adopter)
        self.consumers = [self._consumer(bus, [self.names.client, self.names.facts], "coordinator", coordinator),
                          *(self._consumer(bus, [self.names.tier(t)], t.label, w) for t, w in workers.items())]

    def _consumer(self, bus: AsyncRedis, streams: list[str], role: str, handler: Coordinator | TierWorker) -> Consumer:
        self.handlers[role] = handler
        b = self.cfg.bus
        return Consumer(
            bus, streams, GROUP, f"{self.cfg.node.id}-{role}", handler.handle,
            dlq=self.names.dlq, read_count=b.read_count, block_ms=b.block_ms, claim_idle_ms=b.claim_idle_ms,
            max_deliveries=b.max_deliveries, publisher_maxlen=b.stream_maxlen, stats=self.bus_stats,
            log=self.log.bind(worker=role), after_batch=handler.flush, failpoints=self.failpoints,
        )

    def _start_chores(self, chores: Chores, bus: AsyncRedis, staging: StagingSegments) -> None:
        for name, rt in self.pools.items():
            if rt.arena is not None and rt.arena.chunks:  # the rest of a big arena, after READY
                pop = self.populations[name] = ArenaPopulation(
                    rt, self.cfg.arena, self.log, lambda pool, entries: self._restored(pool, Tier.CPU, entries),
                    Activity(lambda: self.bus_stats.delivered))
                chores.start(f"arena-{name}", pop.run())
            if rt.disk is not None and rt.disk.adopting:  # what the block file held, after READY
                chores.start(f"disk-{name}", DiskAdoption(rt, self.log, self._restored).run())
        chores.every("stats", self.cfg.daemon.stats_interval_s, self._write_stats)
        self.manifests = ManifestReader(bus, self.pools, self.cfg.daemon.manifest_interval_s, self.log)
        chores.start("manifest", self.manifests.run())
        chores.every("reaper", REAP_INTERVAL_S, lambda: (staging.reap(self._client_drops, self.grants.forget),
                                                          self.grants.expire()))
        chores.start("loop-lag", self.loop_lag.run())
        if self.prefix_index is not None:
            chores.start("prefix-index", self.prefix_index.run())
            chores.every("prefix-index-refresh", self.cfg.prefix_index.refresh_s, self.prefix_index.refresh)
        if self.ingest is not None:
            chores.every("engine-index-refresh", self.cfg.prefix_index.refresh_s, self.ingest.request_refresh)
        sampler = sample_streams(bus, self.names.grouped(), GROUP, self.stream_info, self.cfg.metrics.stream_sample_s,
                                 self.cfg.bus.stream_keep_s, self.log)
        chores.start("stream-sampler", sampler)
        if self.cfg.redis.resync_keys:
            chores.start("redis-resync", resync_loop(self.pools, self.publisher, self.names.tier(Tier.REDIS),
                                                     self.cfg.redis.resync_interval_s, self.cfg.redis.resync_keys,
                                                     self.log))
        if self.notifier.watchdog_s:
            interval = self.notifier.watchdog_s * self.cfg.daemon.watchdog_fraction
            chores.every("watchdog", interval, lambda: self.notifier.notify("WATCHDOG=1"))

    def _restored(self, pool: str, tier: Tier, entries: list[Any]) -> None:
        """Blocks a warm arena or a disk tier's file kept, restored as the population or the
        adoption reaches them: announced as the blocks kept at the start were."""
        if self.router_events is not None:
            self.router_events.announce(pool, tier, entries)
        if self.prefix_index is not None:
            self.prefix_index.add_blocks(pool, tier.label, [e.key for e in entries])

    def _descriptor(self, url: str, bus_url: str, gid: int | None) -> Descriptor:
        return Descriptor(
            node=self.cfg.node.id, pid=os.getpid(), epoch=self.epoch,
            redis=RedisEndpoints(url, bus_url, self.cfg.redis.pipeline_bytes, self.cfg.redis.connections),
            streams=Streams(self.names.client, self.names.facts, self.names.dlq), shm_gid=gid,
            prefix_index=self.cfg.prefix_index.enabled,  # whether this daemon writes `where`'s index
            pools={name: rt.descriptor() for name, rt in self.pools.items()})

    def _client_drops(self, fingerprint: bytes, blocks: int) -> None:
        """Blocks a client dropped before handing them over (its staging segment counts them)."""
        for rt in self.pools.values():
            if rt.layout.fingerprint == fingerprint:
                rt.counters.client_puts_dropped += blocks
                return

    async def _watch_embedded(self, embedded: EmbeddedRedis) -> None:
        raise RuntimeError(f"embedded redis-server exited with code {await embedded.wait()}")

    # --- what stats.json and the metrics endpoint show -------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "node": self.cfg.node.id, "pid": os.getpid(), "epoch": self.epoch,
            "uptime_s": round(time.monotonic() - self.started, 3), "ready_s": self.ready_s,
            "written_at": time.time(), "stats_interval_s": self.cfg.daemon.stats_interval_s,
            "bus": self.bus_stats.as_dict(), "loop": self.loop_lag.as_dict(),
            "caches": daemon_caches(self.handlers, self.consumers),
            "pools": {name: {**pool_snapshot(rt), "models": self.manifests and self.manifests.snapshot(name)}
                      for name, rt in self.pools.items()},
            "streams": dict(self.stream_info),
            "metrics_url": self.metrics.url if self.metrics is not None else None,
            "kv_events": self.router_events.stats() if self.router_events is not None else None,
            "prefix_index": self.prefix_index.stats() if self.prefix_index is not None else None,
            "ingest": self.ingest.stats() if self.ingest is not None else None,
        }

    def _write_stats(self) -> None:
        self.failpoints.reached("block_loop")
        expire_pins(self.pools.values(), time.monotonic())  # on time, even with no event to decide on
        write_json_atomic(self.runtime_dir / STATS, self.snapshot())
