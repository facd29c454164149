"""The config tree: one frozen dataclass per section, each field declared with its check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.config.fields import (
    NAME_PATTERN,
    NAME_WHAT,
    absolute_path,
    boolean,
    choice,
    eviction_policy,
    integer,
    number,
    redis_url,
    setting,
    size,
    string,
    table,
)
from kvtier.errors import KvtierError
from kvtier.failpoints import IO_SPEC
from kvtier.failpoints import SPEC as FAILPOINT
from kvtier.layout import DTYPE_BYTES

ENV_PREFIX = "KVTIER__"
_DEVICE = r"auto|cpu|cuda(:[0-9]+)?"


class ConfigError(KvtierError):
    """The configuration is invalid. `problems` holds one line per problem, key first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(self.problems)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    # id and runtime_dir have no static default: the loader derives them from the host.
    id: str = setting(string(NAME_PATTERN, NAME_WHAT, empty_ok=False), text=True)
    runtime_dir: Path = setting(absolute_path(), text=True)
    shm_group: str = setting(string(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}", "a group name"), "",
                             text=True)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = setting(choice("debug", "info", "warning", "error"), "info", text=True)
    format: str = setting(choice("auto", "json", "console"), "auto", text=True)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    # Any URL kvtier/redis_url.py accepts: one server, redis+cluster:// or redis+sentinel://.
    url: str = setting(redis_url(), "", text=True)
    bus_url: str = setting(redis_url(), "", text=True)
    socket_timeout_s: float = setting(number(gt=0), 5.0)
    connect_timeout_s: float = setting(number(gt=0), 2.0)
    retries: int = setting(integer(0), 3)
    block_ttl_s: int = setting(integer(0), 86400)
    # Block reads and writes go as pipelines of at most this many payload bytes each, up to
    # `connections` of them at once (shallow pipelines over a few connections move big values
    # fastest: docs/performance.md). A tier worker sends what it has queued once it fills every
    # connection once (pipeline_bytes x connections).
    pipeline_bytes: int = setting(size(), 8 << 20)
    connections: int = setting(integer(1, 64), 4)
    # Writes (demotes, copies, write-through) in deeper pipelines: against the best raw SETs the
    # 8 MiB shape read 0.73x (median of 9 rounds), 16 MiB 0.96x, while reads were fastest at 8 MiB
    # (docs/performance.md, "Sixteenth stop").
    write_pipeline_bytes: int = setting(size(), 16 << 20)
    # Re-replication (core/resync.py): every resync_interval_s, ask Redis about up to this many
    # local blocks per pool and write again the ones it lost. 0 turns the sweep off.
    resync_interval_s: float = setting(number(gt=0), 10.0)
    resync_keys: int = setting(integer(0), 1024)


@dataclass(frozen=True, slots=True)
class EmbeddedRedisConfig:
    binary: str = setting(string(empty_ok=False), "redis-server", text=True)
    maxmemory: str = setting(string(r"(?i)[0-9]+(b|k|kb|m|mb|g|gb)?", "a size like '256mb'",
                                    empty_ok=False), "256mb", text=True)
    maxmemory_policy: str = setting(eviction_policy(), "volatile-lru", text=True)


@dataclass(frozen=True, slots=True)
class BusConfig:
    stream_maxlen: int = setting(integer(1000), 100_000)
    # Entries every consumer group has read and acked are trimmed once this much older than the
    # newest entry handed out (bus/trim.py):
    # the streams are a queue, and full ones would crowd blocks out of a shared Redis.
    stream_keep_s: float = setting(number(ge=0), 10.0)
    claim_idle_ms: int = setting(integer(1), 30_000)
    max_deliveries: int = setting(integer(1), 5)
    read_count: int = setting(integer(1, 10_000), 256)
    block_ms: int = setting(integer(1, 60_000), 500)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    # The Prometheus endpoint, "host:port" ("" = off). Loopback by default: the numbers reveal
    # traffic patterns, and scraping is meant for the node's own agent. Port 0 picks a free one
    # (written to stats.json as metrics_url).
    listen: str = setting(string(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}", "host:port"),
                          "127.0.0.1:9464", text=True)
    # How often stream lag and pending counts are sampled from Redis.
    stream_sample_s: float = setting(number(gt=0), 5.0)


# A ZMQ endpoint on loopback or a unix (ipc) socket: the listeners never face the network.
_ZMQ_LOCAL = r"tcp://(127\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|localhost|\[::1\]):[0-9]{1,5}|ipc:///[^\s;]+"


@dataclass(frozen=True, slots=True)
class EventsConfig:
    # KV events for routers (llm-d, Dynamo), in vLLM's wire format (docs/integrations/events.md).
    enabled: bool = setting(boolean(), False)
    # PUB socket the events go out on, and the ROUTER socket that replays missed ones ("" = off).
    endpoint: str = setting(string(_ZMQ_LOCAL, "tcp://127.0.0.1:<port> or ipc:///<path>", empty_ok=False),
                            "tcp://127.0.0.1:5557", text=True)
    replay_endpoint: str = setting(string(_ZMQ_LOCAL, "tcp://127.0.0.1:<port> or ipc:///<path>"),
                                   "tcp://127.0.0.1:5558", text=True)
    # {node} and {model} are filled in per pool: llm-d's form by default.
    topic: str = setting(string(r"[^\s]*", "a topic (no spaces)"), "kv@{node}@{model}", text=True)
    hwm: int = setting(integer(1, 10_000_000), 100_000)  # the PUB socket's high-water mark
    buffer_steps: int = setting(integer(1, 10_000_000), 10_000)  # messages kept for replay
    max_queue: int = setting(integer(1, 10_000_000), 100_000)  # batches waiting to be sent
    data_parallel_rank: int = setting(integer(0, 1 << 16), 0)


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    # The cluster prefix index in Redis (`kvtier where`, Client.where; docs/integrations/events.md).
    enabled: bool = setting(boolean(), False)
    # An entry lives this long past its last write: the staleness bound for a node that died.
    ttl_s: int = setting(integer(10, 7 * 86400), 600)
    # Every block the local tiers hold is written again this often (must be below ttl_s).
    refresh_s: float = setting(number(gt=0), 300.0)
    batch_commands: int = setting(integer(1, 1 << 20), 4096)  # index commands per Redis batch


_ENGINE = r"[A-Za-z0-9_.-]{1,64} (" + _ZMQ_LOCAL + r")( (" + _ZMQ_LOCAL + r"))?"


@dataclass(frozen=True, slots=True)
class IngestConfig:
    # The node's engines' KV-event publishers (vLLM --kv-events-config, SGLang), read into the
    # prefix index as tier `engine`: "name endpoint [replay_endpoint]; ...", loopback or ipc only.
    engines: str = setting(string(rf"\s*{_ENGINE}(\s*;\s*{_ENGINE})*\s*;?\s*", "name endpoint [replay]; ..."), "",
                           text=True)
    # The pool whose block size and (unsalted) key chain the engines' blocks are indexed under.
    pool: str = setting(string(NAME_PATTERN, NAME_WHAT), "", text=True)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    shutdown_grace_s: float = setting(number(gt=0), 10.0)
    stats_interval_s: float = setting(number(gt=0), 1.0)
    # How often the pools' manifests (which models' KV they hold) are read from Redis for status.
    manifest_interval_s: float = setting(number(gt=0), 10.0)
    persist_arena: bool = setting(boolean(), True)
    watchdog_fraction: float = setting(number(gt=0, lt=1), 0.5)
    # Block copies at least this big run in a thread, off the event loop (0: every copy).
    off_loop_copy_bytes: int = setting(size(), 256 << 10)
    # The event loop: uvloop (faster), or asyncio's own (for debugging, and to measure uvloop).
    event_loop: str = setting(choice("uvloop", "asyncio"), "uvloop", text=True)
    # Threads that copy one batch's staged blocks into a tier at the same time (the copies and
    # checksums release the GIL); 0 = min(4, CPU cores).
    copy_threads: int = setting(integer(0, 64), 0)
    # Cpu arena slots each client's staging segment is granted ahead of its puts, which the
    # client then writes itself, in one pass (kvtier/tiers/grants.py): at most grant_blocks
    # blocks and grant_bytes of them, so small blocks get more; 0 (either) = every put is staged.
    grant_blocks: int = setting(integer(0, 65536), 4096)
    grant_bytes: int = setting(size(), 256 << 20)
    # Fault tests only: SIGKILL the daemon at a named point (kvtier/failpoints.py). "" = none.
    failpoint: str = setting(string(FAILPOINT.pattern, "a failpoint name, optionally ':<n>'"), "", text=True)


@dataclass(frozen=True, slots=True)
class ArenaConfig:
    """The cpu arenas: where their pages come from, and how they are populated (docs/operations.md)."""

    # 2 MiB pages: "off" = /dev/shm's own pages; "auto" = a huge-page mount when one is usable
    # and has room, else /dev/shm (a log line says why); "on" = a huge-page mount, or no start.
    huge_pages: str = setting(choice("off", "auto", "on"), "off", text=True)
    # The huge-page mount: hugetlbfs, or tmpfs mounted huge=. "" = /dev/hugepages.
    huge_pages_dir: str = setting(string(r"(/.*)?", "an absolute path, or empty"), "", text=True)
    # "auto" = the NUMA node of the pool's GPU when that is known, else no binding; "off"; or
    # a node number, for every pool.
    numa_node: str = setting(string(r"auto|off|[0-9]{1,4}", "'auto', 'off' or a node number"), "auto", text=True)
    # Threads that populate an arena's pages in the background (0 = cores / 4, at least 1 and
    # at most 8): the CPU population may use while the daemon already serves.
    populate_threads: int = setting(integer(0, 64), 0)
    # ... and while it is idle (no bus event for 2 s: no engine uses the cache yet), 0 = every
    # core, at most 8. Set it to populate_threads to never go wider.
    populate_threads_idle: int = setting(integer(0, 64), 0)
    # Pages are populated, and slots brought into service, this many bytes at a time.
    populate_chunk: int = setting(size(), 64 << 20)


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier: where the pools' block files live (docs/operations.md, "The disk tier")."""

    # The directory of the block files, one per pool with disk_bytes > 0 (<node>.<pool>.blocks).
    # "" = no disk tier. The daemon's systemd unit must be allowed to write there (ReadWritePaths).
    dir: str = setting(string(r"(/.*)?", "an absolute path, or empty"), "", text=True)
    # Free space the block files leave on the filesystem: a file that would leave less is not created.
    reserve_bytes: int = setting(size(), 1 << 30)
    # Fault tests only: fail the block files' I/O (kvtier/failpoints.py IoFaults), e.g. "eio:read:3"
    # fails the third read and every one after it. "" = none.
    inject_fault: str = setting(string(IO_SPEC.pattern, "eio|enospc|erofs, optionally ':read|write' and ':<n>'"),
                                "", text=True)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The placement policy's knobs, with their checks and defaults (the only ones: the daemon
    builds the core's `PolicyKnobs` from these by name, kvtier/daemon/pools.py `policy_knobs`)."""

    high_watermark: float = setting(number(gt=0, le=1), 0.9)
    low_watermark: float = setting(number(gt=0, le=1), 0.75)
    promote_after_hits: int = setting(integer(1), 2)
    prefetch_lease_s: float = setting(number(gt=0), 5.0)
    transfer_timeout_s: float = setting(number(gt=0), 30.0)
    redis_write: str = setting(choice("write-back", "write-through"), "write-back", text=True)
    redis_admit_after_hits: int = setting(integer(0), 0)
    prefetch_to: str = setting(choice("cpu", "gpu"), "cpu", text=True)
    # A block a client read straight from Redis (get with remote=True) this many times is
    # brought up into cpu, when cpu has room for it (never by waiting). 0 = never.
    promote_remote_after_reads: int = setting(integer(0), 1)
    # A block the cpu tier sheds goes to the disk tier (where the pool has one) when it was read
    # this many times, or its parent was (core/disk_admission.py); else on to Redis. 0 = every block.
    disk_admit_after: int = setting(integer(0), 1)


@dataclass(frozen=True, slots=True)
class PinsConfig:
    """Session pins (Client.pin; kvtier/core/pins.py; docs/operations.md, "Session pins")."""

    # What one tenant may keep pinned in one pool, in bytes (0 = no pins).
    budget_bytes: int = setting(size(), 1 << 30)
    # Tenants with a budget of their own (tenant -> bytes), instead of budget_bytes.
    tenant_budget_bytes: tuple[tuple[str, int], ...] = setting(table(size()), ())
    # A longer pin is cut to this. At most redis.block_ttl_s, which a Redis copy written later gets.
    max_ttl_s: int = setting(integer(1, 7 * 86400), 3600)
    # All pins of a pool together hold at most this share of the node's slots of it.
    node_share: float = setting(number(gt=0, le=1), 0.5)


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Fair share of each node tier between tenants (kvtier/core/tenants.py; docs/operations.md,
    "Tenants and fair share"). A tenant is the name a put carries ("" when none)."""

    # A tenant's share of a node tier is its weight over the summed weights of the tenants there.
    weights: tuple[tuple[str, float], ...] = setting(table(number(gt=0)), ())
    default_weight: float = setting(number(gt=0), 1.0)
    # A hard cap, in bytes of each node tier (gpu, cpu and disk alike).
    cap_bytes: tuple[tuple[str, int], ...] = setting(table(size()), ())
    # A name clients send -> the tenant it counts as ("lora:sql-adapter" = "acme").
    aliases: tuple[tuple[str, str], ...] = setting(table(string(r"[A-Za-z0-9_.:/-]{0,128}", "a tenant name")), ())


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One model layout. `name` comes from the `[pools.<name>]` table key."""

    name: str
    model: str = setting(string(empty_ok=False), text=True)
    layers: int = setting(integer(1))
    kv_heads: int = setting(integer(1))
    head_dim: int = setting(integer(1))
    block_tokens: int = setting(integer(1), 16)
    dtype: str = setting(choice(*DTYPE_BYTES), "bfloat16", text=True)
    device: str = setting(string(_DEVICE, "'auto', 'cpu', 'cuda' or 'cuda:N'"), "auto", text=True)
    gpu_blocks: int = setting(integer(0), 64)
    cpu_blocks: int = setting(integer(1), 256)
    # Capacity in bytes instead of blocks (0: use *_blocks): the loader sets *_blocks to how
    # many whole blocks of this layout fit.
    gpu_bytes: int = setting(size(), 0)
    cpu_bytes: int = setting(size(), 0)
    # The disk tier's block file in [disk] dir, headers included: the most it ever takes on the
    # filesystem, allocated in full at start. 0 = no disk tier for this pool.
    disk_bytes: int = setting(size(), 0)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)


# Used only when neither the file nor the environment names any pool, so that
# `kvtier daemon` with no config at all starts a small, working development node.
DEMO_POOL = PoolConfig(name="demo", model="demo", layers=4, kv_heads=2, head_dim=64,
                       block_tokens=16, dtype="float16", gpu_blocks=32, cpu_blocks=128)


@dataclass(frozen=True, slots=True)
class Config:
    node: NodeConfig
    log: LogConfig
    redis: RedisConfig
    embedded_redis: EmbeddedRedisConfig
    bus: BusConfig
    daemon: DaemonConfig
    metrics: MetricsConfig
    policy: PolicyConfig
    pools: tuple[PoolConfig, ...]
    events: EventsConfig = EventsConfig()
    prefix_index: PrefixIndexConfig = PrefixIndexConfig()
    ingest: IngestConfig = IngestConfig()
    arena: ArenaConfig = ArenaConfig()
    disk: DiskConfig = DiskConfig()
    pins: PinsConfig = PinsConfig()
    tenants: TenantsConfig = TenantsConfig()


SECTIONS: dict[str, type] = {
    "node": NodeConfig,
    "log": LogConfig,
    "redis": RedisConfig,
    "embedded_redis": EmbeddedRedisConfig,
    "bus": BusConfig,
    "daemon": DaemonConfig,
    "metrics": MetricsConfig,
    "policy": PolicyConfig,
    "events": EventsConfig,
    "prefix_index": PrefixIndexConfig,
    "ingest": IngestConfig,
    "arena": ArenaConfig,
    "disk": DiskConfig,
    "pins": PinsConfig,
    "tenants": TenantsConfig,
}

Origins = dict[tuple[str, ...], str]  # key path -> the env var that set it
