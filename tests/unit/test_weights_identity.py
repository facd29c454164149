"""The weights' identity that every integration puts in its key namespace (integrations/weights.py),
on real checkpoint files: what tells two models apart, what lets a copy share, and what it reads."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kvtier.integrations.weights import (
    FILE_WINDOWS,
    WINDOW,
    WeightsUnknown,
    config_digest,
    content_fingerprint,
    identify,
)
from tests.support.checkpoints import CONFIG, copy_checkpoint, tensors, write_checkpoint, write_safetensors


def ident(directory, config=CONFIG, **kw):
    return identify(weights_id=kw.pop("weights_id", None), directory=directory, config=config,
                    quantization=kw.pop("quantization", None), kv_cache_dtype=kw.pop("kv_cache_dtype", "auto"))


def test_a_copy_elsewhere_shares_other_weights_do_not(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=1)
    copy = copy_checkpoint(a, tmp_path / "somewhere" / "else")
    b = write_checkpoint(tmp_path / "b", seed=2)
    assert ident(a) == ident(copy)
    assert ident(a).weights != ident(b).weights
    assert ident(a).weights.startswith("content:")


@pytest.mark.parametrize("tensor,index", [
    ("layers.1.norm.weight", 5),  # a small tensor: hashed whole
    ("layers.0.q.weight", 0),  # a large one's first window
    ("layers.0.q.weight", (64 * 64) // 2),  # ... its middle
    ("embed.weight", -1),  # ... its last
])
def test_a_fine_tune_that_touches_one_tensor_is_another_model(tmp_path, tensor, index):
    """Same names, shapes and header as the base: only the values differ."""
    base = write_checkpoint(tmp_path / "base", seed=1)
    tuned = tensors(1)
    flat = tuned[tensor].reshape(-1)
    flat[index] += 1.0
    ft = write_checkpoint(tmp_path / "ft", weights=tuned)
    assert (base / "model.safetensors").stat().st_size == (ft / "model.safetensors").stat().st_size
    assert ident(base).weights != ident(ft).weights


def test_what_the_engine_resolved_is_part_of_the_key(tmp_path):
    a = write_checkpoint(tmp_path / "a", seed=1)
    base = ident(a).key_fields()
    assert ident(a, quantization="fp8").key_fields() != base
    assert ident(a, kv_cache_dtype="fp8_e5m2").key_fields() != base
    assert ident(a, config={**CONFIG, "rope_scaling": {"type": "yarn", "factor": 4.0}}).key_fields() != base
    # Where or by which library the config was written is not what the model computes.
    assert ident(a, config={**CONFIG, "_name_or_path": "/x", "transformers_version": "9"}).key_fields() == base
    # The revision is readable (the manifest), not part of the key: the content decides.
    with_rev = identify(weights_id=None, directory=a, config=CONFIG, quantization=None, kv_cache_dtype="auto",
                        revision="0123abcd")
    assert with_rev.key_fields() == base and with_rev.readable()["revision"] == "0123abcd"


def test_config_digest_is_canonical_and_drops_volatile_keys_at_every_depth():
    one = {"b": 1, "a": {"x": [1, 2], "_name_or_path": "/p"}, "text_config": {"transformers_version": "5"}}
    two = {"text_config": {}, "a": {"x": [1, 2]}, "b": 1}
    assert config_digest(one) == config_digest(two)
    assert config_digest({**two, "b": 2}) != config_digest(two)


def test_the_operator_may_name_the_weights_and_nothing_is_guessed(tmp_path):
    op = identify(weights_id=" rev-7 ", directory=None, config={}, quantization=None, kv_cache_dtype=None)
    assert op.weights == "operator:rev-7"
    with pytest.raises(WeightsUnknown, match="weights_id"):
        identify(weights_id=None, directory=None, config={}, quantization=None, kv_cache_dtype=None)
    with pytest.raises(WeightsUnknown, match="non-empty"):
        identify(weights_id="  ", directory=None, config={}, quantization=None, kv_cache_dtype=None)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(WeightsUnknown, match="no weights files"):
        content_fingerprint(tmp_path / "empty")


def test_it_reads_samples_never_whole_files(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    big = {f"t{i}": np.full((256, 1024), i, dtype=np.float32) for i in range(8)}  # 8 MiB of tensors
    write_safetensors(d / "model.safetensors", big)
    (d / "extra.bin").write_bytes(np.random.default_rng(0).bytes(4 << 20))  # read as bytes, never unpickled
    fp = content_fingerprint(d)
    header = struct.unpack("<Q", (d / "model.safetensors").read_bytes()[:8])[0] + 8
    assert fp.files == 2
    assert fp.bytes_read == header + 8 * 3 * WINDOW + FILE_WINDOWS * WINDOW


def test_a_malformed_safetensors_header_is_read_as_bytes_not_believed(tmp_path):
    """A header whose length or offsets point outside the file: the file is sampled as bytes."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}" * 100)
    head = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 30]}}).encode()
    (d / "b.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\x00" * 16)
    (d / "c.safetensors").write_bytes(struct.pack("<Q", 3) + b"[1]" + b"\x00" * 16)
    fp = content_fingerprint(d)
    assert fp.files == 3 and fp.digest.startswith("content:")
    (d / "b.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\x01" * 16)
    assert content_fingerprint(d).digest != fp.digest  # still content: the bytes decide


def _vllm(target, draft=None):
    """The parts of a VllmConfig the identity reads (model_identity.py takes them duck-typed)."""
    from types import SimpleNamespace as NS

    def model(path):
        return NS(model=str(path), revision=None, quantization=None, hf_config=NS(to_dict=lambda: dict(CONFIG)))

    spec = None if draft is None else NS(draft_model_config=model(draft))
    return NS(model_config=model(target), speculative_config=spec, load_config=NS(download_dir=None),
              cache_config=NS(cache_dtype="auto"))


def test_an_eagle_draft_with_weights_of_its_own_is_part_of_the_identity(tmp_path):
    from kvtier.integrations.vllm.model_identity import draft_identity

    target = write_checkpoint(tmp_path / "target", seed=1)
    d1, d2 = write_checkpoint(tmp_path / "d1", seed=2), write_checkpoint(tmp_path / "d2", seed=3)
    assert draft_identity(_vllm(target)) is None  # no speculation, or n-gram
    assert draft_identity(_vllm(target, target)) is None  # MTP heads in the target's own checkpoint
    one, other = draft_identity(_vllm(target, d1)), draft_identity(_vllm(target, d2))
    assert one is not None and other is not None and one.key_fields() != other.key_fields()
    assert draft_identity(_vllm(target, copy_checkpoint(d1, tmp_path / "copy"))).key_fields() == one.key_fields()
    with pytest.raises(WeightsUnknown, match="draft model"):
        draft_identity(_vllm(target, tmp_path / "nowhere"))
