"""`KvtierConnector`: a vLLM v1 KV connector backed by the node's kvtier daemon.

Enable it with no vLLM patch (docs/integrations/vllm.md has the whole story):

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool": "llama3-8b", "runtime_dir": "/run/kvtier"}}'

This module is the thin adapter: vLLM's names and types in, kvtier's planner (scheduler
process) and mover (worker processes) out. It is the only place that imports vLLM.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

from kvtier.integrations.namespaced_keys import namespace_bytes
from kvtier.integrations.vllm.connector_config import ConnectorSettings, KeyNamespace, namespace_id
from kvtier.integrations.vllm.connector_link import connector_link
from kvtier.integrations.vllm.connector_scheduler import SchedulerPlanner
from kvtier.integrations.vllm.connector_transfers import BlockTransfer
from kvtier.integrations.vllm.connector_worker import WorkerMover
from kvtier.integrations.vllm.kv_groups import FULL, MLA, SLIDING, GroupRule, describe_groups
from kvtier.integrations.vllm.model_identity import connector_identity, draft_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm.kvtier")  # a child of vLLM's logger: its handlers and format


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    step_tokens: int = 0
    held: bool = False


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Block counts since the last report, summed over workers (vLLM logs and exports them)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# What a KV-cache spec kvtier does not take holds, and why.
UNSUPPORTED_KINDS = {
    "ChunkedLocalAttentionSpec": "chunked local attention: vLLM frees the blocks of past chunks",
    "MambaSpec": "Mamba / linear-attention state, which kvtier does not carry",
    "CrossAttentionSpec": "encoder-decoder cross-attention",
    "EncoderOnlyAttentionSpec": "encoder-only attention (no KV cache to reuse)",
    "UniformTypeKVCacheSpecs": "layers with different page shapes in one group",
}


def _rule(spec) -> GroupRule:
    kind = type(spec)
    if kind is SlidingWindowSpec:
        return GroupRule(SLIDING, int(spec.block_size), int(spec.sliding_window),
                         int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if kind in (FullAttentionSpec, MLAAttentionSpec):  # MLA: one latent page a layer
        return GroupRule(MLA if kind is MLAAttentionSpec else FULL, int(spec.block_size))
    name = kind.__name__
    raise ValueError(f"kvtier's connector stores attention KV pages (full, MLA or sliding-window); this model's "
                     f"KV cache has {name} ({UNSUPPORTED_KINDS.get(name, 'a kind kvtier does not know')})")


def check_kv_groups(kv_cache_config: KVCacheConfig) -> list[GroupRule]:
    """Each KV-cache group's rule (kv_groups.py); ValueError naming the layer kind when the
    pages kvtier stores would not be the whole state a prefix needs, or the groups do not fit
    one pool (one block size, one number of layers)."""
    groups = kv_cache_config.kv_cache_groups
    rules = [_rule(g.kv_cache_spec) for g in groups]
    sizes = sorted({len(g.layer_names) for g in groups})
    pages = sorted({f"{g.kv_cache_spec.num_kv_heads}x{g.kv_cache_spec.head_size} {g.kv_cache_spec.dtype}"
                    for g in groups})
    if len({r.block_size for r in rules}) > 1 or len(sizes) > 1 or len(pages) > 1:
        raise ValueError("kvtier's connector keeps every KV-cache group in one pool, so the groups must share a "
                         f"block size, a number of layers and a page shape; this model's have block sizes "
                         f"{sorted({r.block_size for r in rules})}, {sizes} layers and pages {pages}")
    return rules


def key_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  weights_id: str | None = None) -> KeyNamespace:
    """ValueError (WeightsUnknown among them) when the connector cannot key this model safely."""
    rules = check_kv_groups(kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    model = vllm_config.model_config
    served = model.served_model_name
    identity = connector_identity(vllm_config, weights_id, log=lambda line: log.info("kvtier: %s", line))
    weights = identity.key_fields()
    draft = draft_identity(vllm_config, log=lambda line: log.info("kvtier: draft model %s", line))
    if draft is not None:  # EAGLE: the drafter's layers are in every block too
        weights["draft"] = draft.key_fields()
    return KeyNamespace(
        model=str(served[0] if isinstance(served, (list, tuple)) else served or model.model),
        weights=namespace_bytes(weights).decode(),
        engine_version=".".join(vllm.__version__.split(".")[:2]),
        block_size=int(spec.block_size),
        layers=len(groups[0].layer_names),
        kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=str(spec.dtype).removeprefix("torch."),
        kv_layout=str(getattr(kv_cache_config, "kv_cache_layout", "") or ""),
        device=str(vllm_config.device_config.device_type),
        groups=describe_groups(rules),
        revision=identity.revision,
    )


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV-cache manager on for models with several groups
    (sliding-window and full layers); each group's blocks are moved on their own chain."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        settings = ConnectorSettings.from_extra_config(cfg.kv_connector_extra_config)
        self._link = connector_link(settings.pool, settings.runtime_dir, settings.staging_blocks, settings.retry_s,
                                    settings.call_timeout_s,
                                    puts=role != KVConnectorRole.SCHEDULER and cfg.is_kv_producer)
        self._planner: SchedulerPlanner | None = None
        self._mover: WorkerMover | None = None
        self._load_errors: set[int] = set()
        self._recent_finished: deque[set[str]] = deque(maxlen=16)  # finished_req_ids of recent steps
        self._reported: dict[str, int] = {}
        try:
            ns = key_namespace(vllm_config, kv_cache_config, settings.weights_id)
        except ValueError as e:
            log.error("kvtier: connector disabled, every lookup is a miss: %s", e)
            return
        # Both halves must key alike (a difference is every lookup a miss): their logs say so.
        log.info("kvtier: %s keys in namespace %s (groups %s)", role.name.lower(), namespace_id(ns), ns.groups)
        par = vllm_config.parallel_config
        tp_size, pp_size = par.tensor_parallel_size, par.pipeline_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            if cfg.kv_load_failure_policy == "fail":
                log.warning("kvtier: kv_load_failure_policy is 'fail': a block evicted between lookup and load "
                            "fails its request; set it to 'recompute' to recompute such blocks instead")
            ranks = [((t, tp_size), (p, pp_size)) for t in range(tp_size) for p in range(pp_size)]
            spec = vllm_config.speculative_config
            # One block of every layer of a rank: K and V (an MLA page holds one latent).
            per_token = ns.kv_heads * ns.head_size * getattr(torch, ns.dtype, torch.float16).itemsize
            block_bytes = ns.layers * ns.block_size * per_token * (1 if "mla" in ns.groups else 2)
            self._planner = SchedulerPlanner(settings, ns, self._link, ranks, load=cfg.is_kv_consumer,
                                             save=cfg.is_kv_producer, rules=check_kv_groups(kv_cache_config),
                                             block_bytes=block_bytes,
                                             spec_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0))
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            tp = (get_tensor_model_parallel_rank() if tp_size > 1 else 0, tp_size)
            pp = (get_pp_group().rank_in_group if pp_size > 1 else 0, pp_size)
            self._mover = WorkerMover(settings, ns, self._link, tp, pp,
                                      [g.layer_names for g in kv_cache_config.kv_cache_groups])

    # --- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._planner is None:
            return 0, False
        return self._planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._planner is not None:
            self._planner.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """vLLM's prompt_tokens_cached_by_source: this node's tiers as host, Redis as p2p (the
        KV crossed the network from another node's save)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        redis = 0 if self._planner is None else min(self._planner.redis_tokens(request), num_external_tokens)
        split = {CacheHitSource.HOST: num_external_tokens - redis, CacheHitSource.P2P: redis}
        return {k: v for k, v in split.items() if v}

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._planner is None:
            return KvtierConnectorMetadata()
        plan = self._planner.build(scheduler_output)
        return KvtierConnectorMetadata(plan.loads, plan.saves, plan.step_tokens, plan.held)

    def update_connector_output(self, connector_output) -> None:
        if self._planner is None:
            return
        self._planner.loads_over(connector_output.finished_recving, connector_output.invalid_block_ids)
        stats = getattr(connector_output, "kv_connector_stats", None)
        if stats is not None and stats.data:
            self._planner.workers_report(stats.data)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM keeps the blocks) while the blocks the last steps computed are saved."""
        return (self._planner is not None and self._planner.finished(request, block_ids)), None

    # --- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        if self._mover is not None:
            self._mover.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._mover is not None and isinstance(connector_metadata, KvtierConnectorMetadata):
            self._mover.step_started(connector_metadata.step_tokens, connector_metadata.held)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._mover is not None and isinstance(meta, KvtierConnectorMetadata) and meta.loads:
            self._load_errors |= self._mover.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole blocks (every layer), done before the request is scheduled

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads that are over (their failed blocks go to
        get_block_ids_with_load_errors in the same step), and finished requests whose last
        save is staged."""
        if self._mover is None:
            return None, None
        recving, failed = self._mover.finished_loads()
        self._load_errors |= failed
        # A finished request's last save comes in the step whose finished_req_ids names it (both
        # from the schedule() after request_finished); with speculative drafts wait_for_save runs
        # after this call, so the save is reported a step later: recent steps' ids are kept.
        self._recent_finished.append(set(finished_req_ids))
        sending = {r for r in self._mover.sent if any(r in ids for ids in self._recent_finished)}
        self._mover.sent -= sending
        return sending or None, recving or None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a kvtier block spans all layers: wait_for_save stages it once they are all computed

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._mover is not None and isinstance(meta, KvtierConnectorMetadata):
            self._mover.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        now = self._link.counters.snapshot()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        self._reported = now
        return KvtierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from kvtier.integrations.vllm.connector_metrics import KvtierPromMetrics

        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, never an error

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.report(now_too=True)
        if self._mover is not None:
            self._mover.close()
            counts = self._link.counters.snapshot()
            log.info("kvtier: worker %s", " ".join(f"{k}={v}" for k, v in counts.items() if v))
        self._link.close()
