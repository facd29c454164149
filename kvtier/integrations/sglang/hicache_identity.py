"""SGLang's side of the weights' identity (kvtier/integrations/weights.py).

SGLang hands a storage backend only `storage_config.model_name` (the served name, which defaults
to the model path). The rest is in the scheduler process's published server args
(`sglang.srt.runtime_context`, SGLang 0.5.23+: model_path, revision, quantization,
kv_cache_dtype, json_model_override_args; weight_version). A backend built outside a scheduler
(a harness, an older SGLang) gets them from the extra config: `model_path` or `weights_id`.

SGLang stores every fp8 KV dtype as uint8, so the host pool's dtype alone cannot tell fp8_e4m3
from fp8_e5m2: the logical kv_cache_dtype is part of the identity. `weight_version` is too, so
an in-place weights update that sets it (update_weights_from_disk) retires the old pages.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.weights import WeightsIdentity, WeightsUnknown, identify, read_config, weights_directory


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What SGLang's server args say about the model (None: not published in this process)."""

    model_path: str | None = None
    revision: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    overrides: str | None = None  # json_model_override_args
    weight_version: str | None = None


def published_model() -> ServedModel | None:
    """The scheduler's published server args; None outside a scheduler or before SGLang 0.5.23."""
    try:
        from sglang.srt.runtime_context import get_model, get_serving

        m, srv = get_model(), get_serving()
    except Exception:  # noqa: BLE001 - ImportError (older SGLang), ValueError (not published)
        return None

    def text(v: Any) -> str | None:
        return None if v is None or v == "" else str(v)

    return ServedModel(model_path=text(m.model_path), revision=text(m.revision), quantization=text(m.quantization),
                       kv_cache_dtype=text(m.kv_cache_dtype), overrides=text(m.json_model_override_args),
                       weight_version=text(getattr(srv, "weight_version", None)))


def hicache_identity(model_name: str | None, *, model_path: str | None, weights_id: str | None,
                     served: ServedModel | None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The namespace fields of the weights (WeightsIdentity.key_fields plus SGLang's
    weight_version). WeightsUnknown when neither the extra config nor SGLang says where they are."""
    s = served or ServedModel()
    path = model_path or s.model_path or model_name
    directory = None if weights_id is not None or not path else weights_directory(path, s.revision)
    if weights_id is None and directory is None:
        raise WeightsUnknown(f"kvtier cannot find the weights of {path!r} (not a local directory, not in the Hugging "
                             "Face cache): set model_path or weights_id in the extra config")
    config: dict[str, Any] = read_config(directory) if directory is not None else {}
    if s.overrides:
        try:
            config = {**config, "__overrides__": json.loads(s.overrides)}
        except ValueError as e:
            raise WeightsUnknown(f"SGLang's json_model_override_args is not JSON: {e}") from e
    identity: WeightsIdentity = identify(weights_id=weights_id, directory=directory, config=config,
                                         quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype,
                                         revision=s.revision, log=log)
    version = s.weight_version if s.weight_version not in (None, "default") else None
    return {**identity.key_fields(), "weight_version": version}


def backend_weights(storage_config: Any, settings: Any, log: Any) -> dict[str, Any]:
    """The backend's weights fields: its extra config (settings), else SGLang's published args."""
    return hicache_identity(storage_config.model_name, model_path=settings.model_path, weights_id=settings.weights_id,
                            served=published_model(), log=lambda line: log.info("sglang_hicache.weights", detail=line))
