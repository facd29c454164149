"""Opening a pool's tiers on daemon start, and the descriptor entry clients use to find them."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

from kvtier.config import ArenaConfig, DiskConfig, PinsConfig, PolicyConfig, PoolConfig, RedisConfig, TenantsConfig
from kvtier.core.events import Tier
from kvtier.core.index import TierIndex
from kvtier.core.knobs import PolicyKnobs, RedisWrite
from kvtier.core.pins import PinRules
from kvtier.core.policy import Placement
from kvtier.core.tenants import TenantRules
from kvtier.daemon.arena import open_cpu_arena
from kvtier.disk.blockfile import DiskBlockFile
from kvtier.errors import DiskFault, KvtierError, SegmentError
from kvtier.failpoints import IoFaults
from kvtier.layout import BlockLayout
from kvtier.shm.directory import DirectoryWriter, directory_bytes, directory_capacity
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable, segment_bytes
from kvtier.store.redis_blocks import RedisBlocks
from kvtier.tiers.arena_fill import ArenaFill, plan_chunks
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.local import LocalTier
from kvtier.tiers.pool import PoolRuntime
from kvtier.tiers.stats import PoolCounters

# How a `[policy]` value becomes the type its knob takes (any other is taken as it is).
_KNOB_TYPES: dict[Any, Callable[[Any], Any]] = {RedisWrite: RedisWrite, Tier: lambda label: Tier[label.upper()]}


def policy_knobs(policy: PolicyConfig) -> PolicyKnobs:
    """The core's knobs from the config's `[policy]` section: each knob PolicyKnobs declares is
    the config key of its name (whose check and default the config declares), converted to the
    knob's type. A knob the config lacks fails here (AttributeError), never takes a default
    (tests/unit/test_config.py holds the two to the same names)."""
    types = get_type_hints(PolicyKnobs)
    return PolicyKnobs(**{f.name: _KNOB_TYPES.get(types[f.name], _same)(getattr(policy, f.name))
                          for f in fields(PolicyKnobs)})


def _same(value: Any) -> Any:
    return value


def segment_name(node: str, pool: str, part: str) -> str:
    return f"kvtier.{node}.{pool}.{part}"


def _shm_mode(gid: int | None) -> int:
    return 0o640 if gid is not None else 0o600


def _fresh(name: str, size: int, gid: int | None) -> ShmSegment:
    """Create `name`, replacing a leftover of our own from a crashed run (never someone else's)."""
    if ShmSegment.exists(name):
        old = ShmSegment.attach(name, trusted_uid=os.geteuid())  # raises for a squatter
        old.close()
        ShmSegment.unlink_name(name)
    return ShmSegment.create(name, size, mode=_shm_mode(gid), gid=gid, reserve=True)


def open_pool(cfg: PoolConfig, node: str, policy: PolicyConfig, redis_blocks_client, redis: RedisConfig,
              gid: int | None, log, arena: ArenaConfig | None = None, disk: DiskConfig | None = None,
              pins: PinsConfig | None = None, tenants: TenantsConfig | None = None) -> PoolRuntime:
    """Open the pool's tiers. The cpu arena is in service for its first chunk only: the rest
    comes as kvtier/daemon/population.py populates it (`rt.arena`); an arena within one chunk
    is fully in service on return. A disk tier whose file was adopted has no slot in service
    until kvtier/daemon/disk_adoption.py scans it (`rt.disk.adopting`)."""
    created: list[ShmSegment] = []  # unlinked again if the pool cannot open completely
    files: list[DiskBlockFile] = []  # closed (never deleted) likewise
    try:
        return _open_pool(cfg, node, policy, redis_blocks_client, redis, gid, log, created, arena or ArenaConfig(),
                          disk or DiskConfig(), files, pins or PinsConfig(), tenants or TenantsConfig())
    except BaseException:
        for seg in created:
            seg.close()
            seg.unlink()
        for f in files:
            f.close()
        raise


def open_disk_file(cfg: PoolConfig, node: str, layout: BlockLayout, disk: DiskConfig, gid: int | None,
                   log) -> tuple[DiskBlockFile | None, bool, str | None]:
    """The pool's block file in [disk] dir, adopted or made: (file, adopted, None). A device
    that fails to open it (EIO, EROFS, ENOSPC, EACCES: a DiskFault) leaves the pool without its
    disk tier, serving from the others: (None, False, why), with the disk.tier_off line. A
    setting that cannot work (no block fits, the reserve, a file that is not ours) stops the
    start with an error that names the settings."""
    path = Path(disk.dir) / f"{node}.{cfg.name}.blocks"
    n = DiskBlockFile.slots_for(cfg.disk_bytes, layout.block_bytes)
    if n <= 0:
        raise KvtierError(f"pools.{cfg.name}.disk_bytes = {cfg.disk_bytes} holds no block of {layout.block_bytes} "
                          f"bytes with its header")
    if disk.inject_fault:
        log.warning("disk.fault_armed", inject_fault=disk.inject_fault)
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700 if gid is None else 0o750)
            if gid is not None:  # clients of the shm group read the block file themselves
                os.chown(path.parent, -1, gid)
        f, adopted = DiskBlockFile.open_or_create(path, n, layout.block_bytes, layout.fingerprint,
                                                  reserve_bytes=disk.reserve_bytes, faults=IoFaults(disk.inject_fault))
    except SegmentError as e:
        raise KvtierError(f"[disk] dir = {disk.dir!r}, pools.{cfg.name}.disk_bytes = {cfg.disk_bytes}: "
                          f"cannot use the disk tier's block file: {e}") from None
    except OSError as e:  # DiskFault, or mkdir's own error
        why = f"open: {e.strerror or e}"
        log.error("disk.tier_off", path=str(path), op="open", errno=errno.errorcode.get(e.errno or 0, str(e.errno)),
                  error=str(e), blocks=0, note="the pool serves from its other tiers; a restart tries the disk again")
        return None, False, why
    if gid is not None:
        f.share_with_group(gid)
    log.info("disk.opened", path=str(path), blocks=n, bytes=os.path.getsize(path), direct=f.direct, adopted=adopted)
    return f, adopted, None


def _open_pool(cfg: PoolConfig, node: str, policy: PolicyConfig, redis_blocks_client, redis: RedisConfig,
               gid: int | None, log, created: list[ShmSegment], arena_cfg: ArenaConfig, disk_cfg: DiskConfig,
               files: list[DiskBlockFile], pins: PinsConfig, tenants: TenantsConfig) -> PoolRuntime:
    layout = BlockLayout(cfg.model, cfg.layers, cfg.kv_heads, cfg.head_dim, cfg.block_tokens, cfg.dtype)
    log = log.bind(pool=cfg.name)
    bb = layout.block_bytes
    disk_file, adopted, disk_error = None, False, None
    if cfg.disk_bytes:
        disk_file, adopted, disk_error = open_disk_file(cfg, node, layout, disk_cfg, gid, log)
        if disk_file is not None:
            files.append(disk_file)
    dir_cap = directory_capacity(cfg.gpu_blocks + cfg.cpu_blocks + (disk_file.n if disk_file is not None else 0))
    dir_seg = _fresh(segment_name(node, cfg.name, "dir"), directory_bytes(dir_cap), gid)
    created.append(dir_seg)
    directory = DirectoryWriter.create(dir_seg, dir_cap, layout.fingerprint)
    # Clients write the cpu slots the daemon grants them (kvtier/tiers/grants.py): group-writable.
    arena = open_cpu_arena(segment_name(node, cfg.name, "cpu"), cfg.cpu_blocks, layout, gid,
                           0o660 if gid is not None else 0o600,
                           arena_cfg, cfg.device, log)
    if not arena.warm:
        created.append(arena.table.seg)
    # No cpu slot is in service before its chunk's pages are populated (and, warm, scanned).
    indices = {Tier.GPU: TierIndex(cfg.gpu_blocks), Tier.CPU: TierIndex(cfg.cpu_blocks, in_service=()),
               Tier.REDIS: TierIndex(None)}
    disk_tier = None
    if disk_file is not None:  # an adopted file's slots come into service as their headers are scanned
        indices[Tier.DISK] = TierIndex(disk_file.n, in_service=() if adopted else None)
        disk_tier = DiskTier(disk_file, indices[Tier.DISK], directory, adopted)

    gpu_tier = None
    gpu_ipc = None
    if cfg.gpu_blocks > 0:
        # torch (some 200 MB resident) is imported only when the gpu tier may be a real GPU.
        device_type = "cpu" if cfg.device == "cpu" else None
        if device_type is None:
            from kvtier.shm import cuda_ipc as gpu_mem

            device = gpu_mem.resolve_device(cfg.device)
            device_type = device.type
        name = segment_name(node, cfg.name, "gpu")
        if device_type == "cpu":
            seg = _fresh(name, segment_bytes(cfg.gpu_blocks, bb), gid)
            created.append(seg)
            table = SlotTable.format(seg, Kind.ARENA, cfg.gpu_blocks, bb, layout.fingerprint)
            gpu_tier = LocalTier(Tier.GPU, table, indices[Tier.GPU], directory)
        else:
            seg = _fresh(name, segment_bytes(cfg.gpu_blocks, bb, with_payload=False), gid)
            created.append(seg)
            table = SlotTable.format(seg, Kind.GPU_HEADERS, cfg.gpu_blocks, bb, layout.fingerprint)
            payload = gpu_mem.allocate_device_pool(cfg.gpu_blocks, bb, device)
            gpu_tier = LocalTier(Tier.GPU, table, indices[Tier.GPU], directory, device_payload=payload)
            gpu_ipc = gpu_mem.export_ipc(payload)
        log.info("pool.gpu_ready", device=str(device) if device_type != "cpu" else "cpu", blocks=cfg.gpu_blocks,
                 block_bytes=bb)

    placement = Placement(cfg.name, indices, policy_knobs(policy),  # from here on the one owner of the indices
                          pin_rules=PinRules(pins.budget_bytes, dict(pins.tenant_budget_bytes), pins.max_ttl_s,
                                             pins.node_share), block_bytes=bb,
                          tenant_rules=TenantRules(dict(tenants.weights), tenants.default_weight,
                                                   {k: v // bb for k, v in tenants.cap_bytes}, dict(tenants.aliases)))
    table = arena.table
    cpu_tier = LocalTier(Tier.CPU, table, indices[Tier.CPU], directory)
    fill = ArenaFill(cpu_tier, arena.filler, arena.backing, arena.warm,
                     plan_chunks(table.n, table.stride, table.payload_off, arena_cfg.populate_chunk, arena.allocated),
                     numa_node=arena.binder.node if arena.binder else None, huge_fallback=arena.huge_fallback)
    # The first chunk before READY, so the pool has room from the start.
    fill.apply_all(fill.prepare(fill.chunks.pop(0)), placement)
    if not fill.chunks:
        fill.done()
    what = "arena.reattached" if arena.warm else "arena.created"
    log.info(what, segment=table.seg.name, blocks=cfg.cpu_blocks, block_bytes=bb, bytes=table.seg.size,
             backing=arena.backing.describe, numa_node=fill.numa_node, in_service=indices[Tier.CPU].capacity,
             kept=fill.kept, discarded=fill.discarded, torn=fill.torn)
    return PoolRuntime(
        name=cfg.name,
        layout=layout,
        gpu=gpu_tier,
        cpu=cpu_tier,
        redis=RedisBlocks(redis_blocks_client, cfg.name, layout.fingerprint, bb, redis.block_ttl_s, log,
                          pipeline_bytes=redis.pipeline_bytes, connections=redis.connections,
                          write_pipeline_bytes=redis.write_pipeline_bytes),
        directory=directory,
        placement=placement,
        counters=PoolCounters(),
        gpu_ipc=gpu_ipc,
        arena=fill,
        disk=disk_tier,
        disk_error=disk_error,
    )


def close_pool(rt: PoolRuntime, persist_arena: bool) -> None:
    """Unlink what does not survive a restart; keep the cpu arena if asked (warm restart).
    The arena's population must have stopped (its threads write through the mapping)."""
    for t in (rt.gpu, rt.cpu):
        if t is None:
            continue
        t.device_payload = None
        t.table.close()
        if t is rt.gpu or not persist_arena:
            t.table.seg.unlink()
    rt.directory.seg.close()
    rt.directory.seg.unlink()
    if rt.disk is not None:  # kept: the next start adopts what it holds
        try:
            rt.disk.file.sync()
        except DiskFault:
            pass  # the tier was off, or the device failed now: adoption verifies every block anyway
        rt.disk.file.close()
