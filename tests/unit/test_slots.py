"""Shared-memory segments, slot tables and the client directory, on real POSIX shared memory.

Every segment is named `kvtier.test-<uuid8>.*`, unlinked by a finalizer, and the module checks
at the end that nothing with its prefix is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import SegmentError
from kvtier.layout import BlockLayout
from kvtier.shm.directory import (
    IN_REDIS,
    NO_SLOT,
    DirectoryReader,
    DirectoryWriter,
    directory_bytes,
    directory_capacity,
)
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slot_batch import holds, read_rows
from kvtier.shm.slots import Flags, Kind, SlotTable, checksum, segment_bytes
from tests.support.segments import segment_factory
from tests.support.waiting import wait_until

PREFIX = f"kvtier.test-{uuid.uuid4().hex[:8]}."
SHM = Path("/dev/shm")
FP = BlockLayout("m", 2, 2, 4, 16, "float16").fingerprint
OTHER_FP = BlockLayout("m", 2, 2, 4, 16, "bfloat16").fingerprint
BB = 1000  # not page-aligned on purpose
KA, KB, PARENT = b"A" * 32, b"B" * 32, b"P" * 32


@pytest.fixture(scope="module", autouse=True)
def nothing_left_in_dev_shm() -> Iterator[None]:
    yield
    left = sorted(p.name for p in SHM.iterdir() if p.name.startswith(PREFIX))
    for name in left:
        (SHM / name).unlink()
    assert left == [], f"segments left behind: {left}"


@pytest.fixture
def new_seg() -> Iterator[Callable[..., ShmSegment]]:
    """Factory: create a uniquely named segment; all are closed and unlinked afterwards."""
    with segment_factory(PREFIX) as make:
        yield make


def arena(new_seg, n: int = 4, bb: int = BB, kind: int = Kind.ARENA) -> SlotTable:
    seg = new_seg(segment_bytes(n, bb, kind != Kind.GPU_HEADERS))
    return SlotTable.format(seg, kind, n, bb, FP)


def block(fill: int, bb: int = BB) -> np.ndarray:
    return (np.arange(bb, dtype=np.uint32) * 7 + fill).astype(np.uint8)


# --- ShmSegment ----------------------------------------------------------------------------------


def test_create_is_exclusive_and_mode_is_exactly_0600(new_seg) -> None:
    seg = new_seg(8192)
    st_ = os.stat(SHM / seg.name)
    assert st_.st_mode & 0o7777 == 0o600 and st_.st_size == 8192 and st_.st_uid == os.geteuid()
    with pytest.raises(SegmentError, match="already exists"):
        ShmSegment.create(seg.name, 8192)
    assert os.stat(SHM / seg.name).st_ino == st_.st_ino


def test_create_sets_the_mode_despite_the_umask(new_seg) -> None:
    old = os.umask(0o077)
    try:
        seg = new_seg(4096, mode=0o640)
    finally:
        os.umask(old)
    assert os.stat(SHM / seg.name).st_mode & 0o777 == 0o640


@pytest.mark.parametrize("name", ["", "a/b", "../etc", "x" * 201, "sp ace"])
def test_invalid_names_are_refused(name: str) -> None:
    with pytest.raises(SegmentError, match="invalid"):
        ShmSegment.create(name, 4096)
    with pytest.raises(SegmentError):
        ShmSegment.attach(name)


def test_name_with_trailing_newline_is_refused() -> None:
    name = f"{PREFIX}nl\n"
    try:
        with pytest.raises(SegmentError):
            ShmSegment.create(name, 4096).close()
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_create_refuses_a_planted_symlink_and_bad_sizes(new_seg) -> None:
    target = new_seg(4096)
    link = f"{PREFIX}link"
    (SHM / link).symlink_to(SHM / target.name)
    try:
        with pytest.raises(SegmentError):
            ShmSegment.create(link, 4096)
        with pytest.raises(SegmentError):
            ShmSegment.attach(link)  # O_NOFOLLOW
    finally:
        (SHM / link).unlink()
    with pytest.raises(SegmentError, match="positive"):
        ShmSegment.create(f"{PREFIX}zero", 0)
    assert not ShmSegment.exists(f"{PREFIX}zero")


def test_attach_checks_owner_and_permissions(new_seg) -> None:
    seg = new_seg(4096)
    seg.buf[:5] = b"hello"
    other = ShmSegment.attach(seg.name, trusted_uid=os.geteuid())
    assert bytes(other.buf[:5]) == b"hello" and other.size == 4096 and not other.owner
    other.close()
    with pytest.raises(SegmentError, match="owned by uid"):
        ShmSegment.attach(seg.name, trusted_uid=os.geteuid() + 1)
    os.chmod(SHM / seg.name, 0o666)
    with pytest.raises(SegmentError, match="writable by others"):
        ShmSegment.attach(seg.name)
    with pytest.raises(SegmentError, match="does not exist"):
        ShmSegment.attach(f"{PREFIX}missing")
    assert ShmSegment.unlink_name(seg.name) and not ShmSegment.unlink_name(seg.name)


# --- SlotTable -----------------------------------------------------------------------------------


def test_format_and_open_roundtrip_over_a_second_mapping(new_seg) -> None:
    t = arena(new_seg, n=5)
    ro = ShmSegment.attach(t.seg.name)
    o = SlotTable.open(ro, Kind.ARENA, FP, BB)
    assert (o.kind, o.n, o.block_bytes, o.stride, o.payload_off, o.fingerprint) == (Kind.ARENA, 5, BB, 4096, 8192, FP)
    assert o.owner_pid == os.getpid()
    assert all(o.header(i).magic == 0 and o.gen(i) == 0 for i in range(5))
    ro.close()


def test_open_rejects_mismatches(new_seg) -> None:
    t = arena(new_seg)
    with pytest.raises(SegmentError, match="kind"):
        SlotTable.open(t.seg, Kind.STAGING, FP, BB)
    with pytest.raises(SegmentError, match="another layout"):
        SlotTable.open(t.seg, Kind.ARENA, OTHER_FP, BB)
    with pytest.raises(SegmentError, match="block size"):
        SlotTable.open(t.seg, Kind.ARENA, FP, BB + 1)
    with pytest.raises(SegmentError, match="magic"):
        SlotTable.open(new_seg(segment_bytes(4, BB)), Kind.ARENA)
    with pytest.raises(SegmentError, match="too small"):
        SlotTable.format(new_seg(segment_bytes(4, BB) - 1), Kind.ARENA, 4, BB, FP)
    headers_only = arena(new_seg, n=2, kind=Kind.GPU_HEADERS)  # payload lives on a GPU
    assert SlotTable.open(headers_only.seg, Kind.GPU_HEADERS, FP, BB).n == 2
    with pytest.raises(SegmentError, match="GPU"):
        headers_only.payloads()


def test_open_rejects_a_truncated_segment(new_seg) -> None:
    t = arena(new_seg, n=4)
    os.truncate(SHM / t.seg.name, segment_bytes(4, BB) - 4096)
    short = ShmSegment.attach(t.seg.name)
    try:
        with pytest.raises(SegmentError, match="geometry"):
            SlotTable.open(short, Kind.ARENA, FP, BB)
    finally:
        short.close()


def test_write_then_read_returns_the_exact_bytes_and_parent(new_seg) -> None:
    t = arena(new_seg)
    data = block(3)
    g = t.write(2, KA, data, parent=PARENT)
    assert g == 2 and t.gen(2) == 2 and t.flags(2) == Flags.VALID
    h = t.header(2)
    assert (h.key, h.length, h.checksum, h.parent_key) == (KA, BB, checksum(data), PARENT)
    out = np.zeros(BB, np.uint8)
    assert t.read_into(2, KA, out) == checksum(data)
    assert np.array_equal(out, data)
    assert t.write(1, KB, data.tobytes()) == 2 and t.header(1).parent_key is None
    assert t.write(2, KB, block(9)) == 4  # a rewrite bumps gen by two


def test_reads_that_must_miss(new_seg) -> None:
    t = arena(new_seg)
    out = np.zeros(BB, np.uint8)
    t.write(0, KA, block(1))
    assert t.read_into(0, KB, out) is None  # wrong key
    assert t.read_into(0, KA, out, flags=Flags.READY) is None  # wrong flags
    assert t.read_into(1, KA, out) is None  # empty slot
    t.write(1, KA, block(1)[: BB - 1])
    assert t.read_into(1, KA, out) is None  # short payload
    t.begin_write(0)  # a writer that never finished
    assert t.gen(0) % 2 == 1 and t.read_into(0, KA, out) is None
    t.write(0, KA, block(1))
    assert t.gen(0) % 2 == 0 and t.read_into(0, KA, out) is not None  # recovers
    t.payloads()[0, 17] ^= 0xFF  # corrupt one payload byte behind the header's back
    assert t.read_into(0, KA, out) is None
    t.write(0, KA, block(1))
    t.invalidate(0)
    assert t.read_into(0, KA, out) is None and t.header(0).key == bytes(32)
    with pytest.raises(IndexError):
        t.header(4)


def test_read_rows_reads_a_batch_like_read_into_and_misses_the_same(new_seg) -> None:
    """slot_batch.read_rows (a client's batch get) against read_into, block by block: the same
    bytes for the blocks that check out, and a miss for a wrong key, an empty slot, a torn slot
    (odd gen), a corrupt payload, a slot out of range; rows it misses are left to the caller."""
    t = arena(new_seg)
    for slot, (key, seed) in enumerate([(KA, 1), (KB, 2), (PARENT, 3)]):
        t.write(slot, key, block(seed))
    out = np.zeros((6, BB), np.uint8)
    slots = np.array([0, 1, 2, 3, 9, -1], np.int64)
    keys = [KA, KB, KB, KA, KA, KA]  # row 2: slot 2 holds PARENT, not KB; row 3: empty slot
    assert read_rows(t, slots, keys, out, range(6)) == [True, True, False, False, False, False]
    assert np.array_equal(out[0], block(1)) and np.array_equal(out[1], block(2))
    # Rows land where `rows` says, and a torn or corrupt slot is a miss.
    t.begin_write(0)
    t.payloads()[1, 5] ^= 0xFF
    out[:] = 0
    assert read_rows(t, np.array([2, 0, 1], np.int64), [PARENT, KA, KB], out, [4, 0, 1]) == [True, False, False]
    assert np.array_equal(out[4], block(3))


def test_holds_answers_for_a_batch_as_begin_read_does_for_each(new_seg) -> None:
    """slot_batch.holds (a client's batch lookup) against begin_read, slot by slot: a hit for a
    complete block under its key; a miss for a wrong key, an empty slot, a slot out of range, a
    torn slot (odd gen) and a header whose tag does not bind its key to its checksum."""
    from kvtier.shm.slots import HEADER_OFF, SLOT_HDR, TAG_OFF

    t = arena(new_seg)
    for slot, (key, seed) in enumerate([(KA, 1), (KB, 2), (PARENT, 3)]):
        t.write(slot, key, block(seed))
    slots = np.array([0, 1, 2, 2, 3, 9, -1], np.int64)
    keys = [KA, KB, PARENT, KB, KA, KA, KA]

    def one_by_one() -> list[bool]:
        return [0 <= s < t.n and t.begin_read(int(s), k) is not None for s, k in zip(slots.tolist(), keys)]

    assert holds(t, slots, keys).tolist() == one_by_one() == [True, True, True, False, False, False, False]
    t.begin_write(0)  # torn
    off = HEADER_OFF + 1 * SLOT_HDR + TAG_OFF
    t.seg.buf[off] ^= 0xFF  # slot 1's tag no longer binds KB to its checksum
    assert holds(t, slots, keys).tolist() == one_by_one() == [False, False, True, False, False, False, False]


WRITER = r"""
import sys, time
import numpy as np
from kvtier.shm.segment import ShmSegment
from kvtier.shm.slots import Kind, SlotTable, checksum
name, bb, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t = SlotTable.open(ShmSegment.attach(name, writable=True), Kind.ARENA, block_bytes=bb)
pats = [(b"A" * 32, np.full(bb, 0xA5, np.uint8)), (b"B" * 32, np.full(bb, 0x5A, np.uint8))]
pats = [(k, p, checksum(p)) for k, p in pats]
end, n = time.monotonic() + secs, 0
while time.monotonic() < end:
    k, p, c = pats[n % 2]
    t.write(0, k, p, csum=c)
    n += 1
print(n)
"""


def test_no_torn_read_against_a_writer_process(new_seg) -> None:
    bb = 16 << 10
    t = arena(new_seg, n=1, bb=bb)
    expect = {KA: np.full(bb, 0xA5, np.uint8), KB: np.full(bb, 0x5A, np.uint8)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, t.seg.name, str(bb), "1.5"], stdout=subprocess.PIPE)
    try:
        wait_until(lambda: t.gen(0) >= 4 or proc.poll() is not None, timeout=30, message="writer started")
        out = np.empty(bb, np.uint8)
        ok = {KA: 0, KB: 0}
        attempts = false = 0
        while proc.poll() is None:
            key = KA if attempts % 2 else KB
            attempts += 1
            out.fill(0)
            if t.read_into(0, key, out) is not None:
                ok[key] += 1
                false += not np.array_equal(out, expect[key])
        writes = int(proc.communicate(timeout=30)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and writes > 100
    assert false == 0, f"{false} reads returned bytes of another key or a torn copy"
    assert ok[KA] > 0 and ok[KB] > 0, (ok, attempts, writes)


# --- directory -----------------------------------------------------------------------------------


def directory(new_seg, cap: int = 64) -> tuple[DirectoryWriter, DirectoryReader]:
    seg = new_seg(directory_bytes(cap))
    w = DirectoryWriter.create(seg, cap, FP)
    return w, DirectoryReader(ShmSegment.attach(seg.name), FP)


def hkey(home: int, tag: int) -> bytes:
    """A key whose home bucket (low bits of its first 8 bytes, little-endian) is `home`."""
    return home.to_bytes(8, "little") + tag.to_bytes(24, "big")


def test_directory_capacity_and_validation(new_seg) -> None:
    assert [directory_capacity(b) for b in (0, 32, 33, 1000)] == [64, 64, 128, 2048]
    w, _ = directory(new_seg)
    with pytest.raises(SegmentError, match="another layout"):
        DirectoryReader(w.seg, OTHER_FP)
    with pytest.raises(SegmentError, match="not a valid directory"):
        DirectoryReader(new_seg(directory_bytes(64)))


def test_set_slot_get_find_flags_and_delete(new_seg) -> None:
    w, r = directory(new_seg)
    w.set_slot(KA, 1, NO_SLOT)  # clearing an absent key is a no-op
    assert len(w) == 0 and r.find(KA) is None
    w.set_slot(KA, 1, 5)
    assert w.get(KA) == r.find(KA) == (NO_SLOT, 5, 0, NO_SLOT)
    w.set_slot(KA, 0, 2)
    assert r.find(KA) == (2, 5, 0, NO_SLOT)
    w.set_flag(KA, IN_REDIS, True)
    w.set_flag(KB, IN_REDIS, True)  # absent: ignored
    assert r.find(KA) == (2, 5, IN_REDIS, NO_SLOT) and r.find(KB) is None and len(w) == 1
    w.set_slot(KA, 1, NO_SLOT)
    assert r.find(KA) == (2, NO_SLOT, IN_REDIS, NO_SLOT)
    w.set_flag(KA, IN_REDIS, False)
    assert r.find(KA) == (2, NO_SLOT, 0, NO_SLOT)
    w.set_slot(KA, 2, 7)  # the disk column (tier index 2)
    assert r.find(KA) == (2, NO_SLOT, 0, 7)
    w.set_slot(KA, 0, NO_SLOT)
    assert r.find(KA) == (NO_SLOT, NO_SLOT, 0, 7), "listed while only the disk tier holds it"
    w.set_slot(KA, 2, NO_SLOT)
    assert r.find(KA) is None and w.get(KA) is None and len(w) == 0


def test_backward_shift_delete_across_the_wraparound(new_seg) -> None:
    w, r = directory(new_seg)
    cluster = [hkey(62, 0), hkey(62, 1), hkey(63, 2), hkey(62, 3), hkey(0, 4), hkey(1, 5), hkey(63, 6)]
    for i, key in enumerate(cluster):
        w.set_slot(key, 1, i)
    for gone in (hkey(62, 1), hkey(62, 0), hkey(0, 4)):
        w.set_slot(gone, 1, NO_SLOT)
        cluster.remove(gone)
        assert r.find(gone) is None
        for key in cluster:
            assert r.find(key) == w.get(key) and r.find(key) is not None


# 40 keys whose homes crowd a 64-bucket table: clusters, wrap-arounds and backward shifts
MODEL_KEYS = [hkey(h, i) for i, h in enumerate([0, 1, 2, 61, 62, 63, 5, 30] * 5)]


@contextlib.contextmanager
def model_directory() -> Iterator[tuple[DirectoryWriter, DirectoryReader]]:
    """A 64-bucket directory and its reader, on a segment of its own, for the model tests."""
    seg = ShmSegment.create(f"{PREFIX}{uuid.uuid4().hex[:6]}", directory_bytes(64))
    try:
        yield DirectoryWriter.create(seg, 64, FP), DirectoryReader(seg, FP)
    finally:
        seg.close()
        seg.unlink()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 39), st.sampled_from([0, 1, 2]), st.integers(-1, 9), st.booleans()),
                max_size=120))
def test_directory_matches_a_dict_model(ops) -> None:
    keys = MODEL_KEYS
    with model_directory() as (w, r):
        model: dict[bytes, list[int]] = {}
        for ki, col, slot, flag in ops:
            key = keys[ki]
            w.set_slot(key, col, slot)
            if key in model or slot != NO_SLOT:
                row = model.setdefault(key, [NO_SLOT, NO_SLOT, 0, NO_SLOT])
                row[(0, 1, 3)[col]] = slot  # a row is [gpu, cpu, flags, disk]
                if [row[0], row[1], row[3]] == [NO_SLOT] * 3:
                    del model[key]
            if flag and key in model:
                w.set_flag(key, IN_REDIS, not model[key][2])
                model[key][2] ^= IN_REDIS
        assert len(w) == len(model)
        for key in keys:
            want = tuple(model[key]) if key in model else None
            assert r.find(key) == want and w.get(key) == want
        # The batch probe agrees with find wherever it answers: a cpu slot for a key listed in
        # the cpu tier and no gpu slot, NO_SLOT otherwise (absent, in the gpu tier, or found only
        # past its probes, which a reader then asks `find` for).
        for probes in (1, 4, 64):
            got = r.cpu_slots(keys, probes).tolist()
            for key, slot in zip(keys, got):
                row = model.get(key)
                cpu_only = row is not None and row[0] == NO_SLOT and row[1] != NO_SLOT
                assert slot in ((row[1],) if cpu_only and probes == 64 else (NO_SLOT, row[1] if cpu_only else NO_SLOT))


def test_reserve_allocates_every_page_up_front(new_seg) -> None:
    """An arena is reserved at creation, so a full /dev/shm fails the start, not a later write."""
    lazy = new_seg(8 << 20)
    eager = new_seg(8 << 20, reserve=True)
    assert os.stat(SHM / lazy.name).st_blocks * 512 < (1 << 20), "a plain segment allocates nothing yet"
    assert os.stat(SHM / eager.name).st_blocks * 512 >= 8 << 20
    eager.buf[:4] = b"kvtr"
    assert bytes(eager.buf[:4]) == b"kvtr"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]),
                          st.lists(st.tuples(st.integers(0, 39), st.integers(-1, 9)), max_size=12)), max_size=30))
def test_directory_batches_match_a_dict_model(batches) -> None:
    """`set_slots` (a put's or an eviction's batch, keys repeated within it too) leaves what the
    same updates one key at a time would: the homes taken at once and the in-row bucket kept
    through the backward shifts of deletes."""
    keys = MODEL_KEYS
    with model_directory() as (w, r):
        model: dict[bytes, list[int]] = {}
        for col, batch in batches:
            w.set_slots(col, [keys[ki] for ki, _ in batch], [slot for _, slot in batch])
            for ki, slot in batch:
                key = keys[ki]
                if key in model or slot != NO_SLOT:
                    row = model.setdefault(key, [NO_SLOT, NO_SLOT, 0, NO_SLOT])
                    row[(0, 1, 3)[col]] = slot
                    if [row[0], row[1], row[3]] == [NO_SLOT] * 3:
                        del model[key]
            assert len(w) == len(model)
            for key in keys:
                want = tuple(model[key]) if key in model else None
                assert r.find(key) == want and w.get(key) == want
