"""Names of one node's Redis streams (docs/architecture.md, "Bus").

Every name carries the node inside `{...}`, a Redis Cluster hash tag, so all of a node's streams
hash to one slot: XREADGROUP over several of them, MULTI and Lua stay single-slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.events import Tier

PREFIX = "kvtier"


@dataclass(frozen=True, slots=True)
class StreamNames:
    """The streams of `node`: client events, one per tier worker, tier facts, dead letters."""

    node: str

    def __post_init__(self) -> None:
        # Braces would end or nest the hash tag and silently split the node across slots.
        if not self.node or "{" in self.node or "}" in self.node:
            raise ValueError(f"node name must be non-empty and brace-free, got {self.node!r}")

    @property
    def _base(self) -> str:
        return f"{PREFIX}:{{{self.node}}}"

    @property
    def client(self) -> str:
        """Events published by inference clients (access, put, prefetch)."""
        return f"{self._base}:client"

    def tier(self, t: Tier) -> str:
        """Commands for the worker of tier `t`."""
        return f"{self._base}:tier:{Tier(t).label}"

    @property
    def facts(self) -> str:
        """Stored/removed facts published by the tier workers."""
        return f"{self._base}:facts"

    @property
    def dlq(self) -> str:
        """Entries that failed validation or kept failing, with the reason."""
        return f"{self._base}:dlq"

    def grouped(self) -> list[str]:
        """The streams the daemon reads through its consumer group (all but the dead letters)."""
        return [self.client, self.facts, *(self.tier(t) for t in Tier)]

    def all(self) -> tuple[str, ...]:
        return (self.client, *(self.tier(t) for t in Tier), self.facts, self.dlq)
