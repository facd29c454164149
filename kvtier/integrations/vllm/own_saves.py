"""Read your own writes: the keys of blocks this engine handed to kvtier that the daemon has not
placed yet (no vLLM imports). A lookup counts them as this node's for `land_s` after each save
was planned: the worker that staged them reads them from its own staging slots until the daemon
has placed them (ClientPool._read_own). A save the worker had to drop is promised for at most
that long, and its blocks then fail their load and are recomputed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

OWN_SAVE_LAND_S = 0.5  # how long a lookup counts this engine's own save as landing


class OwnSaves:
    def __init__(self, land_s: float = OWN_SAVE_LAND_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.land_s = land_s
        self.clock = clock
        self.until: dict[bytes, float] = {}  # key -> when a lookup stops waiting for it
        self._next_prune = 0.0

    def __bool__(self) -> bool:
        return bool(self.until)

    def note(self, keys: Sequence[bytes]) -> None:
        now = self.clock()
        if now >= self._next_prune:  # forget what landed unseen or never will
            self._next_prune = now + 1.0
            self.until = {k: u for k, u in self.until.items() if u > now}
        for key in keys:
            self.until[key] = now + self.land_s

    def landing(self, keys: Sequence[Sequence[bytes]], present: Sequence[Sequence[bool]]) -> list[list[bool]]:
        """Per chain, which blocks are resident or about to be (and forget those placed)."""
        now = self.clock()
        for k, held in zip(keys, present):
            for key, h in zip(k, held):
                if h:
                    self.until.pop(key, None)
        return [[h or self.until.get(key, 0.0) > now for key, h in zip(k, held)] for k, held in zip(keys, present)]
