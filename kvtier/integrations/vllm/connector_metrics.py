"""kvtier's counters in vLLM's own Prometheus registry (`/metrics` of `vllm serve`).

vLLM hands every step's `KvtierConnectorStats` data (counter deltas, summed over the workers and
the scheduler) to `observe`. Each counter becomes `vllm:kvtier_<name>` with vLLM's per-engine
labels; `load_us` and `prefill_us` are exported in seconds (`vllm:kvtier_load_seconds`,
`vllm:kvtier_prefill_seconds`). vLLM's own `vllm:external_prefix_cache_hits` and
`vllm:prompt_tokens_cached_by_source` already count kvtier's hits by source.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.integrations.link import LINK_COUNTERS
from kvtier.integrations.vllm.connector_link import CONNECTOR_COUNTERS

MICROSECONDS = {"load_us": "load_seconds", "prefill_us": "prefill_seconds"}


def metric_name(counter: str) -> str:
    return "vllm:kvtier_" + MICROSECONDS.get(counter, counter)


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for name in LINK_COUNTERS + CONNECTOR_COUNTERS:
            what = "seconds" if name in MICROSECONDS else "count"
            counter = self._counter_cls(name=metric_name(name), labelnames=labelnames,
                                        documentation=f"kvtier connector: {name.replace('_', ' ')} ({what})")
            self._metrics[name] = create_metric_per_engine(counter, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._metrics.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value / 1e6 if name in MICROSECONDS else value)
