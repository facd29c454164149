"""Read your own writes: the keys of blocks this engine handed to kvtier that the daemon has not
placed yet (no vLLM imports). A lookup counts them as this node's from the step that plans their
save until `land_s` after that step is over: the worker that staged them reads them from its own
staging slots until the daemon has placed them (ClientPool._read_host). The countdown starts two
scheduler steps after the plan (the step that saves them has then ended, with asynchronous
scheduling too), not at the plan: on a slow engine one forward pass outlasts `land_s` (a
2,048-token fp32 prefill takes 4.5 s on a 2-core AVX2 host), and a countdown from the plan had
run out before the next request looked. A save the worker had to drop is promised for at most
that long, and its blocks then fail their load and are recomputed: a miss, never wrong bytes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

OWN_SAVE_LAND_S = 0.5  # how long a lookup counts this engine's own save as landing


class OwnSaves:
    def __init__(self, land_s: float = OWN_SAVE_LAND_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.land_s = land_s
        self.clock = clock
        self.until: dict[bytes, float] = {}  # key -> when a lookup stops counting on it
        self.pending: dict[bytes, int] = {}  # key -> the step that planned its save (no countdown yet)
        self.steps = 0
        self._next_prune = 0.0

    def __bool__(self) -> bool:
        return bool(self.until) or bool(self.pending)

    def step(self) -> None:
        """A scheduler step begins: saves planned two steps ago are done; their countdown starts."""
        self.steps += 1
        now = self.clock()
        done = [k for k, s in self.pending.items() if s <= self.steps - 2]
        for key in done:
            del self.pending[key]
            self.until[key] = now + self.land_s
        if now >= self._next_prune:  # forget what landed unseen or never will
            self._next_prune = now + 1.0
            self.until = {k: u for k, u in self.until.items() if u > now}

    def note(self, keys: Sequence[bytes]) -> None:
        """Saves planned in this step."""
        for key in keys:
            self.until.pop(key, None)
            self.pending[key] = self.steps

    def landing(self, keys: Sequence[Sequence[bytes]], present: Sequence[Sequence[bool]]) -> list[list[bool]]:
        """Per chain, which blocks are resident or about to be (and forget those placed)."""
        now = self.clock()
        for k, held in zip(keys, present):
            for key, h in zip(k, held):
                if h:
                    self.until.pop(key, None)
                    self.pending.pop(key, None)
        return [[h or key in self.pending or self.until.get(key, 0.0) > now for key, h in zip(k, held)]
                for k, held in zip(keys, present)]
