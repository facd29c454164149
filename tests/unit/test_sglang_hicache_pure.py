"""The SGLang backend's pure parts: extra-config parsing, key namespaces, page byte views.

These run without SGLang (the backend itself is tested with SGLang's own classes in tests/sglang).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvtier.integrations.sglang import hicache_pages as pages
from kvtier.integrations.sglang.hicache_config import ConfigError, HiCacheSettings
from kvtier.integrations.sglang.hicache_keys import key_mapper, namespace_fields, page_key
from kvtier.shm.slots import checksum


@dataclass
class Cfg:  # the attributes of SGLang's HiCacheStorageConfig that the namespace reads
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "org/model"
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None


WEIGHTS = {"weights": "content:aa", "config": "c0", "quantization": None, "kv_cache_dtype": "auto",
           "weight_version": None}


def key_of(cfg: Cfg, key: str = "ab" * 32, layout: str = "page_first", page_size: int = 16,
           page_bytes: int = 8192, salt: str | None = None, weights: dict = WEIGHTS) -> bytes:
    m = key_mapper(namespace_fields(cfg, weights=weights, layout=layout, page_size=page_size, page_bytes=page_bytes,
                                    salt=salt))
    return page_key(m, key)


def test_settings_defaults_and_sglang_keys_pass() -> None:
    s, unknown = HiCacheSettings.from_extra({"backend_name": "kvtier", "module_path": "m", "class_name": "C",
                                             "interface_v1": 1, "pool": "p", "remote": False})
    assert (s.pool, s.remote, s.call_timeout_s, s.swa_pool, unknown) == ("p", False, 5.0, None, [])
    assert HiCacheSettings.from_extra({"swa_pool": "p-swa"})[0].swa_pool == "p-swa"


def test_settings_name_unknown_keys() -> None:
    _, unknown = HiCacheSettings.from_extra({"pool": "p", "pooll": "x", "remot": True})
    assert unknown == ["pooll", "remot"]


@pytest.mark.parametrize("extra, word", [
    ({"pool": ""}, "pool"), ({"pool": 3}, "pool"), ({"remote": "yes"}, "remote"),
    ({"call_timeout_s": 0}, "call_timeout_s"), ({"save_wait_s": float("nan")}, "save_wait_s"),
    ({"staging_blocks": 0}, "staging_blocks"), ({"staging_blocks": 2.5}, "staging_blocks"),
    ({"runtime_dir": ""}, "runtime_dir"), ({"retry_s": True}, "retry_s"), ({"swa_pool": ""}, "swa_pool"),
    ({"swa_pool": 7}, "swa_pool"),
])
def test_settings_refuse_bad_values_by_name(extra: dict, word: str) -> None:
    with pytest.raises(ConfigError, match=word):
        HiCacheSettings.from_extra(extra)


def test_keys_are_32_bytes_and_deterministic() -> None:
    a, b = key_of(Cfg()), key_of(Cfg())
    assert a == b and len(a) == 32
    assert key_of(Cfg(), key="cd" * 32) != a


@pytest.mark.parametrize("change", [
    dict(tp_rank=1, tp_size=2), dict(tp_size=2), dict(pp_size=2),
    dict(attn_cp_size=2), dict(is_mla_model=True),
])
def test_topology_changes_the_key(change: dict) -> None:
    assert key_of(Cfg(**change)) != key_of(Cfg())


@pytest.mark.parametrize("kw", [dict(layout="layer_first"), dict(page_size=32), dict(page_bytes=4096),
                                dict(salt="tenant-a")])
def test_bytes_layout_and_salt_change_the_key(kw: dict) -> None:
    assert key_of(Cfg(), **kw) != key_of(Cfg())


def test_mla_pages_are_shared_by_tp_ranks_but_not_pp_stages() -> None:
    assert key_of(Cfg(is_mla_model=True, tp_rank=0, tp_size=4)) == key_of(Cfg(is_mla_model=True, tp_rank=3, tp_size=4))
    assert key_of(Cfg(is_mla_model=True, pp_size=2, pp_rank=0)) != key_of(Cfg(is_mla_model=True, pp_size=2, pp_rank=1))


def test_page_keys_must_be_strings() -> None:
    m = key_mapper(namespace_fields(Cfg(), weights=WEIGHTS, layout="page_first", page_size=16, page_bytes=8192,
                                    salt=None))
    for bad in (b"ab", 3, None, ""):
        with pytest.raises(TypeError):
            page_key(m, bad)


def kv_buffer(size: int = 64, layers: int = 3, heads: int = 2, dim: int = 8, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((2, size, layers, heads, dim), generator=g).to(dtype)  # SGLang's MHA page_first


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_digest_of_a_strided_page_is_the_checksum_of_its_flat_bytes(layout: str) -> None:
    buf = kv_buffer() if layout == "page_first" else kv_buffer().permute(0, 2, 1, 3, 4).contiguous()
    page = buf[:, 16:32] if layout == "page_first" else buf[:, :, 16:32]
    view = pages.tensor_bytes(page)
    assert not view.flags.c_contiguous
    flat = pages.flat_bytes(page)
    assert pages.digest(view) == checksum(flat)
    assert sum(r.size for r in pages.runs(view)) == flat.size


def test_copy_in_and_out_of_a_strided_page_round_trip() -> None:
    src_buf, dst_buf = kv_buffer(), torch.zeros_like(kv_buffer())
    block = np.empty(pages.flat_bytes(src_buf[:, 0:16]).size, dtype=np.uint8)
    # Each copy returns the xxh3 of what landed, taken as it landed: that of the flat bytes.
    assert pages.copy_out(block, pages.tensor_bytes(src_buf[:, 16:32])) == checksum(block)
    assert np.array_equal(block, pages.flat_bytes(src_buf[:, 16:32]))
    landed = pages.tensor_bytes(dst_buf[:, 32:48])
    assert pages.copy_in(landed, block) == checksum(block) == pages.digest(landed)
    assert torch.equal(dst_buf[:, 32:48], src_buf[:, 16:32])
    assert not dst_buf[:, :32].any() and not dst_buf[:, 48:].any()  # nothing else written


def test_tensor_bytes_refuses_what_it_cannot_view() -> None:
    t = torch.zeros((4, 4), dtype=torch.float16)
    with pytest.raises(ValueError):
        pages.tensor_bytes(t.t()[:, :2])  # innermost dim strided


def test_host_dtype_and_geometry_change_the_key() -> None:
    def with_host(**host) -> bytes:
        m = key_mapper(namespace_fields(Cfg(), weights=WEIGHTS, layout="page_first", page_size=16, page_bytes=8192,
                                        salt=None, host={"dtype": "float8_e4m3fn", "layer_num": 2, **host}))
        return page_key(m, "ab" * 32)

    assert with_host() != with_host(dtype="float8_e5m2") != with_host(layer_num=4)
    assert with_host() == with_host()


@pytest.mark.parametrize("field", ["weights", "config", "quantization", "kv_cache_dtype", "weight_version"])
def test_the_weights_decide_not_the_served_name(field: str) -> None:
    assert key_of(Cfg(model_name="llama")) == key_of(Cfg(model_name="org/llama-copy"))
    assert key_of(Cfg(), weights={**WEIGHTS, field: "other"}) != key_of(Cfg())


def test_host_geometry_reads_what_the_pool_says() -> None:
    class Host:
        dtype = torch.bfloat16
        layer_num, head_num, head_dim = 32, 8, 128
        page_size = 64

    assert pages.host_geometry(Host()) == {"dtype": "bfloat16", "layer_num": 32, "head_num": 8, "head_dim": 128}
