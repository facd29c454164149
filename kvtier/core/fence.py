"""Per-key fencing of a tier worker's commands against late and redelivered stream entries.

Delivery is at least once: after a consumer crash or an XAUTOCLAIM an old command can arrive
after newer ones for the same block (a promote after the evict that followed it, an evict after
the block came back). Every command carries its producer's (epoch, seq) stamp, which grows with
every command the daemon publishes and across daemon restarts (epoch is the start time in ns).
A worker remembers the newest stamp it applied per block and skips any older one, so the last
decision about a block wins whatever order the entries arrive in.

An equal stamp is the same entry again (a retry after a failed attempt, or a plain duplicate):
it runs, because handlers are idempotent and a retry must be able to finish. The memory is a
bounded LRU: a block untouched for longer than `capacity` other blocks forgets its stamp, and
the per-handler checks (present, still leaving, staging generation) remain the guard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvtier.keys import BlockKey

Stamp = tuple[int, int]  # (epoch, seq)


class CommandFence:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("fence capacity must be positive")
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, BlockKey], Stamp] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def stale(self, pool: str, key: BlockKey, stamp: Stamp) -> bool:
        """Whether a newer command for this block has already been applied."""
        last = self._last.get((pool, key))
        return last is not None and stamp < last

    def record(self, pool: str, key: BlockKey, stamp: Stamp) -> None:
        """A command for this block was applied (call only after its handler succeeded)."""
        self.record_many(pool, (key,), stamp)

    def record_many(self, pool: str, keys: Iterable[BlockKey], stamp: Stamp) -> None:
        """`record` for a batch of blocks applied under one stamp."""
        last, move, cap = self._last, self._last.move_to_end, self.capacity
        for key in keys:
            k = (pool, key)
            old = last.get(k)
            if old is None:
                last[k] = stamp  # a new key goes in last, where move_to_end would put it
                if len(last) > cap:
                    last.popitem(last=False)
            else:
                last[k] = stamp if stamp > old else old
                move(k)
