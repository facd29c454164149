"""Skipping exact redeliveries of entries whose effects are already complete.

Streams deliver at least once: an entry comes again after a consumer crash, an XAUTOCLAIM, or an
ack lost with its connection. Every envelope carries its producer's (producer, epoch, seq) stamp,
unique per entry, so a consumer can recognise an entry it has already applied and skip it.
Handlers stay idempotent regardless (the memory is bounded and lost on restart), but a
redelivered access would otherwise count its hits twice, and a late command would act again.

A stamp counts as applied only once its batch's effects are complete (`commit`, after the
batch's outcomes were published); if that fails the batch is redelivered and must run again,
so the stamps of an unfinished batch are dropped (`discard`).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.core.events import Envelope

Stamp = tuple[str, int, int]  # producer, epoch, seq


def stamp_of(env: Envelope) -> Stamp:
    return (env.producer, env.epoch, env.seq)


class AppliedEntries:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._applied: OrderedDict[Stamp, None] = OrderedDict()
        self._pending: dict[Stamp, None] = {}
        self.skipped = 0

    def duplicate(self, env: Envelope) -> bool:
        """Already applied, or handled earlier in the batch now running: skip it."""
        s = stamp_of(env)
        if s in self._applied or s in self._pending:
            self.skipped += 1
            return True
        return False

    def handled(self, env: Envelope) -> None:
        self._pending[stamp_of(env)] = None

    def commit(self) -> None:
        for s in self._pending:
            self._applied[s] = None
        self._pending.clear()
        while len(self._applied) > self.capacity:
            self._applied.popitem(last=False)

    def discard(self) -> None:
        self._pending.clear()

    def __len__(self) -> int:
        """Stamps remembered (a batch's pending ones join them at its commit)."""
        return len(self._applied)
