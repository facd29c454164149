"""The shared-memory directory: block key -> (gpu, cpu, disk slot), for lookups without a round trip.

An open-addressing table with linear probing in its own segment. The daemon is the only writer
and keeps a private dict of where each key sits, so updates are O(1). Clients only read. An entry
is a hint: the client confirms it against the slot header, so a torn or stale entry costs a miss,
never wrong data. Deletion shifts later entries back (no tombstones to rebuild); a reader racing a
shift can miss a key for that instant, which is again only a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier.errors import SegmentError
from kvtier.keys import KEY_BYTES
from kvtier.shm.onepass import compiled
from kvtier.shm.segment import ShmSegment

DIR_MAGIC = b"KVTDIR01"
_HEAD = struct.Struct("<8sQ32s")
# used, gpu slot, cpu slot, flags, key, disk slot (in what were 16 pad bytes: the entry size is unchanged)
_ENTRY = struct.Struct("<IiiI32si12x")
ENTRY_OFF = 4096
ENTRY_BYTES = _ENTRY.size
_WORDS = ENTRY_BYTES // 4  # an entry's size in u32 words: its `used` word is the first
NO_SLOT = -1
IN_REDIS = 1  # flags bit: the daemon wrote this block to Redis
# A batch this big or bigger goes to the compiled insert when all its keys are new: below it the
# call's set-up costs more than the probe it saves (one key: 3.2 us in Python, 4.3 compiled).
COMPILED_MIN_KEYS = 8
_COLUMN = (0, 1, 3)  # a tier's index (gpu 0, cpu 1, disk 2) -> its place in a row [gpu, cpu, flags, disk]


def directory_capacity(blocks: int) -> int:
    """A power of two at least twice the number of local slots, so probes stay short."""
    cap = 64
    while cap < 2 * blocks:
        cap *= 2
    return cap


def directory_bytes(capacity: int) -> int:
    return ENTRY_OFF + ENTRY_BYTES * capacity


# An entry as a numpy record, for probing a batch of keys at once (DirectoryReader.cpu_slots).
_ENTRY_DTYPE = np.dtype([("used", "<u4"), ("gpu", "<i4"), ("cpu", "<i4"), ("flags", "<u4"), ("key", "V32"),
                         ("disk", "<i4"), ("pad", "V12")])
assert _ENTRY_DTYPE.itemsize == ENTRY_BYTES


def _home(key: bytes, mask: int) -> int:
    return int.from_bytes(key[:8], "little") & mask


def _homes(joined: bytes, mask: int) -> npt.NDArray[np.int64]:
    """`_home` of each key of `joined` (whole 32-byte keys), from the one join."""
    return np.frombuffer(joined, dtype="<u8").reshape(-1, KEY_BYTES // 8)[:, 0].astype(np.int64) & mask


class DirectoryReader:
    """Client side: probe for a key. Never writes."""

    def __init__(self, seg: ShmSegment, fingerprint: bytes | None = None) -> None:
        magic, cap, fp = _HEAD.unpack_from(seg.buf, 0)
        if magic != DIR_MAGIC or cap <= 0 or cap & (cap - 1) or seg.size < directory_bytes(cap):
            raise SegmentError(f"segment {seg.name} is not a valid directory")
        if fingerprint is not None and fp != fingerprint:
            raise SegmentError(f"directory {seg.name} belongs to another layout")
        self.seg = seg
        self.capacity = cap
        self._mask = cap - 1

    def find(self, key: bytes) -> tuple[int, int, int, int] | None:
        """(gpu_slot, cpu_slot, flags, disk_slot) for `key`, or None."""
        buf, mask, unpack = self.seg.buf, self._mask, _ENTRY.unpack_from
        i = _home(key, mask)
        for _ in range(self.capacity):
            used, gpu, cpu, flags, k, disk = unpack(buf, ENTRY_OFF + i * ENTRY_BYTES)
            if not used:
                return None
            if k == key:
                return gpu, cpu, flags, disk
            i = (i + 1) & mask
        return None


    def cpu_slots(self, keys: Sequence[bytes], probes: int = 4) -> npt.NDArray[np.int64]:
        """For each key, its cpu slot when the directory lists it there and in no gpu slot, else
        NO_SLOT (absent, elsewhere, or found only past `probes` buckets: the caller asks `find`).
        The keys' buckets are probed together, a bucket at a time: per-key work a batch of
        reads skips. A hint, like `find`: the slot's header is what a read verifies."""
        joined = b"".join(keys)
        want = np.frombuffer(joined, dtype="V32")
        at = _homes(joined, self._mask)
        table = np.frombuffer(self.seg.buf, dtype=_ENTRY_DTYPE, count=self.capacity, offset=ENTRY_OFF)
        out = np.full(len(keys), NO_SLOT, dtype=np.int64)
        todo = np.arange(len(keys))
        for _ in range(probes):
            rows = table[at[todo]]  # a snapshot: the table may change under us
            found = (rows["used"] != 0) & (rows["key"] == want[todo])
            listed = found & (rows["gpu"] == NO_SLOT)
            out[todo[listed]] = rows["cpu"][listed]
            todo = todo[(rows["used"] != 0) & ~found]  # an empty bucket ends a key's probe
            if not todo.size:
                break
            at[todo] = (at[todo] + 1) & self._mask
        return out


class DirectoryWriter(DirectoryReader):
    """Daemon side. Single writer; keeps `self._rows` (key -> its row and bucket) in step with the table."""

    def __init__(self, seg: ShmSegment) -> None:
        super().__init__(seg)
        # key -> [gpu, cpu, flags, disk, bucket]: one dict, as a put inserts thousands of keys a second
        self._rows: dict[bytes, list[int]] = {}
        # A batch of new keys probed and written compiled (None: not built here, and Python does it)
        self._insert: Callable[..., None] | None = compiled("dir_insert")

    @classmethod
    def create(cls, seg: ShmSegment, capacity: int, fingerprint: bytes) -> DirectoryWriter:
        if not seg.fresh:  # a new file reads as zeros already
            seg.buf[: directory_bytes(capacity)] = bytes(directory_bytes(capacity))
        _HEAD.pack_into(seg.buf, 0, DIR_MAGIC, capacity, fingerprint)
        return cls(seg)

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes) -> tuple[int, int, int, int] | None:
        row = self._rows.get(key)
        return None if row is None else (row[0], row[1], row[2], row[3])

    def set_slot(self, key: bytes, tier_index: int, slot: int) -> None:
        """tier_index 0 = gpu, 1 = cpu, 2 = disk (kvtier.core.events.Tier)."""
        self.set_slots(tier_index, (key,), (slot,))

    def set_slots(self, tier_index: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """`set_slot` for each key of a batch, in order: one call, with the insert's probe inline
        (a put of small blocks lists thousands a second): the homes taken for the batch at once,
        and a bucket's `used` word read through a view of the table, not unpacked. A batch of
        COMPILED_MIN_KEYS keys or more, all new and each once, goes to the compiled insert
        (kvtier/shm/native/copy_hash.c `dir_insert`)."""
        col = _COLUMN[tier_index]
        rows, mask, buf = self._rows, self._mask, self.seg.buf
        pack = _ENTRY.pack_into
        joined = b"".join(keys)
        if len(joined) != KEY_BYTES * len(keys):
            raise ValueError(f"directory keys are {KEY_BYTES} bytes")
        homes = _homes(joined, mask)
        with buf[ENTRY_OFF:ENTRY_OFF + self.capacity * ENTRY_BYTES] as entries, entries.cast("I") as used:
            if (self._insert is not None and len(keys) >= COMPILED_MIN_KEYS and rows.keys().isdisjoint(keys)
                    and len(rows) + len(keys) < self.capacity - 1 and NO_SLOT not in slots
                    and len(set(keys)) == len(keys)):
                # A batch of new keys, each once (a put's: the common batch), probed and written
                # compiled, as the loop below would: 62-90 us a batch of 64 there, 38-44 here.
                at = np.empty(len(keys), dtype=np.int64)
                self._insert(entries, joined, homes, np.array(slots, dtype=np.int64), tier_index, at)
                for key, slot, i in zip(keys, slots, at.tolist()):
                    new = [NO_SLOT, NO_SLOT, 0, NO_SLOT, i]
                    new[col] = slot
                    rows[key] = new
                return
            for key, slot, i in zip(keys, slots, homes.tolist()):  # `used`: entry i's word at i * _WORDS
                row = rows.get(key)
                if row is None:
                    if slot == NO_SLOT:
                        continue
                    if len(rows) >= self.capacity - 1:
                        raise SegmentError("directory is full")  # cannot happen: capacity >= 2 x slots
                    while used[i * _WORDS]:  # linear probing from the key's home bucket
                        i = (i + 1) & mask
                    row = [NO_SLOT, NO_SLOT, 0, NO_SLOT, i]
                    row[col] = slot
                    rows[key] = row
                else:
                    row[col] = slot
                    if row[0] == NO_SLOT and row[1] == NO_SLOT and row[3] == NO_SLOT:
                        self._delete(key)
                        continue
                    i = row[4]
                pack(buf, ENTRY_OFF + i * ENTRY_BYTES, 1, row[0], row[1], row[2], key, row[3])

    def set_flag(self, key: bytes, flag: int, on: bool) -> None:
        row = self._rows.get(key)
        if row is None:
            return  # only blocks resident in a local tier are listed
        row[2] = (row[2] | flag) if on else (row[2] & ~flag)
        self._store(key, row)

    def _store(self, key: bytes, row: list[int]) -> None:  # row: [gpu, cpu, flags, disk, bucket]
        if row[0] == NO_SLOT and row[1] == NO_SLOT and row[3] == NO_SLOT:
            self._delete(key)
        else:
            self._write(row[4], key, row)

    def _write(self, i: int, key: bytes, row: list[int]) -> None:
        _ENTRY.pack_into(self.seg.buf, ENTRY_OFF + i * ENTRY_BYTES, 1, row[0], row[1], row[2], key, row[3])

    def _delete(self, key: bytes) -> None:
        i = self._rows.pop(key)[4]
        mask = self._mask
        j = i
        while True:
            j = (j + 1) & mask
            used, _gpu, _cpu, _flags, kj, _disk = _ENTRY.unpack_from(self.seg.buf, ENTRY_OFF + j * ENTRY_BYTES)
            if not used:
                break
            h = _home(kj, mask)
            # Entry j may move into the hole at i only if its home does not lie in (i, j].
            stays = (i < h <= j) if i <= j else (h > i or h <= j)
            if stays:
                continue
            moved = self._rows[kj]
            self._write(i, kj, moved)
            moved[4] = i
            i = j
        _ENTRY.pack_into(self.seg.buf, ENTRY_OFF + i * ENTRY_BYTES, 0, NO_SLOT, NO_SLOT, 0, bytes(32), NO_SLOT)
