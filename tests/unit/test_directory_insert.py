"""The directory's compiled insert (copy_hash.c `dir_insert`, which `DirectoryWriter.set_slots`
uses for a batch of new keys): it leaves the shared table byte for byte as the Python probe does,
through crowded homes and the table's wrap-around, batch after batch with updates and deletes
between; and what it refuses leaves the table as it was."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.layout import BlockLayout
from kvtier.shm import onepass
from kvtier.shm.directory import (
    COMPILED_MIN_KEYS,
    ENTRY_BYTES,
    ENTRY_OFF,
    NO_SLOT,
    DirectoryReader,
    DirectoryWriter,
    directory_bytes,
)
from kvtier.shm.segment import ShmSegment

pytestmark = pytest.mark.skipif(not onepass.COMPILED, reason="compares the compiled insert with Python's")

FP = BlockLayout("m", 2, 2, 4, 16, "float16").fingerprint
CAP = 64


def hkey(home: int, tag: int) -> bytes:
    """A key whose home bucket (low bits of its first 8 bytes, little-endian) is `home`."""
    return (home + CAP * (tag + 1)).to_bytes(8, "little") + bytes([tag % 251]) * 24


# 40 keys crowding a 64-bucket table: clusters, wrap-arounds, backward shifts
KEYS = [hkey(h, i) for i, h in enumerate([0, 1, 2, 61, 62, 63, 5, 30] * 5)]


@contextlib.contextmanager
def directory(python: bool) -> Iterator[tuple[ShmSegment, DirectoryWriter]]:
    seg = ShmSegment.create(f"kvtier.test-{uuid.uuid4().hex[:8]}.dir", directory_bytes(CAP))
    try:
        w = DirectoryWriter.create(seg, CAP, FP)
        if python:
            w._insert = None  # the path a host without the compiled extension takes
        yield seg, w
    finally:
        seg.close()
        seg.unlink()


def table(seg: ShmSegment) -> bytes:
    return bytes(seg.buf[ENTRY_OFF:ENTRY_OFF + CAP * ENTRY_BYTES])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 24), st.randoms(use_true_random=False),
                          st.lists(st.tuples(st.integers(0, 39), st.integers(-1, 9)), max_size=12)), max_size=30))
def test_the_compiled_insert_writes_the_table_as_python_does(batches) -> None:
    """Each batch goes to both writers. A batch drawn with a size above 0 is that many keys
    neither holds, each once, with a slot (what the compiled insert takes from COMPILED_MIN_KEYS
    keys on); the others mix updates, deletes and repeats (Python's path for both)."""
    with directory(python=False) as (seg_c, wc), directory(python=True) as (seg_p, wp):
        calls = counted(wc)
        for col, fresh, rnd, batch in batches:
            keys = [KEYS[ki] for ki, _ in batch]
            slots = [slot for _, slot in batch]
            if fresh:
                keys = rnd.sample([k for k in KEYS if wc.get(k) is None], min(fresh, CAP - 2 - len(wc), 40 - len(wc)))
                slots = [i % 9 for i in range(len(keys))]
            # The compiled insert's batch: enough keys, all new, each once, each with a slot.
            takes = (len(keys) >= COMPILED_MIN_KEYS and len(set(keys)) == len(keys) and NO_SLOT not in slots
                     and all(wc.get(k) is None for k in keys))
            assert takes or not (fresh and len(keys) >= COMPILED_MIN_KEYS)
            before = len(calls)
            wc.set_slots(col, keys, slots)
            wp.set_slots(col, keys, slots)
            assert len(calls) - before == takes
            assert table(seg_c) == table(seg_p)
            assert len(wc) == len(wp)
            for k in KEYS:
                assert wc.get(k) == wp.get(k) == DirectoryReader(seg_c, FP).find(k)


def counted(w: DirectoryWriter) -> list[int]:
    """The batch sizes `w`'s compiled insert is called with, from now on."""
    calls: list[int] = []
    inner = w._insert
    assert inner is not None

    def insert(*a):
        calls.append(len(a[1]) // 32)
        return inner(*a)
    w._insert = insert
    return calls


def test_a_fresh_batch_crowding_the_wraparound_lands_where_python_puts_it() -> None:
    """The example the property relies on, pinned: 24 new keys homed on 61-63 and 0-2."""
    keys = [k for k in KEYS if int.from_bytes(k[:8], "little") % CAP in (61, 62, 63, 0, 1, 2)][:24]
    with directory(python=False) as (seg_c, wc), directory(python=True) as (seg_p, wp):
        calls = counted(wc)
        wc.set_slots(1, keys, list(range(24)))
        wp.set_slots(1, keys, list(range(24)))
        assert calls == [24], "the batch went through the compiled insert"
        assert table(seg_c) == table(seg_p)
        assert {wc.get(k) for k in keys} == {(NO_SLOT, i, 0, NO_SLOT) for i in range(24)}
        wc.set_slots(1, keys[:3] + [keys[0]], [5, 6, 7, 8])  # known keys, one twice: the Python path
        wc.set_slot(KEYS[39], 0, 3)  # one new key: Python's, where the call would cost more than it saves
        assert calls == [24] and wc.get(keys[0]) == (NO_SLOT, 8, 0, NO_SLOT) and wc.get(KEYS[39])[0] == 3


def test_the_compiled_insert_refuses_and_leaves_the_table_as_it_was() -> None:
    with directory(python=False) as (seg, w):
        insert = w._insert
        assert insert is not None
        keys = b"".join(KEYS[:3])
        homes = np.array([0, 1, 2], np.int64)
        at = np.zeros(3, np.int64)
        with seg.buf[ENTRY_OFF:ENTRY_OFF + CAP * ENTRY_BYTES] as entries:
            before = table(seg)
            with pytest.raises(ValueError, match="does not fit an entry"):
                insert(entries, keys, homes, np.array([3, 4, 1 << 40], np.int64), 1, at)
            with pytest.raises(ValueError, match="column 3"):
                insert(entries, keys, homes, np.array([3, 4, 5], np.int64), 3, at)
            with pytest.raises(ValueError, match="homes must hold 3"):
                insert(entries, keys, homes[:2], np.array([3, 4, 5], np.int64), 1, at)
            with pytest.raises(ValueError, match="bytes of entries"):
                insert(entries[:100], keys, homes, np.array([3, 4, 5], np.int64), 1, at)
            assert table(seg) == before, "nothing written"
        # Four entries, two used: the first two keys land, the third finds none, and the two
        # written are taken back.
        small = bytearray(4 * ENTRY_BYTES)
        small[0] = small[2 * ENTRY_BYTES] = 1
        was = bytes(small)
        with pytest.raises(ValueError, match="full"):
            insert(small, keys, homes, np.array([3, 4, 5], np.int64), 1, at)
        assert bytes(small) == was
