"""The kvtier pool an SGLang backend needs, in SGLang's words: one page per block (its page size
in tokens, its page bytes). The check itself is the link's (kvtier/integrations/link.py). No
SGLang import here."""

from __future__ import annotations

from kvtier.integrations.pool_spec import PoolSpec


def pool_help(pool: str, page_size: int | None, page_bytes: int | None) -> str:
    want = f"block_tokens = {page_size}" if page_size else "block_tokens = SGLang's --page-size"
    size = f" and blocks of {page_bytes} bytes" if page_bytes else ""
    return (f"Serve a pool [pools.{pool}] with {want}{size}: for MHA, layers, kv_heads (per TP rank), "
            f"head_dim and dtype as SGLang's KV cache (block bytes = 2 x layers x kv_heads x block_tokens x "
            f"head_dim x dtype size), or any shape of the same bytes. docs/integrations/sglang.md")


def page_spec(pool: str, page_size: int | None, page_bytes: int | None) -> PoolSpec:
    """SGLang's pages as a pool must hold them (the size and bytes that are known yet)."""
    return PoolSpec(pool, block_bytes=page_bytes, block_tokens=page_size,
                    howto=lambda: pool_help(pool, page_size, page_bytes),
                    tokens_msg="SGLang's page size is {want} tokens but kvtier pool {name!r} has block_tokens = {have}",
                    bytes_msg="SGLang's pages are {want} bytes but kvtier pool {name!r} holds blocks of {have} bytes")
