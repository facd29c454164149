"""Block keys (kvtier/keys.py) and block layouts (kvtier/layout.py): pure functions, no I/O.

Expected values are computed independently here with hashlib + struct from the scheme that
docs/architecture.md ("Keys") and the module docstrings fix, and the first keys of one concrete
input are pinned as literal hex so any change to the scheme fails loudly.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import BadRequest
from kvtier.keys import KEY_BYTES, chain_keys, check_key, check_keys, encode_tokens, root_key
from kvtier.layout import BlockLayout

SMALL = BlockLayout("m", 2, 2, 4, 16, "float16")
LLAMA3_8B = BlockLayout("meta-llama/Meta-Llama-3-8B", 32, 8, 128, 16, "bfloat16")

# Pinned: a change here means every cached block in every tier becomes unreachable.
SMALL_FINGERPRINT_HEX = "89b4ceb82f2b993680b1a44d086de38e9508d934d0e73f666e6fee45538aab30"
SMALL_TENANT_A_KEY0_HEX = "db720856c94f93f80b6af3f97dbbe8fd340b4283827f5a7ba30b29b1fe439093"
SMALL_TENANT_A_KEY1_HEX = "b75aa4652669b3eac7e58dc8ed8852d089fa405fea57ff8ea91a36fda199066c"


# --- an independent reference implementation of the documented scheme ---------------------------


def ref_fingerprint(model: str, layers: int, kv_heads: int, head_dim: int, block_tokens: int, dtype: str) -> bytes:
    h = hashlib.sha256(b"kvtier/layout/v1")
    for s in (model.encode("utf-8"), dtype.encode("ascii")):
        h.update(struct.pack("<I", len(s)) + s)
    h.update(struct.pack("<6I", 1, layers, 2, kv_heads, block_tokens, head_dim))
    return h.digest()


def ref_field(tag: bytes, value: bytes | None) -> bytes:
    return tag + b"\x00" if value is None else tag + b"\x01" + struct.pack("<I", len(value)) + value


def ref_root(fp: bytes, salt: bytes | None, lora: str | None) -> bytes:
    return hashlib.sha256(
        ref_field(b"D", b"kvtier/root/v1") + ref_field(b"F", fp) + ref_field(b"S", salt)
        + ref_field(b"L", None if lora is None else lora.encode("utf-8"))
    ).digest()


def ref_chain(root: bytes, tokens: list[int], block_tokens: int) -> list[bytes]:
    keys, prev = [], root
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_tokens}I", *block)).digest()
        keys.append(prev)
    return keys


def keys_for(tokens, salt: bytes | None = None, lora: str | None = None, layout: BlockLayout = SMALL) -> list[bytes]:
    return chain_keys(root_key(layout.fingerprint, salt, lora), tokens, layout.block_tokens)


# --- fixed test vectors --------------------------------------------------------------------------


def test_layout_fingerprint_matches_reference_and_pinned_hex() -> None:
    assert SMALL.fingerprint == ref_fingerprint("m", 2, 2, 4, 16, "float16")
    assert SMALL.fingerprint.hex() == SMALL_FINGERPRINT_HEX


def test_root_and_chain_match_reference_and_pinned_hex() -> None:
    root = root_key(SMALL.fingerprint, b"tenant-a", None)
    assert root == ref_root(bytes.fromhex(SMALL_FINGERPRINT_HEX), b"tenant-a", None)
    keys = chain_keys(root, list(range(40)), 16)
    assert keys == ref_chain(root, list(range(40)), 16)
    assert [k.hex() for k in keys] == [SMALL_TENANT_A_KEY0_HEX, SMALL_TENANT_A_KEY1_HEX]


@pytest.mark.parametrize("salt, lora", [(None, None), (b"", None), (b"x" * 300, "adapter-7"), (None, "")])
def test_root_matches_reference_for_every_field_shape(salt: bytes | None, lora: str | None) -> None:
    assert root_key(SMALL.fingerprint, salt, lora) == ref_root(SMALL.fingerprint, salt, lora)


# --- token encoding ------------------------------------------------------------------------------


def test_token_ids_above_255_and_up_to_u32_max_work() -> None:
    tokens = [0, 255, 256, 65_535, 65_536, 128_000, 2**31, 2**32 - 1] * 2
    root = root_key(SMALL.fingerprint)
    keys = chain_keys(root, tokens, 16)
    assert keys == ref_chain(root, tokens, 16)
    assert encode_tokens(tokens).tobytes() == struct.pack("<16I", *tokens)


@pytest.mark.parametrize("bad", [[-1], [2**32], [0] * 15 + [2**32 + 5], [2**64], [1.5], [[1, 2]], np.array([True])])
def test_out_of_range_or_non_integer_token_ids_raise_bad_request(bad) -> None:
    with pytest.raises(BadRequest):
        chain_keys(root_key(SMALL.fingerprint), bad, 1)


@pytest.mark.parametrize("dtype", ["<u4", ">u4", "int64", "uint64", "int32", "uint16"])
def test_numpy_arrays_and_lists_give_the_same_keys(dtype: str) -> None:
    tokens = [(i * 977) % 60_000 for i in range(48)]
    assert keys_for(np.array(tokens, dtype=dtype)) == keys_for(tokens) == keys_for(tuple(tokens))


def test_partial_trailing_block_gets_no_key() -> None:
    assert len(keys_for(list(range(15)))) == 0
    assert len(keys_for([])) == 0
    assert keys_for(list(range(47))) == keys_for(list(range(32)))
    assert len(keys_for(list(range(48)))) == 3


def test_keys_are_32_bytes_and_never_truncated() -> None:
    keys = keys_for(list(range(160)))
    assert len(keys) == 10
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES == 32 for k in keys)
    assert len(set(keys)) == 10
    assert len(root_key(SMALL.fingerprint)) == 32


def test_chaining_token_0_changes_every_key_block_3_change_keeps_earlier() -> None:
    base = list(range(100, 180))  # 5 blocks
    keys = keys_for(base)
    first = list(base)
    first[0] += 1
    assert all(a != b for a, b in zip(keys, keys_for(first), strict=True))
    later = list(base)
    later[3 * 16 + 5] += 1
    changed = keys_for(later)
    assert changed[:3] == keys[:3]
    assert changed[3] != keys[3] and changed[4] != keys[4]


def test_chain_keys_rejects_bad_arguments() -> None:
    with pytest.raises(BadRequest):
        chain_keys(root_key(SMALL.fingerprint), [1, 2], 0)
    with pytest.raises(BadRequest):
        chain_keys(b"\x00" * 31, [1, 2], 1)
    with pytest.raises(BadRequest):
        root_key(b"\x00" * 16)
    with pytest.raises(BadRequest):
        root_key(SMALL.fingerprint, "tenant-a")  # type: ignore[arg-type]


# --- separation between tenants, adapters and layouts --------------------------------------------


def test_salts_loras_and_layouts_never_share_a_key() -> None:
    tokens = list(range(64))
    other = BlockLayout("m", 2, 2, 4, 16, "bfloat16")
    variants = [
        keys_for(tokens), keys_for(tokens, b""), keys_for(tokens, b"tenant-a"), keys_for(tokens, b"tenant-b"),
        keys_for(tokens, lora=""), keys_for(tokens, lora="lora-1"), keys_for(tokens, b"tenant-a", "lora-1"),
        keys_for(tokens, layout=other),
    ]
    flat = [k for ks in variants for k in ks]
    assert len(flat) == 8 * 4 and len(set(flat)) == len(flat)


def test_none_and_empty_salt_or_lora_differ() -> None:
    fp = SMALL.fingerprint
    assert root_key(fp, None) != root_key(fp, b"")
    assert root_key(fp, None, None) != root_key(fp, None, "")


def test_length_prefix_separates_field_splits() -> None:
    fp = SMALL.fingerprint
    # The bytes "abc" split differently between salt and LoRA id must give different roots.
    assert root_key(fp, b"a", "bc") != root_key(fp, b"ab", "c")
    assert root_key(fp, b"", "abc") != root_key(fp, b"abc", "")
    assert root_key(fp, b"abc", None) != root_key(fp, None, "abc")
    # A salt that embeds what an un-prefixed encoding of the LoRA field would look like.
    assert root_key(fp, b"x" + b"L\x01\x01\x00\x00\x00y", None) != root_key(fp, b"x", "y")


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=80),
    salt_a=st.binary(max_size=24),
    salt_b=st.binary(max_size=24),
)
def test_distinct_salts_never_share_a_key(tokens: list[int], salt_a: bytes, salt_b: bytes) -> None:
    if salt_a == salt_b:
        salt_b = salt_b + b"\x00"
    a, b = keys_for(tokens, salt_a), keys_for(tokens, salt_b)
    assert len(a) == len(b) == len(tokens) // 16
    assert not set(a) & set(b)
    assert keys_for(np.array(tokens, dtype=np.uint32), salt_a) == a


# --- check_key -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ok", [bytes(32), bytearray(32), memoryview(bytes(range(32)))])
def test_check_key_accepts_32_bytes(ok) -> None:
    out = check_key(ok)
    assert type(out) is bytes and out == bytes(ok)


@pytest.mark.parametrize("bad", [b"", bytes(31), bytes(33), bytes(64), "a" * 32, 0, None, list(range(32))])
def test_check_key_rejects_wrong_length_or_type(bad) -> None:
    with pytest.raises(BadRequest):
        check_key(bad)


@pytest.mark.parametrize("bad", [b"", bytes(33), "a" * 32, None])
def test_check_keys_checks_each_key_as_check_key_does(bad) -> None:
    keys = [bytes(32), bytearray(b"\x01" * 32), memoryview(bytes(range(32)))]
    out = check_keys(iter(keys))  # any iterable, once
    assert [type(k) for k in out] == [bytes] * 3 and out == [bytes(k) for k in keys]
    plain = [bytes([i]) * 32 for i in range(3)]
    assert check_keys(plain) == plain
    with pytest.raises(BadRequest):
        check_keys([*plain, bad])


# --- BlockLayout ---------------------------------------------------------------------------------


def test_llama3_8b_block_is_exactly_2_mib() -> None:
    assert LLAMA3_8B.shape == (32, 2, 8, 16, 128)
    assert LLAMA3_8B.block_bytes == 2 * 1024 * 1024


@pytest.mark.parametrize("dtype, size",
                         [("float32", 4), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1), ("uint8", 1)])
def test_block_bytes_scale_with_dtype(dtype: str, size: int) -> None:
    layout = BlockLayout("m", 3, 5, 7, 11, dtype)
    assert layout.shape == (3, 2, 5, 11, 7)
    assert layout.block_bytes == 3 * 2 * 5 * 11 * 7 * size


def test_to_dict_from_dict_roundtrip() -> None:
    d = LLAMA3_8B.to_dict()
    assert d == {"model": "meta-llama/Meta-Llama-3-8B", "layers": 32, "kv_heads": 8, "head_dim": 128,
                 "block_tokens": 16, "dtype": "bfloat16"}
    back = BlockLayout.from_dict(d)
    assert back == LLAMA3_8B and back.fingerprint == LLAMA3_8B.fingerprint


def test_fingerprint_differs_per_model_dtype_and_shape() -> None:
    variants = [
        SMALL, BlockLayout("m2", 2, 2, 4, 16, "float16"), BlockLayout("m", 2, 2, 4, 16, "bfloat16"),
        BlockLayout("m", 3, 2, 4, 16, "float16"), BlockLayout("m", 2, 4, 4, 16, "float16"),
        BlockLayout("m", 2, 2, 8, 16, "float16"), BlockLayout("m", 2, 2, 4, 32, "float16"),
        BlockLayout("m", 2, 2, 16, 4, "float16"),  # head_dim and block_tokens swapped
    ]
    fps = [v.fingerprint for v in variants]
    assert all(len(f) == 32 for f in fps)
    assert len(set(fps)) == len(fps)
    for v in variants:
        assert v.fingerprint == ref_fingerprint(v.model, v.layers, v.kv_heads, v.head_dim, v.block_tokens, v.dtype)
