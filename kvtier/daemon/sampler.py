"""Stream lag and pending counts for the metrics (XINFO GROUPS over the daemon's streams), and
the trim of what every group has read (kvtier/bus/trim.py) in the same round."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS
from kvtier.bus.trim import GroupMark, entry_id, trim_floor


def _field(g: dict[Any, Any], name: str) -> Any:
    v = g.get(name, g.get(name.encode()))
    return v.decode() if isinstance(v, bytes) else v


async def _sample_once(bus: AsyncRedis, names: list[str], group: str, into: dict[str, dict[str, Any]],
                       keep_ms: int) -> None:
    async with bus.pipeline(transaction=False) as pipe:
        for n in names:
            pipe.xinfo_groups(n)
        replies = await pipe.execute(raise_on_error=False)
    found = {n: groups for n, groups in zip(names, replies) if isinstance(groups, list)}
    for n, groups in found.items():
        g = next((g for g in groups if _field(g, "name") == group), None)
        if g is not None:
            into[n] = {**into.get(n, {}), "pending": g.get("pending", 0), "lag": g.get("lag")}
    # The oldest pending entry of each group that holds any: one XPENDING summary each.
    held = [(n, _field(g, "name")) for n, groups in found.items() for g in groups if g.get("pending")]
    async with bus.pipeline(transaction=False) as pipe:
        for n, name in held:
            pipe.xpending(n, name)
        oldest = {k: entry_id(s["min"]) for k, s in zip(held, await pipe.execute())
                  if isinstance(s, dict) and s.get("min")}
    floors = {n: trim_floor(keep_ms, [
        GroupMark(entry_id(_field(g, "last-delivered-id")), oldest.get((n, _field(g, "name"))))
        for g in groups]) for n, groups in found.items()}
    async with bus.pipeline(transaction=False) as pipe:
        for n, floor in floors.items():
            if floor is not None:
                pipe.xtrim(n, minid=floor, approximate=True)
        trimmed = await pipe.execute()
    for n, count in zip([n for n, f in floors.items() if f is not None], trimmed):
        into.setdefault(n, {})["trimmed"] = into.get(n, {}).get("trimmed", 0) + int(count)


async def sample_streams(bus: AsyncRedis, names: list[str], group: str, into: dict[str, dict[str, Any]],
                         interval: float, keep_s: float, log: Any) -> None:
    """Every `interval` s, each stream's pending entries and lag for `group`, into `into`; and
    trim each stream's entries that every group has read and acked
    once they are `keep_s` old (`trimmed` counts them).

    Ended by cancellation only, which redis-py can swallow mid-command on Python 3.11 (the
    stop hang once bounded by CHORE_STOP_S): hence the check after each round trip.
    """
    while True:
        try:
            await _sample_once(bus, names, group, into, int(keep_s * 1000))
        except REDIS_ERRORS as e:
            log.debug("daemon.stream_sample_failed", error=str(e))
        except Exception as e:  # last: see bus/failures.py
            log.warning("daemon.stream_sample_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
        raise_if_cancelling()
        await asyncio.sleep(interval)
