"""The trim floor (kvtier/bus/trim.py): nothing a group has not been handed, or holds pending,
is ever below it; acked entries go once `keep_ms` older than the newest one handed out."""

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
    assert trim_floor(0, []) is None


def test_a_group_never_handed_anything_holds_the_whole_stream() -> None:
    assert trim_floor(0, [GroupMark((900_000, 0)), GroupMark((0, 0))]) is None


def test_acked_entries_go_once_old_enough() -> None:
    caught_up = [GroupMark((1_000_000, 7))]
    assert trim_floor(60_000, caught_up) == "940000-0"  # the last 60 s before the newest stay
    assert trim_floor(0, caught_up) == "1000000-0"  # keep 0: all before the newest millisecond


def test_the_oldest_pending_entry_of_any_group_stays() -> None:
    groups = [GroupMark((999_000, 0)), GroupMark((999_500, 0), oldest_pending=(400_000, 2))]
    assert trim_floor(0, groups) == "400000-2"


@given(keep=st.integers(0, 10**6), marks=st.lists(st.tuples(ids, st.none() | ids), min_size=1, max_size=4))
def test_nothing_undelivered_pending_or_young_is_ever_below_the_floor(keep, marks) -> None:
    groups = [GroupMark(d, p if p is None or p <= d else d) for d, p in marks]  # pending ones were delivered
    floor = trim_floor(keep, groups)
    if floor is None:
        return
    f = entry_id(floor)
    for g in groups:
        assert f <= g.delivered, "an entry not yet handed to a group would be trimmed"
        assert g.oldest_pending is None or f <= g.oldest_pending, "a pending entry would be trimmed"
    newest = max(g.delivered for g in groups)[0]
    assert f[0] <= max(0, newest - keep), "an entry within keep_ms of the newest would be trimmed"
