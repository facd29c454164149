"""The grant ring (kvtier/shm/grant_ring.py): the daemon's end writes through a file descriptor,
the client's end reads its own mapping of the same shared-memory file, as in production."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from kvtier.shm.grant_ring import RING, TAIL_OFF, GrantRing, RingFile
from kvtier.shm.segment import SHM_DIR, ShmSegment


@pytest.fixture
def ends() -> Iterator[tuple[RingFile, GrantRing, ShmSegment]]:
    seg = ShmSegment.create(f"kvtier.test-ring-{uuid.uuid4().hex[:8]}", 4096)
    fd = os.open(SHM_DIR / seg.name, os.O_RDWR)
    try:
        yield RingFile(fd), GrantRing(seg.buf), seg
    finally:
        os.close(fd)
        seg.close()
        seg.unlink()


def test_grants_arrive_in_order_once_and_across_the_wrap(ends) -> None:
    daemon, client, _ = ends
    head = daemon.begin(epoch=5)
    assert head == 0 and daemon.room(head) == RING
    epoch, got, renewed = client.take(0)
    assert (epoch, got, renewed) == (5, [], True)  # a new daemon: nothing held is valid
    sent = 0
    for rnd in range(5):  # 5 x 100 slots through a ring of 256
        batch = list(range(sent, sent + 100))
        assert daemon.room(head) == RING  # the client took everything before
        head = daemon.push(head, batch)
        sent += 100
        epoch, got, renewed = client.take(5)
        assert got == batch and not renewed, rnd
        assert client.take(5)[1] == []  # taken once
    assert daemon.room(head) == RING


def test_the_daemon_never_outruns_the_client(ends) -> None:
    daemon, client, _ = ends
    head = daemon.begin(epoch=1)
    head = daemon.push(head, list(range(RING)))
    assert daemon.room(head) == 0  # full until the client takes some
    assert client.take(0)[1] == list(range(RING))
    assert daemon.room(head) == RING


def test_a_new_daemon_starts_past_the_old_grants_and_the_client_drops_them(ends) -> None:
    old, client, _ = ends
    head = old.begin(epoch=1)
    head = old.push(head, [10, 11, 12])
    assert client.take(0)[1] == [10, 11, 12]
    old.push(head, [13, 14])  # granted but never taken, when the daemon dies
    new = RingFile(old.fd)
    head2 = new.begin(epoch=2)
    assert head2 == head + 2  # past everything the old daemon granted
    head2 = new.push(head2, [7])
    epoch, got, renewed = client.take(1)
    assert (epoch, got, renewed) == (2, [7], True)  # 13 and 14 were the old daemon's: skipped


def test_a_client_that_scribbles_its_tail_gets_no_more_grants(ends) -> None:
    daemon, client, seg = ends
    head = daemon.begin(epoch=3)
    head = daemon.push(head, [1, 2])
    seg.buf[TAIL_OFF:TAIL_OFF + 8] = (head + 5).to_bytes(8, "little")  # ahead of the head: nonsense
    assert daemon.room(head) == 0
    seg.buf[TAIL_OFF:TAIL_OFF + 8] = (1 << 63).to_bytes(8, "little")
    assert daemon.room(head) == 0
    seg.buf[TAIL_OFF:TAIL_OFF + 8] = head.to_bytes(8, "little")
    assert daemon.room(head) == RING
