"""The vLLM connector's pure parts, without vLLM: settings, the key namespace, paged copies."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvtier.integrations.vllm.connector_config import (
    ConnectorConfigError,
    ConnectorSettings,
    KeyNamespace,
    rank_salt,
    request_opt_outs,
    request_pin,
)
from kvtier.integrations.vllm.connector_copy import block_view, gather_blocks, page_shape, scatter_blocks

NS = KeyNamespace(model="m", weights='{"weights":"content:aa"}', engine_version="0.32", block_size=32, layers=2,
                  kv_heads=2, head_size=32, dtype="float32", kv_layout="LBHNC", device="cpu")


def test_settings_defaults_and_milliseconds():
    s = ConnectorSettings.from_extra_config({"pool": "p", "lookup_timeout_ms": 50, "lookup_tries": 2,
                                            "save_decode": False})
    assert (s.pool, s.lookup_timeout_s, s.lookup_tries, s.runtime_dir) == ("p", 0.05, 2, None)
    assert (s.read_through, s.load_async, s.save_decode) == (True, True, False)


def test_settings_report_every_problem_at_once():
    with pytest.raises(ConnectorConfigError) as e:
        ConnectorSettings.from_extra_config({"lookup_timeout_ms": -1, "staging_blocks": 0, "colour": "red",
                                            "load_async": "yes", "redis_wait_ms": 100})
    msg = str(e.value)
    for part in ("'pool'", "'lookup_timeout_ms'", "'staging_blocks'", "'load_async' must be true or false",
                 "unknown keys ['colour', 'redis_wait_ms']"):
        assert part in msg


def test_kv_transfer_params_opt_out_and_pin():
    assert request_opt_outs(None) == (True, True)
    assert request_opt_outs({"kvtier": {"save_decode": False}, "other": 1}) == (True, False)
    assert request_pin({"kvtier": {"pin_s": 120, "tenant": "agent-7"}}) == (120, "agent-7")
    assert request_pin({"kvtier": {"pin_s": 30}}) == (30, "")
    assert request_pin({"kvtier": {"save": False}}) is None and request_pin({"kvtier": 5}) is None
    assert request_pin("garbage") is None
    assert request_pin({"kvtier": {"pin_s": "a while"}}) == ("a while", "")  # the client refuses it (BadRequest)


def test_salt_separates_ranks_groups_tenants_and_layouts():
    base = rank_salt(NS, (0, 1), (0, 1), None)
    assert base == rank_salt(NS, (0, 1), (0, 1), None)  # deterministic across processes
    others = {
        rank_salt(NS, (1, 2), (0, 1), None), rank_salt(NS, (0, 2), (0, 1), None),
        rank_salt(NS, (0, 1), (0, 2), None), rank_salt(NS, (0, 1), (0, 1), ""),
        rank_salt(NS, (0, 1), (0, 1), "tenant-a"),
        rank_salt(KeyNamespace(**{**_fields(NS), "device": "cuda"}), (0, 1), (0, 1), None),
        rank_salt(KeyNamespace(**{**_fields(NS), "kv_layout": "NHD"}), (0, 1), (0, 1), None),
        rank_salt(KeyNamespace(**{**_fields(NS), "engine_version": "0.33"}), (0, 1), (0, 1), None),
        rank_salt(KeyNamespace(**{**_fields(NS), "weights": '{"weights":"content:bb"}'}), (0, 1), (0, 1), None),
        # A hybrid model's groups: each its own chain, and the groups' kinds in every key.
        rank_salt(NS, (0, 1), (0, 1), None, group=1),
        rank_salt(KeyNamespace(**{**_fields(NS), "groups": "full,sliding:64:0"}), (0, 1), (0, 1), None),
    }
    assert base not in others and len(others) == 11
    # The served name is readable, not part of the key: the weights decide.
    assert rank_salt(KeyNamespace(**{**_fields(NS), "model": "other"}), (0, 1), (0, 1), None) == base


def _fields(ns: KeyNamespace) -> dict:
    return {k: getattr(ns, k) for k in ns.__slots__}


@pytest.mark.parametrize("kv_outer", [False, True])
def test_gather_then_scatter_round_trips_every_byte(kv_outer):
    """Pages laid out [B, 2, H, N, C] (contiguous per block) or with K/V outside the block dim
    ([2, B, ...] seen as [B, 2, ...]: strided per block) both round-trip exactly."""
    g = torch.Generator().manual_seed(1)
    layers, blocks, page = 3, 20, (2, 4, 8, 16)
    if kv_outer:
        caches = [torch.randn(2, blocks, *page[1:], generator=g).transpose(0, 1) for _ in range(layers)]
    else:
        caches = [torch.randn(blocks, *page, generator=g) for _ in range(layers)]
    assert page_shape(caches) == page
    ids = torch.tensor([7, 3, 19, 0])
    buf = torch.empty(len(ids), layers * 2, 4, 8, 16)  # a pool block shape with the same bytes
    gather_blocks(caches, ids, block_view(buf, layers, page))
    for i, b in enumerate(ids.tolist()):
        for layer in range(layers):
            assert torch.equal(block_view(buf, layers, page)[i, layer], caches[layer][b])
    dst = [torch.zeros_like(c) for c in caches]
    scatter_blocks(block_view(buf, layers, page), dst, torch.tensor([1, 2, 3, 4]))
    for i, b in enumerate(ids.tolist()):
        for layer in range(layers):
            assert torch.equal(dst[layer][i + 1], caches[layer][b])
    untouched = [0] + list(range(5, blocks))
    assert all(not dst[layer][untouched].any() for layer in range(layers))


def test_layers_with_different_pages_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        page_shape([torch.zeros(4, 2, 8), torch.zeros(4, 2, 16)])


def test_a_requests_tenant_is_what_its_keys_are_separated_by() -> None:
    from kvtier.bus.codec import NAME_RE
    from kvtier.integrations.vllm.connector_config import request_tenant

    assert request_tenant(None, None) == ""
    assert request_tenant("secret-of-acme", None) == "salt:" + hashlib.sha256(b"secret-of-acme").hexdigest()[:8]
    assert request_tenant("s", "sql adapter/v2") == "lora:sql_adapter/v2"  # the LoRA first; no spaces
    assert NAME_RE.fullmatch(request_tenant(None, "x" * 500))
