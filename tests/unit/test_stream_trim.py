"""The trim floor (kvtier/bus/trim.py): nothing a group has not been handed, or holds pending,
is ever below it; acked entries go once `keep_ms` old."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.bus.trim import GroupMark, entry_id, trim_floor

ids = st.tuples(st.integers(0, 10**6), st.integers(0, 5))


def test_entry_ids_order_as_redis_orders_them() -> None:
    assert entry_id(b"1700000000000-3") == (1700000000000, 3)
    assert entry_id("5") == (5, 0)
    assert entry_id("10-0") > entry_id("9-99")
    assert entry_id(b"1700000000000-2") < entry_id("1700000000000-10") < entry_id(b"1700000000001-0")


def test_no_group_means_no_trim() -> None:
    assert trim_floor(10**6, 0, []) is None


def test_a_group_never_handed_anything_holds_the_whole_stream() -> None:
    assert trim_floor(10**6, 0, [GroupMark((900_000, 0)), GroupMark((0, 0))]) is None


def test_acked_entries_go_once_old_enough() -> None:
    caught_up = [GroupMark((999_000, 7))]
    assert trim_floor(1_000_000, 60_000, caught_up) == "940000-0"  # the last 60 s stay
    assert trim_floor(1_000_000, 0, caught_up) == "999000-7"  # keep 0: all but the last delivered


def test_the_oldest_pending_entry_of_any_group_stays() -> None:
    groups = [GroupMark((999_000, 0)), GroupMark((999_500, 0), oldest_pending=(400_000, 2))]
    assert trim_floor(1_000_000, 0, groups) == "400000-2"


@given(now=st.integers(0, 2 * 10**6), keep=st.integers(0, 10**6),
       marks=st.lists(st.tuples(ids, st.none() | ids), min_size=1, max_size=4))
def test_nothing_undelivered_pending_or_young_is_ever_below_the_floor(now, keep, marks) -> None:
    groups = [GroupMark(d, p if p is None or p <= d else d) for d, p in marks]  # pending ones were delivered
    floor = trim_floor(now, keep, groups)
    if floor is None:
        return
    f = entry_id(floor)
    for g in groups:
        assert f <= g.delivered, "an entry not yet handed to a group would be trimmed"
        assert g.oldest_pending is None or f <= g.oldest_pending, "a pending entry would be trimmed"
    assert f[0] <= max(0, now - keep), "an entry younger than keep_ms would be trimmed"
