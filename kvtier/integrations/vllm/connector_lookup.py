"""The connector scheduler's Redis lookup: how far a request's prefix reaches beyond this node."""

from __future__ import annotations

from kvtier.integrations.link import EngineLink
from kvtier.integrations.vllm.connector_requests import TrackedRequest


def redis_reach(link: EngineLink, pool: str, timeout: float, t: TrackedRequest, keys: list[list[bytes]]) -> int | None:
    """How far every chain's prefix can be read, from this node or Redis (one bounded round
    trip per chain, asked once per request; None: it timed out, ask again). A sliding-window
    group's run is asked from its first block: older parts Redis lost cost a miss here, never
    a wrong load."""
    if t.reach is not None:
        return t.reach
    t.tries += 1

    def locate(c, k: list[bytes]) -> int | None:
        try:
            found = c.locate(pool, k, timeout=timeout)
        except TimeoutError:  # the link is fine (not the guard's "lost"): this lookup was slow
            return None
        return int(found.length + found.redis_length)

    reach = len(keys[0])
    for k in keys:
        r = link.guard("redis lookup", 0, lambda c, k=k: locate(c, k))
        if r is None:
            link.counters.add("lookup_timeouts")
            return None
        reach = min(reach, r)
    t.reach = reach
    return reach
