"""Which cluster masters to leave alone for a while, and when to reload the slot map: pure rules,
time passed in (tests/unit/test_master_health.py).

A master that failed a batch with an outage (refused, reset, timed out) is marked down for a
short while, doubling while it keeps failing (DOWN_MIN_S up to DOWN_MAX_S). Commands for a
master marked down get its last error at once, without I/O: a hung master would otherwise hold
every batch that touches it for a whole socket timeout, and the tier worker's batches behind
it, so "the other masters keep serving" would hold for outcomes but not for time. When the mark
runs out the next batch sends again (a probe); a success clears it.

The slot map is reloaded after a batch met an outage (a failover moves slots to a replica), at
most every RELOAD_MIN_S, doubling while the outage lasts (up to RELOAD_MAX_S): each reload makes
redis-py reconnect every connection it keeps, so reloading twice a second through a long outage
would churn the healthy masters' connections too.
"""

from __future__ import annotations

from dataclasses import dataclass

DOWN_MIN_S = 0.25
DOWN_MAX_S = 4.0
RELOAD_MIN_S = 0.5
RELOAD_MAX_S = 4.0


@dataclass(slots=True)
class _Down:
    until: float
    hold: float
    error: Exception


class MasterHealth:
    def __init__(self) -> None:
        self._down: dict[str, _Down] = {}

    def failed(self, master: str, error: Exception, now: float) -> None:
        prev = self._down.get(master)
        hold = DOWN_MIN_S if prev is None else min(DOWN_MAX_S, prev.hold * 2)
        self._down[master] = _Down(now + hold, hold, error)

    def ok(self, master: str) -> None:
        self._down.pop(master, None)

    def down(self, master: str, now: float) -> Exception | None:
        """The master's last error while it is marked down; None when it may be asked (again)."""
        d = self._down.get(master)
        return d.error if d is not None and now < d.until else None


class ReloadPacing:
    def __init__(self) -> None:
        self._next = 0.0
        self._gap = RELOAD_MIN_S

    def due(self, now: float) -> bool:
        """Whether to reload now; if so, the next one waits twice as long."""
        if now < self._next:
            return False
        self._next = now + self._gap
        self._gap = min(RELOAD_MAX_S, self._gap * 2)
        return True

    def settled(self) -> None:
        """A batch met no outage: the next one reloads at once, and the gap starts small again."""
        self._next = 0.0
        self._gap = RELOAD_MIN_S
