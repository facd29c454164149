"""What a batch of block commands is: single-key commands, each with its own outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeAlias

from kvtier.store.bulk_reads import BulkPool, BulkUnusable, land
from kvtier.store.ops import SCRIPTS, Op

# The command's name (an `Op`) and its arguments: (Op.GET, name), (Op.SET, name, value, EX, ttl),
# (Op.EVAL, script, 1, name, ...). (Op.GET_INTO, name, Landing): a GET whose value lands in the
# caller's buffers (store/bulk_reads.py); its outcome is True (landed), None (absent), or the
# error. A batch holds GET_INTOs or others, not both.
Command: TypeAlias = tuple[Any, ...]
Outcome: TypeAlias = Any  # a reply, or the exception the command met


def key_of(command: Command) -> Any:
    """The one key of a single-key command (a script's is after its key count)."""
    return command[3] if command[0] in SCRIPTS else command[1]


class KeyBatches(Protocol):
    redirects: int  # commands a cluster redirected (MOVED, ASK, TRYAGAIN)
    reloads: int  # cluster slot-map reloads after a master failed a batch
    skipped: int  # commands answered at once because their master is marked down

    async def run(self, commands: Sequence[Command], *, per_pipeline: int | None = None,
                  width: int = 1) -> list[Outcome]:
        """Each command's reply or the exception it met, in order; never raises a Redis error.
        The commands go in pipelines of at most `per_pipeline` (None: one pipeline), with at most
        `width` of them in flight at once (each on its own connection), per server."""
        ...

    async def aclose(self) -> None:
        """Close the bulk-read connections (the redis-py client is its owner's to close)."""
        ...


def pipelines(idx: Sequence[int], per_pipeline: int | None) -> list[Sequence[int]]:
    """`idx` cut into runs of at most `per_pipeline` (all of it when None)."""
    if per_pipeline is None or per_pipeline >= len(idx):
        return [idx]
    return [idx[i:i + per_pipeline] for i in range(0, len(idx), per_pipeline)]


async def bounded_gather(width: int, jobs: Sequence[Awaitable[None]]) -> None:
    """Await every job, at most `width` at a time."""
    if width >= len(jobs):
        await asyncio.gather(*jobs)
        return
    gate = asyncio.Semaphore(width)

    async def one(job: Awaitable[None]) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(j) for j in jobs))


async def run_part(pipeline: Callable[[], Any], execute: dict[str, Any], bulk: BulkPool | None,
                   commands: Sequence[Command], idx: Sequence[int], out: list[Outcome]) -> None:
    """One pipeline of a batch, outcomes into `out`: GET_INTOs over `bulk` (falling back to
    redis-py, then landing the bytes, when bulk reads cannot be used with this server), any other
    commands as a redis-py pipeline (`pipeline()`, executed with `execute`)."""
    if not idx:
        return
    if commands[idx[0]][0] is Op.GET_INTO:
        names = [commands[i][1] for i in idx]
        landings = [commands[i][2] for i in idx]
        if bulk is not None:
            got = await bulk.get_into(names, landings)
            if not any(isinstance(g, BulkUnusable) for g in got):
                for i, g in zip(idx, got):
                    out[i] = g
                return
        raw = await _redis_py(pipeline, execute, [(Op.GET, n) for n in names])
        for i, r, land_at in zip(idx, raw, landings):
            out[i] = land(r, land_at)
        return
    for i, r in zip(idx, await _redis_py(pipeline, execute, [commands[i] for i in idx])):
        out[i] = r


async def _redis_py(pipeline: Callable[[], Any], execute: dict[str, Any], commands: Sequence[Command]) -> list[Any]:
    pipe = pipeline()
    for c in commands:
        pipe.execute_command(*c)
    try:
        return list(await pipe.execute(raise_on_error=False, **execute))
    except Exception as e:  # a Redis error, or another from inside redis-py (bus/failures.py)
        return [e] * len(commands)
