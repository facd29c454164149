"""vLLM's primary region and kvtier's chunk pool, as the secondary tier sees them. No vLLM import."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.integrations.pool_spec import PoolSpec


def primary_rows(view: memoryview) -> np.ndarray:
    """vLLM's primary region as [num_chunks, chunk_bytes] uint8 rows over the same memory."""
    arr = np.asarray(view)
    if arr.ndim != 2:
        raise ValueError(f"the primary KV view must be 2-D [chunks, bytes], got shape {arr.shape}")
    rows = arr.view(np.uint8)
    if rows.strides != (rows.shape[1], 1) or rows.shape[1] != view.strides[0]:
        raise ValueError("the primary KV view's rows must be contiguous and unpadded "
                         f"(shape {rows.shape}, strides {rows.strides}, chunk stride {view.strides[0]})")
    return rows


def runs(idx: Sequence[int], chunk_ids: Sequence[int]) -> list[list[int]]:
    """Split job positions `idx` into runs whose chunk ids are consecutive: one tensor each."""
    out: list[list[int]] = []
    for i in idx:
        if out and chunk_ids[i] == chunk_ids[out[-1][-1]] + 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def pool_help(pool: str, chunk_bytes: int) -> str:
    return (f"Serve vLLM's chunks from a raw-bytes pool of exactly {chunk_bytes} bytes per block, e.g.\n"
            f"  [pools.{pool}]\n  model = \"<the vLLM model>\"\n  dtype = \"uint8\"\n"
            f"  layers = 1\n  kv_heads = 1\n  block_tokens = 1\n  head_dim = {chunk_bytes // 2}\n"
            f"  cpu_bytes = \"16GiB\"\n"
            f"(block bytes = layers * 2 * kv_heads * block_tokens * head_dim * dtype size), "
            f"and restart the daemon.")


def chunk_spec(pool: str, chunk_bytes: int) -> PoolSpec:
    """vLLM's offload chunks as the pool must hold them: one chunk per block, as raw bytes."""
    return PoolSpec(pool, block_bytes=chunk_bytes, howto=lambda: pool_help(pool, chunk_bytes),
                    bytes_msg="kvtier pool {name!r} holds blocks of {have} bytes, but vLLM's offload chunks are "
                              "{want} bytes")
