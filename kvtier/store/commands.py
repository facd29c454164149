"""What a batch of block commands is: single-key commands, each with its own outcome."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeAlias

Command: TypeAlias = tuple[Any, ...]  # ("GET", name), ("SET", name, value, "EX", ttl), ("EVAL", script, 1, name, ...)
Outcome: TypeAlias = Any  # a reply, or the exception the command met


def key_of(command: Command) -> Any:
    """The one key of a single-key command (a script's is after its key count)."""
    return command[3] if command[0] in ("EVAL", "EVALSHA") else command[1]


class KeyBatches(Protocol):
    redirects: int  # commands a cluster redirected (MOVED, ASK, TRYAGAIN)
    reloads: int  # cluster slot-map reloads after a master failed a batch
    skipped: int  # commands answered at once because their master is marked down

    async def run(self, commands: Sequence[Command]) -> list[Outcome]:
        """Each command's reply or the exception it met, in order; never raises a Redis error."""
        ...
