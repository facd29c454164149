"""The per-block command fence and the redelivery filter, on their own."""

from __future__ import annotations

import pytest

from kvtier.bus.dedup import AppliedEntries
from kvtier.core.events import Envelope, Evict, Tier
from kvtier.core.fence import CommandFence

K1, K2 = b"\x01" * 32, b"\x02" * 32


def test_the_newest_applied_command_per_block_wins() -> None:
    f = CommandFence(8)
    assert not f.stale("p", K1, (1, 5))
    f.record("p", K1, (1, 5))
    assert f.stale("p", K1, (1, 4)), "older seq, same epoch"
    assert not f.stale("p", K1, (1, 5)), "the same entry again may run (a retry after a failure)"
    assert f.stale("p", K1, (0, 99)), "an earlier daemon life"
    assert not f.stale("p", K1, (2, 1)), "a later daemon life"
    assert not f.stale("p", K2, (1, 1)) and not f.stale("q", K1, (1, 1)), "per pool and block"
    f.record("p", K1, (1, 3))  # recording an older stamp never lowers the fence
    assert f.stale("p", K1, (1, 4))


def test_the_fence_is_bounded_and_forgets_the_coldest_block() -> None:
    f = CommandFence(2)
    for i, k in enumerate((K1, K2, b"\x03" * 32)):
        f.record("p", k, (1, 10 + i))
    assert len(f) == 2 and not f.stale("p", K1, (1, 0)) and f.stale("p", K2, (1, 0))
    with pytest.raises(ValueError):
        CommandFence(0)


def _env(seq: int, producer: str = "n/daemon") -> Envelope:
    return Envelope(event=Evict("p", K1, Tier.CPU, "clean"), producer=producer, epoch=1, seq=seq)


def test_redeliveries_are_skipped_only_once_their_batch_completed() -> None:
    a = AppliedEntries(capacity=2)
    assert not a.duplicate(_env(1))
    a.handled(_env(1))
    assert a.duplicate(_env(1)), "again within the running batch"
    a.discard()  # the batch failed before its outcomes were published: it must run again
    assert not a.duplicate(_env(1))
    a.handled(_env(1))
    a.commit()
    assert a.duplicate(_env(1)) and not a.duplicate(_env(1, "other/client")) and not a.duplicate(_env(2))
    for s in (2, 3):
        a.handled(_env(s))
    a.commit()
    assert not a.duplicate(_env(1)), "bounded: the oldest stamp is forgotten"
    assert a.skipped == 2
