"""Slot tables: the fixed layout shared by the cpu arena, the gpu pool's headers and client staging.

Segment layout:
    [0, 4096)                 segment header (SEG below)
    [4096, 4096 + 128 * n)    slot headers, 128 bytes each
    [payload_off, ...)        n payloads of `stride` bytes (absent when the payload lives on a GPU)

Slot header (128 bytes): magic u32 | flags u32 | gen u64 | key 32s | length u64 | checksum u64 |
parent 32s (all zero for a chain head) | tag u64 | padding. The parent lets a restarted daemon
rebuild the prefix links of its index from the headers alone. The tag (`key_tag`) binds key to
checksum: two writers of a granted slot at once could mix one's key with the other's checksum.
`gen` is a seqlock: a writer makes it odd, writes, then makes it even again. A reader records
an even gen, copies, re-reads gen and verifies key, length and the xxh3 checksum of *its copy*.
So a torn, evicted or reused slot reads as a miss, never as wrong bytes. By protocol a slot has
one writer at a time (the daemon; a client for its staging slot, or its granted arena slot,
until it marks it READY). Were two to write at once, a reader still accepts only bytes a writer
hashed from its own source, under a header whose tag binds key and checksum.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, cast

import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.errors import SegmentError
from kvtier.shm.onepass import checksum as checksum  # re-exported: every reader verifies with it
from kvtier.shm.onepass import copy_hashed
from kvtier.shm.onepass import key_tag as key_tag  # re-exported: the header's tag (see the module's docstring)
from kvtier.shm.segment import ShmSegment

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from kvtier.shm.onepass import HashInput

    # A block's bytes to write: a bytes-like object or an array (its nbytes count).
    BlockData: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[Any]

SEG_MAGIC = b"KVTIER01"
SEG = struct.Struct("<8sIIQQQQ32sQQ")  # magic ver kind n block_bytes stride payload_off fp pid created
HEADER_OFF = 4096
SLOT_HDR = 128
SLOT_MAGIC = 0x4B56534C  # "KVSL"
PAGE = 4096
_HDR = struct.Struct("<IIQ32sQQ32s")
SLOT_HEADER = _HDR  # public: readers that go through a file descriptor parse it too
_GEN = struct.Struct("<Q")
_TAG = struct.Struct("<Q")
TAG_OFF = _HDR.size  # the tag follows the parent
_FLAGS = struct.Struct("<I")
LAYOUT_VERSION = 1
EMPTY_KEY = bytes(32)
# The slot header as a numpy record, for scanning a million headers without a Python loop.
HEADER_DTYPE = np.dtype([("magic", "<u4"), ("flags", "<u4"), ("gen", "<u8"), ("key", "V32"), ("length", "<u8"),
                         ("checksum", "<u8"), ("parent", "V32"), ("tag", "<u8"), ("pad", "V24")])
assert HEADER_DTYPE.itemsize == SLOT_HDR and _HDR.size <= SLOT_HDR


class Kind(IntEnum):
    """What a segment holds (its header says so; a reader checks it)."""

    ARENA = 1  # cpu tier (and the gpu tier when it runs on the CPU)
    GPU_HEADERS = 2  # headers only: the payload is a CUDA tensor shared by IPC
    STAGING = 3  # a client's outbox for put
    DISK = 4  # a disk tier's block file (kvtier/disk/blockfile.py): headers mapped, payloads by pread


class Flags(IntEnum):
    """A slot's state, one value per meaning (arena and staging slots share the header)."""

    EMPTY = 0  # no block: an arena slot not in use; a staging slot its client may write
    VALID = 1  # arena: the slot holds a visible block
    READY = 2  # staging: written by the client, waiting for the daemon


class SlotHeader(NamedTuple):
    magic: int
    flags: int
    gen: int
    key: bytes
    length: int
    checksum: int
    parent: bytes

    @property
    def parent_key(self) -> bytes | None:
        return None if self.parent == EMPTY_KEY else self.parent

    def ready(self, key: bytes, gen: int, block_bytes: int) -> bool:
        """A client's block (key, gen) written whole and READY (staged, or in a granted slot)."""
        return (self.magic == SLOT_MAGIC and self.flags == Flags.READY and self.gen == gen and gen % 2 == 0
                and self.key == key and self.length == block_bytes)


def checksum_parts(parts: Iterable[HashInput]) -> int:
    """checksum() of the parts' concatenation, without concatenating them."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(cast("ReadableBuffer", part))
    return h.intdigest()


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def segment_bytes(n: int, block_bytes: int, with_payload: bool = True) -> int:
    payload_off = round_up(HEADER_OFF + SLOT_HDR * n, PAGE)
    return payload_off + (round_up(block_bytes, PAGE) * n if with_payload else 0)


def parse_segment_header(head: bytes | memoryview, size: int, name: str, kind: int, fingerprint: bytes | None,
                         block_bytes: int | None) -> tuple[int, int, int, int, bytes]:
    """Check a segment header (untrusted bytes) against the segment's size and what we expect.
    Returns (slots, block_bytes, stride, payload_off, fingerprint)."""
    if size < HEADER_OFF or len(head) < SEG.size:
        raise SegmentError(f"segment {name} is too small to hold a header")
    magic, ver, k, n, bb, stride, payload_off, fp, _pid, _ts = SEG.unpack_from(head, 0)
    if magic != SEG_MAGIC or ver != LAYOUT_VERSION:
        raise SegmentError(f"segment {name} has a bad magic or version")
    if k != kind:
        raise SegmentError(f"segment {name} is of kind {k}, expected {kind}")
    if fingerprint is not None and fp != fingerprint:
        raise SegmentError(f"segment {name} holds another layout")
    if block_bytes is not None and bb != block_bytes:
        raise SegmentError(f"segment {name} has block size {bb}, expected {block_bytes}")
    with_payload = kind != Kind.GPU_HEADERS
    if (n <= 0 or bb <= 0 or stride != round_up(bb, PAGE)
            or payload_off != round_up(HEADER_OFF + SLOT_HDR * n, PAGE)
            or size < segment_bytes(n, bb, with_payload)):
        raise SegmentError(f"segment {name} geometry does not match its size")
    return n, bb, stride, payload_off, fp


@dataclass(slots=True)
class SlotTable:
    seg: ShmSegment
    kind: int
    n: int
    block_bytes: int
    stride: int
    payload_off: int
    fingerprint: bytes
    _payloads: npt.NDArray[np.uint8] | None = None

    # --- creation and validation ------------------------------------------------------------

    @classmethod
    def format(cls, seg: ShmSegment, kind: int, n: int, block_bytes: int, fingerprint: bytes) -> SlotTable:
        with_payload = kind != Kind.GPU_HEADERS
        if seg.size < segment_bytes(n, block_bytes, with_payload):
            raise SegmentError(f"segment {seg.name} too small for {n} slots")
        stride = round_up(block_bytes, PAGE)
        payload_off = round_up(HEADER_OFF + SLOT_HDR * n, PAGE)
        if not seg.fresh:  # a new file reads as zeros already (a million slots: 128 MiB to skip)
            seg.buf[HEADER_OFF : HEADER_OFF + SLOT_HDR * n] = bytes(SLOT_HDR * n)
        SEG.pack_into(
            seg.buf, 0, SEG_MAGIC, LAYOUT_VERSION, kind, n, block_bytes, stride, payload_off,
            fingerprint, os.getpid(), time.time_ns(),
        )
        return cls(seg, kind, n, block_bytes, stride, payload_off, fingerprint)

    @classmethod
    def open(cls, seg: ShmSegment, kind: int, fingerprint: bytes | None = None,
             block_bytes: int | None = None) -> SlotTable:
        """Validate an existing segment's header against its size and what we expect."""
        n, bb, stride, payload_off, fp = parse_segment_header(
            seg.buf[:HEADER_OFF] if seg.size >= HEADER_OFF else b"", seg.size, seg.name, kind, fingerprint,
            block_bytes)
        return cls(seg, kind, n, bb, stride, payload_off, fp)

    @property
    def owner_pid(self) -> int:
        pid: int = SEG.unpack_from(self.seg.buf, 0)[8]
        return pid

    def close(self) -> None:
        """Drop the payload view, then unmap the segment (the view must go first: a live numpy
        view keeps the mapping exported and close() would fail)."""
        self._payloads = None
        self.seg.close()

    # --- payload views -------------------------------------------------------------------------

    def payloads(self) -> npt.NDArray[np.uint8]:
        """All payloads as a [n, stride] uint8 array over the shared mapping (no copy)."""
        if self.kind == Kind.GPU_HEADERS:
            raise SegmentError("payloads of this table live on a GPU")
        if self._payloads is None:
            flat = np.frombuffer(self.seg.buf, dtype=np.uint8, count=self.n * self.stride, offset=self.payload_off)
            self._payloads = flat.reshape(self.n, self.stride)
        return self._payloads

    def payload(self, slot: int) -> npt.NDArray[np.uint8]:
        return self.payloads()[slot, : self.block_bytes]

    # --- headers -------------------------------------------------------------------------------

    def _off(self, slot: int) -> int:
        if not 0 <= slot < self.n:
            raise IndexError(f"slot {slot} outside [0, {self.n})")
        return HEADER_OFF + SLOT_HDR * slot

    def headers(self, lo: int, hi: int) -> npt.NDArray[Any]:
        """Slots [lo, hi)'s headers as HEADER_DTYPE records over the mapping (no copy)."""
        if not 0 <= lo <= hi <= self.n:
            raise IndexError(f"slots {lo}..{hi} outside [0, {self.n}]")
        return np.frombuffer(self.seg.buf, dtype=HEADER_DTYPE, count=hi - lo, offset=HEADER_OFF + SLOT_HDR * lo)

    def header(self, slot: int) -> SlotHeader:
        return SlotHeader(*_HDR.unpack_from(self.seg.buf, self._off(slot)))

    def gen(self, slot: int) -> int:
        g: int = _GEN.unpack_from(self.seg.buf, self._off(slot) + 8)[0]
        return g

    def flags(self, slot: int) -> int:
        f: int = _FLAGS.unpack_from(self.seg.buf, self._off(slot) + 4)[0]
        return f

    def set_flags(self, slot: int, flags: int) -> None:
        _FLAGS.pack_into(self.seg.buf, self._off(slot) + 4, flags)

    def begin_write(self, slot: int) -> int:
        """Mark the slot as being written (odd gen); readers now fail. Returns the odd gen."""
        off = self._off(slot)
        g: int = _GEN.unpack_from(self.seg.buf, off + 8)[0]
        g = g + 1 if g % 2 == 0 else g + 2  # recover from a writer that died mid-write
        _GEN.pack_into(self.seg.buf, off + 8, g)
        return g

    def end_write(self, slot: int, odd_gen: int, key: bytes, length: int, csum: int, flags: int,
                  parent: bytes | None = None) -> int:
        """Publish key, length, checksum and parent, then make gen even. Returns the new even gen."""
        off = self._off(slot)
        _HDR.pack_into(self.seg.buf, off, SLOT_MAGIC, flags, odd_gen, key, length, csum, parent or EMPTY_KEY)
        _TAG.pack_into(self.seg.buf, off + TAG_OFF, key_tag(key, csum))
        _GEN.pack_into(self.seg.buf, off + 8, odd_gen + 1)
        return odd_gen + 1

    def invalidate(self, slot: int) -> None:
        g = self.begin_write(slot)
        self.end_write(slot, g, EMPTY_KEY, 0, 0, Flags.EMPTY)

    def write(self, slot: int, key: bytes, data: BlockData, flags: int = Flags.VALID, csum: int | None = None,
              parent: bytes | None = None) -> int:
        """Seqlock-write a payload that lives in this segment. Returns the new even gen."""
        self._length(data)  # before the slot is touched
        return self.write_reserved(slot, self.begin_write(slot), key, data, flags, csum, parent)

    def _length(self, data: BlockData) -> int:
        length = len(data) if not isinstance(data, np.ndarray) else data.nbytes
        if length > self.block_bytes:
            raise ValueError(f"payload of {length} bytes exceeds the block size {self.block_bytes}")
        return length

    def write_reserved(self, slot: int, g: int, key: bytes, data: BlockData, flags: int = Flags.VALID,
                       csum: int | None = None, parent: bytes | None = None) -> int:
        """The rest of `write`, for a slot already marked by `begin_write` (odd gen `g`): taken
        on the event loop, filled in a thread. Raises (slot left odd) if data is too big."""
        length = self._length(data)
        dst = self.payloads()[slot, :length]
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        if csum is None:
            csum = copy_hashed(dst, src, hash_src=True)  # one pass; the source hashed, never the slot
        else:
            np.copyto(dst, src.reshape(-1).view(np.uint8))
        return self.end_write(slot, g, key, length, csum, flags, parent)

    # --- verified reads ------------------------------------------------------------------------

    def begin_read(self, slot: int, key: bytes, flags: int = Flags.VALID) -> tuple[int, int] | None:
        """(gen, checksum) when the slot holds `key` as a complete block, else None."""
        off = self._off(slot)
        h = SlotHeader(*_HDR.unpack_from(self.seg.buf, off))
        if (h.magic != SLOT_MAGIC or h.gen % 2 or h.flags != flags or h.key != key
                or h.length != self.block_bytes
                or _TAG.unpack_from(self.seg.buf, off + TAG_OFF)[0] != key_tag(key, h.checksum)):
            return None
        return h.gen, h.checksum

    def end_read(self, slot: int, gen: int, key: bytes) -> bool:
        h = SlotHeader(*_HDR.unpack_from(self.seg.buf, self._off(slot)))
        return h.gen == gen and h.key == key

    def read_into(self, slot: int, key: bytes, dst: npt.NDArray[np.uint8], flags: int = Flags.VALID) -> int | None:
        """Copy the block into `dst` (uint8, block_bytes) and verify it. Returns its checksum or None.
        The copy and the hash of what landed are one pass (shm/onepass.py)."""
        snap = self.begin_read(slot, key, flags)
        if snap is None:
            return None
        gen, csum = snap
        got = copy_hashed(dst, self.payloads()[slot, : self.block_bytes])
        if not self.end_read(slot, gen, key) or got != csum:
            return None
        return csum

    def read_with(self, slot: int, key: bytes, copy_out: Callable[[npt.NDArray[np.uint8]], object],
                  digest: Callable[[], int], flags: int = Flags.VALID) -> int | None:
        """The seqlock read: `copy_out(src)` copies the payload out (one array, or vLLM's per-layer
        pages), then `digest()` hashes what landed, in payload order. Returns the checksum, or
        None for a torn, replaced or corrupt block, whose copied bytes the caller must not use."""
        snap = self.begin_read(slot, key, flags)
        if snap is None:
            return None
        gen, csum = snap
        copy_out(self.payloads()[slot, : self.block_bytes])
        if not self.end_read(slot, gen, key) or digest() != csum:
            return None
        return csum
