"""Which vLLM KV-cache kinds the connector takes, on vLLM's own spec classes (no engine): one group
of full attention (with or without a sliding window that vLLM computes on whole blocks) or of MLA
latents, and a
clear refusal, naming the layer kind, for everything whose pages would not be a prefix's whole
state. The engines that run these kinds end to end are in test_model_kinds_e2e.py."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.integrations.vllm.connector import check_kv_groups

ATTN = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_full_attention_is_taken_with_or_without_a_window_computed_on_whole_blocks():
    check_kv_groups(config(FullAttentionSpec(**ATTN)))
    # A hybrid (sliding + full) model with vLLM's hybrid manager off: one group, every block kept.
    check_kv_groups(config(FullAttentionSpec(**ATTN, sliding_window=64)))
    # MLA: one latent page per layer and block (a FullAttentionSpec whose pages hold no V).
    check_kv_groups(config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)))


@pytest.mark.parametrize("spec,words", [
    (SlidingWindowSpec(**ATTN, sliding_window=64), "SlidingWindowSpec (sliding-window attention: vLLM frees"),
    (ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64), "ChunkedLocalAttentionSpec (chunked local"),
    (MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)), "MambaSpec (Mamba / linear-attention"),
])
def test_kinds_kvtier_does_not_carry_are_refused_by_name(spec, words):
    with pytest.raises(ValueError, match="this model's KV cache is " + words.replace("(", r"\(")):
        check_kv_groups(config(spec))


def test_several_groups_are_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"has 2 \(FullAttentionSpec, SlidingWindowSpec\).*hybrid-kv-cache"):
        check_kv_groups(config(FullAttentionSpec(**ATTN), SlidingWindowSpec(**ATTN, sliding_window=64)))
