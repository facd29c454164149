"""A client takes back a staging slot the daemon never released (kvtier/shm/staging.py,
`StagingWriter._reclaimed_slot`): once `reclaim_s` (STAGING_RECLAIM_S, 10 s, in production) have
passed since the block was staged, a full staging segment hands out its oldest unreleased slot
again, and the daemon's late read of the old put fails verification. Real shared memory: the
client's StagingWriter and the daemon's StagingFile (pread/pwrite on the same file), no mocks.
The tests shorten the window rather than sleep 10 s; the code path and the clock are the real ones.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.core.events import StagedBlock
from kvtier.keys import BlockKey
from kvtier.shm.staging import StagingWriter
from kvtier.shm.staging_files import StagingFile
from tests.support.waiting import wait_until

BLOCK_BYTES = 4096
SLOTS = 4
RECLAIM_S = 0.3
FINGERPRINT = hashlib.sha256(b"staging-reclaim").digest()


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"reclaim" + i.to_bytes(4, "little")).digest())


def row(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, BLOCK_BYTES, dtype=np.uint8)


@pytest.fixture
def writer() -> Iterator[StagingWriter]:
    w = StagingWriter.create(f"reclaim-{uuid.uuid4().hex[:8]}", SLOTS, BLOCK_BYTES, FINGERPRINT,
                             daemon_uid=os.geteuid(), shm_gid=None)
    w.reclaim_s = RECLAIM_S  # the production window (STAGING_RECLAIM_S, 10 s) shortened for the test
    try:
        yield w
    finally:
        w.close(leave_uncounted=False)


def stage(w: StagingWriter, ids: list[int]) -> list[StagedBlock]:
    """What a client's put does: take slots, fill them, note when they were staged."""
    taken = w.take_slots([key(i) for i in ids], None)
    filled = [w.fill_slot(b, row(i)) for b, i in zip(taken, ids)]
    w.staged(filled)
    return filled


def daemon_reads(f: StagingFile, b: StagedBlock) -> bytes | None:
    dst = np.empty(BLOCK_BYTES, dtype=np.uint8)
    return dst.tobytes() if f.read_into(b.slot, b.key, b.gen, dst) is not None else None


def test_a_slot_the_daemon_never_released_is_taken_back_once_the_reclaim_time_has_passed(writer) -> None:
    daemon = StagingFile.open(writer.seg.name)
    try:
        first = stage(writer, [0, 1, 2, 3])
        staged_at = time.monotonic()
        assert [b.slot for b in first] == [0, 1, 2, 3]
        # The daemon stores block 0 and releases its slot; the puts of blocks 1-3 never reach it
        # (dead-lettered, or lost with a Redis restart): their slots stay READY.
        assert daemon_reads(daemon, first[0]) == row(0).tobytes()
        assert daemon.release(first[0].slot, first[0].gen)
        [again] = stage(writer, [4])
        assert again.slot == 0, "a released slot is used first"

        assert writer.take_slots([key(5)], None) == [], "full, and nothing is old enough to take back"
        [taken] = wait_until(lambda: writer.take_slots([key(5)], None), timeout=10, interval=0.01,
                             message="the oldest unreleased slot taken back")
        assert time.monotonic() - staged_at >= RECLAIM_S, "taken back before the reclaim time"
        assert taken.slot == 1, "the oldest staged slot goes first"
        assert taken.gen % 2 == 1 and taken.gen != first[1].gen, "being written: a new generation"
        b5 = writer.fill_slot(taken, row(5))
        writer.staged([b5])

        # The lost put turns up after all: the daemon's read of the old block fails verification,
        # and its release does not free the slot the client has rewritten.
        assert daemon_reads(daemon, first[1]) is None
        assert not daemon.release(first[1].slot, first[1].gen)
        assert daemon_reads(daemon, b5) == row(5).tobytes()
        # The slots not taken back still hold their blocks for the daemon, byte for byte.
        assert daemon_reads(daemon, first[2]) == row(2).tobytes()
        assert daemon_reads(daemon, first[3]) == row(3).tobytes()
        assert daemon_reads(daemon, again) == row(4).tobytes()
    finally:
        daemon.close()


def test_only_as_many_slots_as_a_put_needs_are_taken_back_oldest_first(writer) -> None:
    window = 1.0  # the older blocks pass it 0.9 s before the newer ones: room for a slow poll
    writer.reclaim_s = window
    older = stage(writer, [0, 1])
    t_older = time.monotonic()
    wait_until(lambda: time.monotonic() - t_older >= 0.9 * window, timeout=5, message="the older blocks age")
    newer = stage(writer, [2, 3])
    taken = wait_until(lambda: writer.take_slots([key(10), key(11), key(12)], None), timeout=10,
                       message="the older slots taken back")
    # The older two are past the window while the newer two are not yet, so a put of three gets
    # the two old slots, and its third block finds none.
    assert [b.slot for b in taken] == [b.slot for b in older]
    assert all(writer.table.gen(b.slot) == b.gen for b in newer), "the newer slots are left alone"
    writer.unstage(taken)  # the put failed after all: the slots are free again, not lost
    assert [b.slot for b in writer.take_slots([key(20), key(21)], None)] == [b.slot for b in older]
