"""kvtier's counters in vLLM's Prometheus registry (`KvtierConnector.build_prom_metrics`), and its
hits split by source for vLLM's `prompt_tokens_cached_by_source`."""

from __future__ import annotations

import functools
from types import SimpleNamespace as NS

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.integrations.vllm.connector import KvtierConnector


def test_each_count_becomes_a_vllm_counter_per_engine_and_microseconds_become_seconds():
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Counter, Gauge, Histogram)}
    m = KvtierConnector.build_prom_metrics(NS(kv_transfer_config=None), types, ["model_name", "engine"],
                                           {0: ["m", "0"], 1: ["m", "1"]})
    m.observe({"hit_blocks": 12, "hit_blocks_redis": 4, "load_us": 2_500_000, "load_deadline_missed": 1}, 0)
    m.observe({"hit_blocks": 3}, 1)
    m.observe({"hit_blocks": 5, "not_a_kvtier_count": 9}, 0)  # unknown names are ignored

    def value(name: str, engine: str) -> float | None:
        return reg.get_sample_value(name, {"model_name": "m", "engine": engine})

    assert value("vllm:kvtier_hit_blocks_total", "0") == 17
    assert value("vllm:kvtier_hit_blocks_total", "1") == 3
    assert value("vllm:kvtier_hit_blocks_redis_total", "0") == 4
    assert value("vllm:kvtier_load_seconds_total", "0") == 2.5
    assert value("vllm:kvtier_load_deadline_missed_total", "0") == 1
    assert value("vllm:kvtier_saved_blocks_total", "0") == 0


def test_hits_are_split_into_this_node_and_redis_for_vllms_by_source_counter():
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    c = KvtierConnector.__new__(KvtierConnector)  # the split reads only the planner
    c._planner = NS(redis_tokens=lambda request: 96)
    assert c.get_external_cache_hit_sources(NS(request_id="r"), 320) == {CacheHitSource.HOST: 224,
                                                                          CacheHitSource.P2P: 96}
    c._planner = NS(redis_tokens=lambda request: 0)
    assert c.get_external_cache_hit_sources(NS(request_id="r"), 64) == {CacheHitSource.HOST: 64}
