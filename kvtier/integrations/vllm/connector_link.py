"""The connector's tie to the node's daemon: the shared engine link (kvtier/integrations/link.py),
its counters under the connector's names, and its log lines in vLLM's log.

vLLM must keep serving while kvtier is down: every call goes through `link.guard`, a failure is
a miss, a counter and a throttled line in vLLM's log (its `vllm.kvtier` logger: its handlers and
format). The link's own thread keeps the connection (a try every `retry_s` while the daemon is
down), so a dead daemon costs vLLM's threads nothing but reading that there is no client.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.integrations.counters import Counters
from kvtier.integrations.link import LINK_COUNTERS, EngineLink
from kvtier.integrations.pool_spec import PoolSpec

log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format

CONNECTOR_COUNTERS = (  # besides the link's own (LINK_COUNTERS), reported through vLLM's connector stats
    "lookups",  # requests the scheduler looked up
    "hit_blocks",  # blocks the scheduler promised vLLM it could load
    "hit_blocks_redis",  # of those, blocks only Redis held (read through by the worker)
    "own_save_hits",  # lookups that promised blocks this engine staged and the daemon had not placed yet
    "resumed_requests",  # requests vLLM preempted and scheduled again
    "lookup_timeouts",  # Redis lookups that ran past lookup_timeout_ms
    "lookup_retries",  # of those, asked again on a later step (the rest went on with the local part)
    "load_not_worth_blocks",  # held by kvtier but not loaded: recomputing them is cheaper
    "loaded_blocks",
    "load_failed_blocks",  # promised but not read (evicted meanwhile, failed verification, deadline, daemon gone)
    "load_deadline_missed",  # loads given up at their deadline (their blocks recomputed)
    "load_local_blocks",  # loaded blocks read from this node's shared memory
    "load_remote_blocks",  # loaded blocks read straight from Redis
    "load_us",  # time spent in loads that read something
    "prefill_tokens",  # tokens of the steps timed as prefill (the cost model's recompute figure)
    "prefill_us",
    "saved_blocks",
    "save_skipped_blocks",  # already resident on this node
    "save_dropped_blocks",  # no staging room in time, or the daemon unreachable
    "pinned_blocks",  # blocks finished requests asked kvtier to keep (kv_transfer_params pin_s), per chain
)


# How long a connector half's construction waits for its link's first connection. An engine in
# one process took its first request within the second its scheduler half was made, before the
# link's thread had connected, and recomputed a prefix the node held (test_disk_tier_e2e.py). A
# daemon that is down fails the try at once; one that does not answer delays the start this much.
FIRST_CONNECT_WAIT_S = 5.0


class VllmLog:
    """The link's events as the lines vLLM's log has always shown for kvtier."""

    def info(self, event: str, **kw: Any) -> None:
        if event.endswith(".connected"):
            log.info("kvtier: connected to the node daemon (node %s)", kw.get("node"))
        else:
            log.info("kvtier: %s %s", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        suppressed = kw.get("suppressed") or 0
        more = f" ({suppressed} more since the last such line)" if suppressed else ""
        if event.endswith(".call_failed"):
            log.warning("kvtier: %s failed (%s); treating as a miss%s", kw.get("op"), kw.get("error"), more)
        elif event.endswith(".connect_slow"):
            log.warning("kvtier: no connection to the node daemon after %g s; treating every call as a miss until "
                        "it is made", kw.get("waited_s"))
        elif event.endswith(".daemon_lost"):
            log.warning("kvtier: the node's kvtier daemon is not running; treating every call as a miss%s", more)
        else:
            log.warning("kvtier: %s %s", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        if event.endswith(".pool_mismatch"):
            log.error("kvtier: connector disabled, every lookup is a miss: %s", kw.get("error"))
        else:
            log.error("kvtier: %s %s", event, kw)

    def debug(self, event: str, **kw: Any) -> None:
        log.debug("kvtier: %s %s", event, kw)


def connector_link(pool: str, runtime_dir: str | None, staging_blocks: int, retry_s: float,
                   call_timeout_s: float, *, puts: bool) -> EngineLink:
    """The link for one connector half: the pool is checked by name until the worker knows its
    pages (WorkerMover.register sets the full spec). `puts`: the half saves blocks (a producer's
    worker), so each connection asks the daemon for grants at once (Client.prepare_puts)."""
    return EngineLink(runtime_dir=runtime_dir, spec=PoolSpec(pool),
                      counters=Counters(LINK_COUNTERS + CONNECTOR_COUNTERS), log=VllmLog(), retry_s=retry_s,
                      staging_blocks=staging_blocks, connect_timeout_s=10.0, call_timeout_s=call_timeout_s,
                      component="vllm_connector", puts=puts).start(wait_s=FIRST_CONNECT_WAIT_S)
