"""The client's view of one pool: the daemon's segments mapped read-only, plus its own staging."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from kvtier.core.events import StagedBlock, Tier
from kvtier.descriptor import Descriptor, PoolEntry
from kvtier.disk.reader import DiskSlots
from kvtier.errors import BadRequest, SegmentError
from kvtier.keys import BlockKey
from kvtier.shm.directory import IN_REDIS, NO_SLOT, DirectoryReader
from kvtier.shm.prefault import Prefault
from kvtier.shm.segment import SHM_DIR, ShmSegment
from kvtier.shm.slot_batch import holds, read_rows
from kvtier.shm.slots import Flags, Kind, SlotTable
from kvtier.shm.staging import StagingWriter

# Fewer keys than this are located one by one: a batch probe's numpy set-up (tens of us) costs
# more than a few per-key probes (a few us each).
BATCH_MIN = 8

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def host_rows(kv: torch.Tensor, n: int) -> npt.NDArray[np.uint8]:
    """kv's first n blocks as [n, block_bytes] uint8 host rows (a copy only for a GPU tensor)."""
    host = kv[:n].detach()
    if host.device.type != "cpu":
        host = host.cpu()
    return host.contiguous().view(torch.uint8).reshape(n, -1).numpy()


def map_pools(desc: Descriptor, node: str, daemon_uid: int, staging_blocks: int) -> dict[str, ClientPool]:
    """Every pool the daemon's descriptor lists, mapped; on a failure none stays mapped."""
    pools: dict[str, ClientPool] = {}
    try:
        for name, p in desc.pools.items():
            pools[name] = ClientPool(name, p, node, daemon_uid, desc.shm_gid, staging_blocks)
    except BaseException:
        for mapped in pools.values():
            mapped.close()
        raise
    return pools


class ClientPool:
    def __init__(self, name: str, desc: PoolEntry, node: str, daemon_uid: int, shm_gid: int | None,
                 staging_blocks: int) -> None:
        self.name = name
        self.layout = desc.layout
        self.fingerprint = self.layout.fingerprint
        if self.fingerprint.hex() != desc.fingerprint:
            raise SegmentError(f"pool {name}: descriptor fingerprint does not match its layout")
        self.block_bytes = self.layout.block_bytes
        self.shape = self.layout.shape
        self.dtype = TORCH_DTYPES[self.layout.dtype]
        self._node = node
        self._uid = daemon_uid
        self._gid = shm_gid
        self._staging_blocks = staging_blocks
        fp, bb = self.fingerprint, self.block_bytes
        self.directory = DirectoryReader(ShmSegment.attach(desc.directory.segment, trusted_uid=daemon_uid), fp)
        self.tables: dict[Tier, SlotTable | DiskSlots] = {}
        self.gpu_device_payload: torch.Tensor | None = None
        if desc.gpu is not None:
            g = desc.gpu
            seg = ShmSegment.attach(g.segment, trusted_uid=daemon_uid)
            if g.device == "cuda":
                from kvtier.shm.cuda_ipc import import_ipc

                self.tables[Tier.GPU] = SlotTable.open(seg, Kind.GPU_HEADERS, fp, bb)
                if g.ipc is None:
                    raise SegmentError(f"pool {name}: a cuda gpu tier without its IPC handle")
                self.gpu_device_payload = import_ipc(g.ipc)
            else:
                self.tables[Tier.GPU] = SlotTable.open(seg, Kind.ARENA, fp, bb)
        cpu_dir = Path(desc.cpu.dir or SHM_DIR)  # a huge-page mount, or /dev/shm
        if not cpu_dir.is_absolute():
            raise SegmentError(f"pool {name}: the descriptor's arena directory {cpu_dir} is not absolute")
        self.tables[Tier.CPU] = self.arena = SlotTable.open(_attach_arena(desc.cpu.segment, daemon_uid, cpu_dir),
                                                            Kind.ARENA, fp, bb)
        # Map the arena's pages now, in the background, not one fault per page on first use
        # (shm/prefault.py). A huge-page arena faults once per 2 MiB anyway.
        self.prefault = None if cpu_dir != SHM_DIR else Prefault(
            self.arena.payloads().ctypes.data, self.arena.n * self.arena.stride).start()
        self.disk_error: str | None = None  # why the disk tier's file could not be opened (its blocks then miss)
        if desc.disk is not None:
            try:
                self.tables[Tier.DISK] = DiskSlots(Path(desc.disk.dir) / desc.disk.segment, fp, bb, daemon_uid)
            except (OSError, SegmentError) as e:
                self.disk_error = f"{type(e).__name__}: {e}"
        self.staging: StagingWriter | None = None
        self._users = 0  # calls copying through the mappings right now (see in_use)
        self._closing = False
        self._daemon_alive = True  # at close: whether a daemon will count what staging holds
        self._bounce: torch.Tensor | None = None  # pinned host block for CUDA destinations, made on first use
        self.own_reads = 0  # blocks read from this client's own staging, before the daemon placed them

    # --- lookup and read ---------------------------------------------------------------------

    def locate(self, key: bytes) -> tuple[Tier, int] | None:
        """The best local (tier, slot) whose header currently holds `key`."""
        row = self.directory.find(key)
        if row is None:
            return None
        gpu, cpu, _flags, disk = row
        for tier, slot in ((Tier.GPU, gpu), (Tier.CPU, cpu), (Tier.DISK, disk)):
            table = self.tables.get(tier)
            if slot != NO_SLOT and table is not None and 0 <= slot < table.n:
                if table.begin_read(slot, key) is not None:
                    return tier, slot
        return None

    def located(self, keys: Sequence[bytes]) -> Iterator[Tier | None]:
        """`locate`'s tier for each key, in order (None: not on this node). Blocks the directory
        lists in the cpu arena alone are probed and checked together (slot_batch.holds); the
        rest one by one, as the caller comes to them. A hint, as `locate`'s: a read verifies again."""
        for k, h in zip(keys, self._held_in_cpu(keys)):
            yield self._tier(k, h)

    def leading(self, keys: Sequence[bytes]) -> list[Tier]:
        """The tiers of the leading run of `keys` resident on this node (`located` up to its
        first None), the run the batch found in the cpu arena taken at once."""
        held = self._held_in_cpu(keys)
        n = held.index(False) if False in held else len(held)
        tiers = [Tier.CPU] * n
        for k, h in zip(keys[n:], held[n:]):
            if (tier := self._tier(k, h)) is None:
                break
            tiers.append(tier)
        return tiers

    def _tier(self, key: bytes, held_in_cpu: bool) -> Tier | None:
        """The cpu tier where the batch probe found `key`, else `locate`'s."""
        return Tier.CPU if held_in_cpu else None if (hit := self.locate(key)) is None else hit[0]

    def _held_in_cpu(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the directory lists it in the cpu arena alone and its slot holds it
        (probed and checked together: slot_batch.holds); False for the rest, left to `locate`."""
        cpu = self.tables.get(Tier.CPU)
        if isinstance(cpu, SlotTable) and len(keys) >= BATCH_MIN:
            return holds(cpu, self.directory.cpu_slots(keys), keys).tolist()  # type: ignore[no-any-return]
        return [False] * len(keys)

    def in_redis_hint(self, key: bytes) -> bool:
        row = self.directory.find(key)
        return row is not None and bool(row[2] & IN_REDIS)

    def _slots(self, key: bytes) -> Iterator[tuple[Tier, SlotTable | DiskSlots, int]]:
        """(tier, table, slot) where the directory lists `key`, best tier first; the slot's own
        header is what a read then verifies."""
        row = self.directory.find(key)
        if row is None:
            return
        for tier, slot in ((Tier.GPU, row[0]), (Tier.CPU, row[1]), (Tier.DISK, row[3])):
            table = self.tables.get(tier)
            if slot != NO_SLOT and table is not None and 0 <= slot < table.n:
                yield tier, table, slot

    def read(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy `key` into dst (one block, any device). Verified; False means a miss."""
        flat = dst.view(torch.uint8).reshape(-1)
        if self.gpu_device_payload is not None:
            for tier, table, slot in self._slots(key):
                if tier == Tier.GPU and isinstance(table, SlotTable) \
                        and self._read_device(self.gpu_device_payload, table, slot, key, flat):
                    return True
        on_host = flat.device.type == "cpu"
        host = flat.numpy() if on_host else self._pinned().numpy()

        def into_host(table: SlotTable | DiskSlots, slot: int, flags: int) -> bool:
            if table.read_into(slot, key, host, flags) is None:
                return False
            if not on_host:
                flat.copy_(self._pinned())  # from pinned memory; returns once the copy is done
            return True

        return self._read_host(key, into_host)

    def read_rows(self, keys: Sequence[bytes], out: npt.NDArray[np.uint8], rows: Sequence[int]) -> list[bool]:
        """read() of keys[j] into host row out[rows[j]] (out: [*, block_bytes] uint8), for a batch:
        blocks the directory lists in the cpu arena are probed, checked and verified together
        (SlotTable.read_rows); the rest, and any that fail there, take read()'s path one by one."""
        got = [False] * len(keys)
        cpu = self.tables.get(Tier.CPU)
        if isinstance(cpu, SlotTable) and keys:
            got = read_rows(cpu, self.directory.cpu_slots(keys), keys, out, rows)
        for j, ok in enumerate(got):
            if not ok:
                got[j] = self.read(keys[j], torch.from_numpy(out[rows[j]]))
        return got

    def read_with(self, key: bytes, copy_out: Callable[[npt.NDArray[np.uint8]], object],
                  digest: Callable[[], int]) -> bool:
        """As read, into a host destination of the caller's making (SlotTable.read_with). A block
        only in a CUDA gpu tier is a miss here."""
        return self._read_host(key, lambda table, slot, flags: table.read_with(slot, key, copy_out, digest, flags)
                               is not None)

    def _read_host(self, key: bytes, read: Callable[[SlotTable | DiskSlots, int, int], bool]) -> bool:
        """`read(table, slot, flags)` from the first host-memory copy of `key` that verifies: the
        slots the directory lists, else (read your own writes) the slot this client staged it in
        and the daemon has not placed yet, verified like any other (flags READY). The daemon
        releases a staging slot only once its block is visible, so a slot gone since means the
        directory is asked again."""
        if self._read_listed(key, read):
            return True
        w = self.staging
        if w is None:
            return False
        for table, slot in ((w.table, w.slot_of(key)), (w.arena, w.granted_slot_of(key))):
            if table is not None and slot is not None and read(table, slot, Flags.READY):
                self.own_reads += 1
                return True
        return self._read_listed(key, read)

    def _read_listed(self, key: bytes, read: Callable[[SlotTable | DiskSlots, int, int], bool]) -> bool:
        return any(read(table, slot, Flags.VALID) for tier, table, slot in self._slots(key)
                   if not (tier == Tier.GPU and self.gpu_device_payload is not None))

    def _pinned(self) -> torch.Tensor:
        """A page-locked host block: copies between it and a GPU run at full PCIe speed, where a
        pageable buffer measured about 3 GB/s on an H200."""
        if self._bounce is None:
            self._bounce = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)
        return self._bounce

    def _read_device(self, payload: torch.Tensor, table: SlotTable, slot: int, key: bytes, dst: torch.Tensor) -> bool:
        """Read a block of a real GPU pool (`payload`: its IPC mapping) into dst (flat uint8, any
        device): read_device_block."""
        return read_device_block(payload, table, slot, key, dst)

    # --- staging for put ---------------------------------------------------------------------

    def stager(self) -> StagingWriter:
        """This client's staging segment for the pool, made on first use."""
        if self.staging is None:
            self.staging = StagingWriter.create(self._node, self._staging_blocks, self.block_bytes, self.fingerprint,
                                                daemon_uid=self._uid, shm_gid=self._gid,
                                                arena=self.arena if self.arena.seg.writable else None)
        return self.staging

    def stage(self, keys: Sequence[BlockKey], parent: BlockKey | None, kv: torch.Tensor) -> list[StagedBlock]:
        """Write blocks into free staging slots, here and now. Stops at the first block with no free slot."""
        w = self.stager()
        taken = w.take_slots(keys, parent, grants=False)
        try:
            rows = host_rows(kv, len(taken))
            blocks = w.fill_rows(list(enumerate(taken)), rows)
        except BaseException:
            w.unstage(taken)
            raise
        w.staged(blocks)
        return blocks

    def check_tensor(self, t: object, n: int, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise BadRequest(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != self.dtype:
            raise BadRequest(f"{what} must have dtype {self.dtype}, got {t.dtype} (pool {self.name})")
        if t.dim() != 1 + len(self.shape) or tuple(t.shape[1:]) != self.shape or t.shape[0] < n:
            raise BadRequest(f"{what} must have shape [>= {n}, {', '.join(map(str, self.shape))}], got {list(t.shape)}")
        if not t.is_contiguous():
            raise BadRequest(f"{what} must be contiguous")
        return t

    @contextmanager
    def in_use(self) -> Iterator[ClientPool]:
        """Held while threads copy through this pool's mappings: a close meanwhile (the daemon
        restarted, the client closes) waits until they are done, rather than unmap under them."""
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._closing and not self._users:
                self._close_now()

    def close(self, daemon_alive: bool = True) -> None:
        """Unmap (once no call copies through the pool). `daemon_alive`: a daemon is there to count
        drops the staging segment holds and unlink it; without one it is unlinked now."""
        if self._closing:
            return
        self._closing = True
        self._daemon_alive = daemon_alive
        if not self._users:
            self._close_now()

    def _close_now(self) -> None:
        if self.prefault is not None:
            self.prefault.stop()
        if self.staging is not None:
            self.staging.close(leave_uncounted=self._daemon_alive)
            self.staging = None
        for table in self.tables.values():
            table.close()
        self.directory.seg.close()


def _attach_arena(name: str, daemon_uid: int, directory: Path) -> ShmSegment:
    """The cpu arena, writable where the daemon lets this client write the slots it grants it
    (kvtier/tiers/grants.py), else read-only: every put then goes through staging."""
    try:
        return ShmSegment.attach(name, writable=True, trusted_uid=daemon_uid, directory=directory)
    except SegmentError:
        return ShmSegment.attach(name, trusted_uid=daemon_uid, directory=directory)


def read_device_block(payload: torch.Tensor, table: SlotTable, slot: int, key: bytes, dst: torch.Tensor) -> bool:
    """A block of a device pool (its headers hold device sums: kvtier/shm/device_sum.py) copied
    into dst (flat uint8, any device) and verified there, on dst's own device: any client can
    write the IPC mapping, so it is the caller's own copy that is checked, never the source
    (which could change between a check and the copy). The seqlock re-check follows the copy."""
    from kvtier.shm.device_sum import device_sum

    snap = table.begin_read(slot, key)
    if snap is None:
        return False
    dst.copy_(payload[slot])  # device to device (queued), or a blocking D2H
    ok = device_sum(dst) == snap[1]  # syncs: the copy is complete before the seqlock re-check
    return table.end_read(slot, snap[0], key) and ok
