"""Copies between vLLM's paged KV caches and kvtier blocks. Pure torch: no vLLM, no I/O.

vLLM gives one tensor per attention layer, blocks at dim 0 (`[num_blocks, *page]`, the page's
inner order is the attention backend's own). A kvtier block for the connector is the pages of
one vLLM block for every layer of this rank, in layer order: `[layers, *page]` reinterpreted as
the pool's `[layers, 2, kv_heads, block_tokens, head_dim]`. The bytes are copied as vLLM lays
them out, never transposed; the key's salt commits to that layout (connector_config.py), so a
block is only ever read back by an engine that lays pages out the same way.

Works on CPU and CUDA tensors alike: the same index_select / index_copy_ on either device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def page_shape(kv_caches: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The per-block page shape shared by every layer; ValueError when layers differ."""
    shapes = {tuple(t.shape[1:]) for t in kv_caches}
    dtypes = {t.dtype for t in kv_caches}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"layers disagree on page shape or dtype: {sorted(shapes)} {sorted(map(str, dtypes))}")
    return shapes.pop()


def block_view(buf: torch.Tensor, layers: int, page: tuple[int, ...]) -> torch.Tensor:
    """A `[n, *pool_block_shape]` buffer seen as `[n, layers, *page]` (same bytes)."""
    return buf.view(buf.shape[0], layers, *page)


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[i, l] = kv_caches[l][block_ids[i]]: vLLM pages -> kvtier blocks. `out` is
    `[>= len(block_ids), layers, *page]` on the caches' device."""
    n = block_ids.numel()
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache, 0, block_ids, out=out[:n, layer])


def copy_block(kv_caches: Sequence[torch.Tensor], block_id: int, dst: torch.Tensor) -> None:
    """dst[l] = kv_caches[l][block_id] for one block; `dst` is `[layers, *page]`, e.g. a staging
    slot seen as the caches' dtype (the save path's one copy per page)."""
    for layer, cache in enumerate(kv_caches):
        dst[layer].copy_(cache[block_id])


def scatter_blocks(src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """kv_caches[l][block_ids[i]] = src[i, l]: kvtier blocks -> vLLM pages."""
    n = block_ids.numel()
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(0, block_ids, src[:n, layer])
