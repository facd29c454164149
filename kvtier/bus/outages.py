"""Deliveries lost to a Redis outage, per entry, so that they do not count towards max_deliveries.

Redis counts a delivery every time a consumer reads an entry (XREADGROUP, XAUTOCLAIM), whether
or not it could then act on it. An entry whose handling failed only because Redis was
unreachable (a connection error or a timeout in the handler, in publishing the batch's outcomes,
or in acking) is not a bad entry: after an outage of a few reclaim cycles it would otherwise go
to the dead-letter stream. Each consumer remembers how many of an entry's deliveries ended that
way and triage counts only the others. The ledger is in memory and bounded (the oldest entries
are forgotten first): a restarted consumer counts every delivery again, as before.
"""

from __future__ import annotations

from collections import OrderedDict

LEDGER_CAP = 65536


class OutageLedger:
    def __init__(self, cap: int = LEDGER_CAP) -> None:
        self.cap = cap
        self._lost: OrderedDict[tuple[str, bytes], int] = OrderedDict()

    def record(self, lost: set[tuple[str, bytes]], acked: dict[str, list[bytes]],
               dead: list[tuple[str, bytes, str, bytes | None]]) -> None:
        """After a batch: `lost` are (stream, id) whose delivery ended in an outage; acked and
        dead-lettered entries are done with."""
        settled = {(stream, i) for stream, ids in acked.items() for i in ids}
        settled.update((stream, i) for stream, i, _reason, _raw in dead)
        for key in settled:
            self._lost.pop(key, None)
        for key in lost - settled:
            self._lost[key] = self._lost.get(key, 0) + 1
            self._lost.move_to_end(key)
        while len(self._lost) > self.cap:
            self._lost.popitem(last=False)

    def counted(self, stream: str, entry_id: bytes, delivered: int) -> int:
        """The deliveries of this entry that count against it."""
        return delivered - self._lost.get((stream, entry_id), 0)

    def __len__(self) -> int:
        return len(self._lost)
