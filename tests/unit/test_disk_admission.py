"""The disk tier's admission rule (kvtier/core/disk_admission.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.disk_admission import AdmissionCounts, DiskAdmit, disk_admission


def test_each_reason() -> None:
    assert disk_admission(0, 0, None) is DiskAdmit.ALL
    assert disk_admission(2, 2, None) is DiskAdmit.REUSED
    assert disk_admission(2, 0, 3) is DiskAdmit.HOT_PREFIX
    assert disk_admission(2, 1, 1) is DiskAdmit.COLD
    assert disk_admission(2, 1, None) is DiskAdmit.COLD


@given(st.integers(0, 5), st.integers(0, 9), st.one_of(st.none(), st.integers(0, 9)))
def test_admitted_exactly_when_the_block_or_its_parent_was_read_enough(n: int, hits: int, parent: int | None) -> None:
    want = n == 0 or hits >= n or (parent is not None and parent >= n)
    assert disk_admission(n, hits, parent).admitted == want


def test_counts_every_decision_by_reason() -> None:
    c = AdmissionCounts()
    got = [c.decide(2, h, p) for h, p in ((0, None), (2, None), (0, 2), (1, 1))]
    assert got == [False, True, True, False]
    assert c.snapshot() == {"all": 0, "reused": 1, "hot_prefix": 1, "cold": 2}
