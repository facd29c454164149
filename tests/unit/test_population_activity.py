"""When the arena's population may go wide: the daemon is idle once no bus event has been
handled for the quiet time (kvtier/daemon/population.py)."""

from kvtier.config import ArenaConfig
from kvtier.daemon.population import Activity, populate_widths


def test_idle_until_an_event_then_busy_for_the_quiet_time():
    now, count = [100.0], [0]
    a = Activity(lambda: count[0], quiet_s=2.0, clock=lambda: now[0])
    assert not a.busy(), "no event yet: idle from the start"
    count[0] += 1
    assert a.busy()
    now[0] += 1.9
    assert a.busy(), "still within the quiet time of the last event"
    now[0] += 0.2
    assert not a.busy()
    count[0] += 5
    now[0] += 60
    assert a.busy(), "events seen after a long quiet spell"


def test_widths_from_config():
    assert populate_widths(ArenaConfig(populate_threads=2, populate_threads_idle=5)) == (2, 5)
    assert populate_widths(ArenaConfig(populate_threads=4, populate_threads_idle=1)) == (4, 4), "never narrower idle"
    serving, idle = populate_widths(ArenaConfig())
    assert 1 <= serving <= idle <= 8
