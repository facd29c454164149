"""The daemon's garbage-collector settings (kvtier/daemon/collector.py), in this process: set,
timed, and put back as they were."""

from __future__ import annotations

import gc

from kvtier.daemon.collector import YOUNG, Collector


def test_collector_freezes_start_up_times_collections_and_puts_everything_back() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    c = Collector()
    c.start()
    try:
        assert gc.get_threshold() == (YOUNG, *before[1:])
        assert gc.get_freeze_count() > frozen_before  # this process's objects: out of collections
        garbage = []
        for _ in range(3):
            cycle: list[object] = []
            cycle.append(cycle)  # freed only by a collection
            garbage.append(cycle)
        del garbage, cycle
        assert gc.collect() >= 3  # objects made after the freeze are still collected
        assert c.collections[2] >= 1 and c.seconds[2] > 0 and c.pause_max_s > 0
        stats = c.as_dict()
        assert stats["gc_collections"][2] == c.collections[2]
        assert stats["gc_frozen"] == c.frozen == gc.get_freeze_count()
    finally:
        c.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen_before
    n = c.collections[2]
    gc.collect()
    assert c.collections[2] == n  # no longer timed
