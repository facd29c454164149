"""Stream lag and pending counts for the metrics: XINFO GROUPS over the daemon's streams."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtier.bus.cancel import raise_if_cancelling
from kvtier.bus.connect import AsyncRedis
from kvtier.bus.failures import REDIS_ERRORS


async def sample_streams(bus: AsyncRedis, names: list[str], group: str, into: dict[str, dict[str, Any]],
                         interval: float, log: Any) -> None:
    """Every `interval` s, each stream's pending entries and lag for `group`, into `into`.

    Ended by cancellation only, which redis-py can swallow mid-command on Python 3.11 (the
    stop hang once bounded by CHORE_STOP_S): hence the check after each round trip.
    """
    while True:
        try:
            async with bus.pipeline(transaction=False) as pipe:
                for n in names:
                    pipe.xinfo_groups(n)
                replies = await pipe.execute(raise_on_error=False)
            for n, groups in zip(names, replies):
                g = next((g for g in groups if g.get("name") in (group, group.encode())), None) \
                    if isinstance(groups, list) else None
                if g is not None:
                    into[n] = {"pending": g.get("pending", 0), "lag": g.get("lag")}
        except REDIS_ERRORS as e:
            log.debug("daemon.stream_sample_failed", error=str(e))
        except Exception as e:  # last: see bus/failures.py
            log.warning("daemon.stream_sample_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
        raise_if_cancelling()
        await asyncio.sleep(interval)
