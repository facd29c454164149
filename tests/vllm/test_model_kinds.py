"""Which vLLM KV-cache kinds the connector takes, on vLLM's own spec classes (no engine): groups of
full attention, MLA latents or sliding-window attention, alone or together (vLLM's hybrid
manager), each with its rule (kv_groups.py); a clear refusal, naming the layer kind, for
everything whose pages would not be a prefix's whole state, and for groups that cannot share one
pool. The engines that run these kinds end to end are in test_model_kinds_e2e.py."""

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
from kvtier.integrations.vllm.kv_groups import FULL, MLA, SLIDING, GroupRule

ATTN = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_attention_kinds_are_taken_alone_or_together_each_with_its_rule():
    assert check_kv_groups(config(FullAttentionSpec(**ATTN))) == [GroupRule(FULL, 32)]
    # A hybrid (sliding + full) model with vLLM's hybrid manager off: one group, every block kept.
    assert check_kv_groups(config(FullAttentionSpec(**ATTN, sliding_window=64))) == [GroupRule(FULL, 32)]
    # MLA: one latent page per layer and block (a FullAttentionSpec whose pages hold no V).
    assert check_kv_groups(config(MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                   dtype=torch.bfloat16))) == [GroupRule(MLA, 16)]
    # Sliding window on every layer (Mistral-style): one group, only its window is loaded.
    assert check_kv_groups(config(SlidingWindowSpec(**ATTN, sliding_window=4096))) == [
        GroupRule(SLIDING, 32, window=4096)]
    # vLLM's hybrid manager on: one group per kind, a sliding group keeps only its window.
    assert check_kv_groups(config(FullAttentionSpec(**ATTN), SlidingWindowSpec(**ATTN, sliding_window=64))) == [
        GroupRule(FULL, 32), GroupRule(SLIDING, 32, window=64)]


@pytest.mark.parametrize("spec,words", [
    (ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64), "ChunkedLocalAttentionSpec (chunked local"),
    (MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,)), "MambaSpec (Mamba / linear-attention"),
])
def test_kinds_kvtier_does_not_carry_are_refused_by_name(spec, words):
    with pytest.raises(ValueError, match="this model's KV cache has " + words.replace("(", r"\(")):
        check_kv_groups(config(spec))
    # Beside a kind kvtier takes, too: the state it would miss is the model's.
    with pytest.raises(ValueError, match=words.split(" ")[0]):
        check_kv_groups(config(FullAttentionSpec(**ATTN), spec))


def test_groups_that_cannot_share_one_pool_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"block sizes \[16, 32\]"):
        check_kv_groups(config(FullAttentionSpec(**ATTN), SlidingWindowSpec(**{**ATTN, "block_size": 16},
                                                                              sliding_window=64)))
    with pytest.raises(ValueError, match="page shape"):
        check_kv_groups(config(FullAttentionSpec(**ATTN), SlidingWindowSpec(**{**ATTN, "head_size": 64},
                                                                              sliding_window=64)))
    uneven = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layers.0.attn", "layers.2.attn"], FullAttentionSpec(**ATTN)),
        KVCacheGroupSpec(["layers.1.attn"], SlidingWindowSpec(**ATTN, sliding_window=64))])
    with pytest.raises(ValueError, match=r"\[1, 2\] layers"):
        check_kv_groups(uneven)
