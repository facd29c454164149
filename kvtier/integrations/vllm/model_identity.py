"""vLLM's side of the weights' identity (kvtier/integrations/weights.py): where the loaded weights
are, the effective config, the quantization and the KV-cache dtype, from what vLLM hands the
connector (a VllmConfig) or a secondary tier (its OffloadingConfig, which has less).

vLLM does not keep the directory it loaded the weights from: a local path is `model_config.model`
itself; a Hub id is found again in the Hugging Face cache at the revision vLLM resolved (both
connector halves are built after the weights are loaded, so the files are there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.integrations.weights import WeightsIdentity, WeightsUnknown, identify, read_config, weights_directory

DUMMY_WEIGHTS = "vllm-dummy-weights"  # load_format="dummy": vLLM's fixed-seed random weights


def _commit(revision: object) -> str | None:
    """vLLM's revision is a ResolvedRevision (a str whose `.resolved` is the commit) or a str."""
    resolved = getattr(revision, "resolved", None)
    if isinstance(resolved, str) and resolved:
        return resolved
    return str(revision) if revision else None


def connector_identity(vllm_config: Any, weights_id: str | None,
                       log: Callable[[str], None] | None = None) -> WeightsIdentity:
    """The identity of the model a connector serves. WeightsUnknown when vLLM's weights cannot be
    found and no `weights_id` was given."""
    mc = vllm_config.model_config
    load = vllm_config.load_config
    commit = _commit(mc.revision)
    if weights_id is None and str(getattr(load, "load_format", "")) == "dummy":
        weights_id = DUMMY_WEIGHTS
    directory = None if weights_id is not None else weights_directory(str(mc.model), commit,
                                                                     getattr(load, "download_dir", None))
    if weights_id is None and directory is None:
        raise WeightsUnknown(f"the weights of {mc.model!r} are neither a local directory nor in the Hugging Face "
                             "cache; set weights_id in kv_connector_extra_config (their revision or a digest)")
    return identify(weights_id=weights_id, directory=directory, config=mc.hf_config.to_dict(),
                    quantization=mc.quantization, kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                    revision=commit, log=log)


def draft_identity(vllm_config: Any, log: Callable[[str], None] | None = None) -> WeightsIdentity | None:
    """The identity of a speculative draft model with weights of its own (EAGLE, a draft model):
    its layers' KV pages are stored with the target's, so they are part of the key. None for
    n-gram speculation, MTP heads inside the target's checkpoint, or no speculation."""
    spec = getattr(vllm_config, "speculative_config", None)
    dmc = getattr(spec, "draft_model_config", None)
    if dmc is None or str(dmc.model) == str(vllm_config.model_config.model):
        return None
    commit = _commit(getattr(dmc, "revision", None))
    directory = weights_directory(str(dmc.model), commit, getattr(vllm_config.load_config, "download_dir", None))
    if directory is None:
        raise WeightsUnknown(f"the draft model's weights {dmc.model!r} are neither a local directory nor in the "
                             "Hugging Face cache")
    # The checkpoint's config, not vLLM's live one: the drafter's model class writes into that
    # (draft_vocab_size) in the worker only, and both halves must key alike.
    return identify(weights_id=None, directory=directory, config=read_config(directory),
                    quantization=getattr(dmc, "quantization", None),
                    kv_cache_dtype=vllm_config.cache_config.cache_dtype, revision=commit, log=log)


def tier_identity(model: str, kv_dtype: str, weights_id: str | None,
                  log: Callable[[str], None] | None = None) -> WeightsIdentity:
    """The identity a secondary tier can establish: it sees only OffloadingConfig.model (the
    model's path or Hub id, and the cache dtype), so its config is the checkpoint's config.json
    (engine overrides such as hf_overrides are not seen: give such deployments a weights_id)."""
    directory = None if weights_id is not None else weights_directory(model, None, None)
    if weights_id is None and directory is None:
        raise WeightsUnknown(f"the weights of {model!r} are neither a local directory nor in the Hugging Face "
                             "cache; set weights_id in the tier's options (their revision or a digest)")
    config = read_config(directory) if directory is not None else {}
    return identify(weights_id=weights_id, directory=directory, config=config, quantization=None,
                    kv_cache_dtype=kv_dtype, log=log)
