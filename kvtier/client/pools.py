"""The client's view of one pool: the daemon's segments mapped read-only, plus its own staging."""

from __future__ import annotations

import os
import secrets
import time
from contextlib import contextmanager

import torch

from kvtier.bus.events import StagedBlock, Tier
from kvtier.errors import BadRequest, SegmentError
from kvtier.layout import BlockLayout
from kvtier.tiers.directory import IN_REDIS, NO_SLOT, DirectoryReader
from kvtier.tiers.segment import ShmSegment
from kvtier.tiers.slots import EMPTY_KEY, Flags, Kind, SlotTable, checksum, segment_bytes

TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def host_rows(kv: torch.Tensor, n: int):
    """kv's first n blocks as [n, block_bytes] uint8 host rows (a copy only for a GPU tensor)."""
    host = kv[:n].detach()
    if host.device.type != "cpu":
        host = host.cpu()
    return host.contiguous().view(torch.uint8).reshape(n, -1).numpy()


# A staged block the daemon has not taken within this long is given up (see _free_slot).
STAGING_RECLAIM_S = 10.0


class ClientPool:
    def __init__(self, name: str, desc: dict, node: str, daemon_uid: int, shm_gid: int | None,
                 staging_blocks: int) -> None:
        self.name = name
        self.layout = BlockLayout.from_dict(desc["layout"])
        self.fingerprint = self.layout.fingerprint
        if self.fingerprint.hex() != desc["fingerprint"]:
            raise SegmentError(f"pool {name}: descriptor fingerprint does not match its layout")
        self.block_bytes = self.layout.block_bytes
        self.shape = self.layout.shape
        self.dtype = TORCH_DTYPES[self.layout.dtype]
        self._node = node
        self._uid = daemon_uid
        self._gid = shm_gid
        self._staging_blocks = staging_blocks
        fp, bb = self.fingerprint, self.block_bytes
        self.directory = DirectoryReader(ShmSegment.attach(desc["directory"]["segment"], trusted_uid=daemon_uid), fp)
        self.tables: dict[Tier, SlotTable] = {}
        self.gpu_device_payload = None
        if desc.get("gpu"):
            g = desc["gpu"]
            seg = ShmSegment.attach(g["segment"], trusted_uid=daemon_uid)
            if g.get("device") == "cuda":
                from kvtier.tiers.gpu import import_ipc

                self.tables[Tier.GPU] = SlotTable.open(seg, Kind.GPU_HEADERS, fp, bb)
                self.gpu_device_payload = import_ipc(g["ipc"])
            else:
                self.tables[Tier.GPU] = SlotTable.open(seg, Kind.ARENA, fp, bb)
        self.tables[Tier.CPU] = SlotTable.open(ShmSegment.attach(desc["cpu"]["segment"], trusted_uid=daemon_uid),
                                               Kind.ARENA, fp, bb)
        self.staging: SlotTable | None = None
        self._cursor = 0
        self._staged_at: dict[int, float] = {}  # staging slot -> when it was last staged
        self._users = 0  # calls copying through the mappings right now (see in_use)
        self._closing = False
        self._bounce: torch.Tensor | None = None  # pinned host block for CUDA destinations, made on first use

    # --- lookup and read ---------------------------------------------------------------------

    def locate(self, key: bytes) -> tuple[Tier, int] | None:
        """The best local (tier, slot) whose header currently holds `key`."""
        row = self.directory.find(key)
        if row is None:
            return None
        gpu, cpu, _flags = row
        for tier, slot in ((Tier.GPU, gpu), (Tier.CPU, cpu)):
            table = self.tables.get(tier)
            if slot != NO_SLOT and table is not None and 0 <= slot < table.n:
                if table.begin_read(slot, key) is not None:
                    return tier, slot
        return None

    def in_redis_hint(self, key: bytes) -> bool:
        row = self.directory.find(key)
        return row is not None and bool(row[2] & IN_REDIS)

    def _slots(self, key: bytes):
        """(tier, table, slot) where the directory lists `key`, best tier first; the slot's own
        header is what a read then verifies."""
        row = self.directory.find(key)
        if row is None:
            return
        for tier, slot in ((Tier.GPU, row[0]), (Tier.CPU, row[1])):
            table = self.tables.get(tier)
            if slot != NO_SLOT and table is not None and 0 <= slot < table.n:
                yield tier, table, slot

    def read(self, key: bytes, dst: torch.Tensor) -> bool:
        """Copy `key` into dst (one block, any device). Verified; False means a miss."""
        flat = dst.view(torch.uint8).reshape(-1)
        on_host = flat.device.type == "cpu"
        host = flat.numpy() if on_host else self._pinned().numpy()
        for tier, table, slot in self._slots(key):
            if tier == Tier.GPU and self.gpu_device_payload is not None:
                if self._read_device(table, slot, key, flat):
                    return True
                continue
            if table.read_into(slot, key, host) is not None:
                if not on_host:
                    flat.copy_(self._pinned())  # from pinned memory; returns once the copy is done
                return True
        return False

    def read_with(self, key: bytes, copy_out, digest) -> bool:
        """As read, into a host destination of the caller's making (SlotTable.read_with). A block
        only in a CUDA gpu tier is a miss here."""
        return any(table.read_with(slot, key, copy_out, digest) is not None for tier, table, slot in self._slots(key)
                   if not (tier == Tier.GPU and self.gpu_device_payload is not None))

    def _pinned(self) -> torch.Tensor:
        """A page-locked host block: copies between it and a GPU run at full PCIe speed, where a
        pageable buffer measured about 3 GB/s on an H200."""
        if self._bounce is None:
            self._bounce = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True)
        return self._bounce

    def _read_device(self, table: SlotTable, slot: int, key: bytes, dst: torch.Tensor) -> bool:
        """Read a block of a real GPU pool into dst (flat uint8, any device). The bytes verified
        are the caller's own copy, brought back to the host after the copy has finished: any
        client can write the IPC mapping, so checking the source instead would leave a window
        between the check and the copy. The seqlock re-check follows both copies."""
        snap = table.begin_read(slot, key)
        if snap is None:
            return False
        dst.copy_(self.gpu_device_payload[slot])  # device to device, or a blocking D2H
        if dst.device.type == "cpu":
            host = dst.numpy()
        else:
            pinned = self._pinned()
            pinned.copy_(dst)  # blocking: waits for the copy into dst, on the same stream
            host = pinned.numpy()
        return table.end_read(slot, snap[0], key) and checksum(host) == snap[1]

    # --- staging for put ---------------------------------------------------------------------

    def _ensure_staging(self) -> SlotTable:
        if self.staging is None:
            name = f"kvtier.{self._node}.stage.{os.getpid()}.{secrets.token_hex(8)}"
            same_user = os.geteuid() == self._uid
            seg = ShmSegment.create(
                name, segment_bytes(self._staging_blocks, self.block_bytes),
                mode=0o600 if same_user or self._gid is None else 0o660,
                gid=None if same_user else self._gid,
                reserve=True,  # every page now: a full /dev/shm fails here, not as a SIGBUS mid-put
            )
            self.staging = SlotTable.format(seg, Kind.STAGING, self._staging_blocks, self.block_bytes, self.fingerprint)
        return self.staging

    def take_slots(self, keys: list[bytes], parent: bytes | None) -> list[StagedBlock]:
        """Take free staging slots for the leading keys (stops at the first with none) and mark
        each as being written (odd gen), so no other put takes it. `gen` is that odd gen until
        `fill_slot` has written the block."""
        table = self._ensure_staging()
        taken: list[StagedBlock] = []
        for key in keys:
            slot = self._free_slot(table)
            if slot is None:
                break
            taken.append(StagedBlock(key, parent, slot, table.begin_write(slot)))
            parent = key
        return taken

    def fill_slot(self, b: StagedBlock, row) -> StagedBlock:
        """Write a taken slot's block from `row` (uint8) and publish it READY, with its even gen.
        Touches only that slot, so the blocks of one put may be filled in threads side by side."""
        return StagedBlock(b.key, b.parent, b.slot,
                           self.staging.write_reserved(b.slot, b.gen, b.key, row, Flags.READY, parent=b.parent))

    def fill_slot_with(self, b: StagedBlock, write) -> StagedBlock:
        """As fill_slot, but `write(dst)` fills the slot's payload (a uint8 view of block_bytes)
        in place: a caller whose block is scattered (vLLM's per-layer pages) copies it once."""
        table = self.staging
        dst = table.payloads()[b.slot, : self.block_bytes]
        write(dst)
        return StagedBlock(b.key, b.parent, b.slot,
                           table.end_write(b.slot, b.gen, b.key, self.block_bytes, checksum(dst), Flags.READY, b.parent))

    def staged(self, blocks: list[StagedBlock]) -> None:
        now = time.monotonic()
        for b in blocks:
            self._staged_at[b.slot] = now

    def stage(self, keys: list[bytes], parent: bytes | None, kv: torch.Tensor) -> list[StagedBlock]:
        """Write blocks into free staging slots, here and now. Stops at the first block with no free slot."""
        taken = self.take_slots(keys, parent)
        try:
            rows = host_rows(kv, len(taken))
            blocks = [self.fill_slot(b, rows[i]) for i, b in enumerate(taken)]
        except BaseException:
            self.unstage(taken)
            raise
        self.staged(blocks)
        return blocks

    def unstage(self, staged: list[StagedBlock]) -> None:
        """The daemon never heard of these (publishing failed, or the fill did): make the slots
        reusable, including one left half written (odd gen)."""
        if self.staging is not None:
            for b in staged:
                if (g := self.staging.gen(b.slot)) % 2:
                    self.staging.end_write(b.slot, g, EMPTY_KEY, 0, 0, Flags.EMPTY)
                else:
                    self.staging.set_flags(b.slot, Flags.EMPTY)

    def _free_slot(self, table: SlotTable) -> int | None:
        for i in range(table.n):
            slot = (self._cursor + i) % table.n
            if table.flags(slot) == Flags.EMPTY and table.gen(slot) % 2 == 0:
                self._cursor = slot + 1
                return slot
        # None free. A slot the daemon has not released for STAGING_RECLAIM_S belongs to a put it
        # will never store (dead-lettered, or lost with a Redis restart): take it back, or the
        # client would stay full for ever. Safe even if the put turns up later: rewriting the
        # slot changes its generation, so the daemon's read of the old put fails verification.
        now = time.monotonic()
        for slot, at in sorted(self._staged_at.items(), key=lambda kv: kv[1]):
            if now - at < STAGING_RECLAIM_S:
                break
            if table.flags(slot) == Flags.READY and table.gen(slot) % 2 == 0:
                del self._staged_at[slot]
                return slot
            del self._staged_at[slot]
        return None

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
    def in_use(self):
        """Held while threads copy through this pool's mappings: a close meanwhile (the daemon
        restarted, the client closes) waits until they are done, rather than unmap under them."""
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._closing and not self._users:
                self._close_now()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not self._users:
            self._close_now()

    def _close_now(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging.seg.unlink()
            self.staging = None
        for table in self.tables.values():
            table.close()
        self.directory.seg.close()
