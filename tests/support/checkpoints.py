"""Small checkpoints on disk, as an engine would load them: config.json plus safetensors files
written in the format's own layout (8-byte header length, JSON header, tensor bytes)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_key_value_heads": 2, "rope_theta": 10000.0}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def tensors(seed: int, layers: int = 2, width: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"embed.weight": rng.standard_normal((512, width), dtype=np.float32)}
    for i in range(layers):
        out[f"layers.{i}.q.weight"] = rng.standard_normal((width, width), dtype=np.float32)
        out[f"layers.{i}.norm.weight"] = rng.standard_normal((width,), dtype=np.float32)
    return out


def write_checkpoint(directory: Path, seed: int = 0, config: dict | None = None,
                     weights: dict[str, np.ndarray] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**CONFIG, "_name_or_path": str(directory),
                                                        **(config or {})}))
    write_safetensors(directory / "model.safetensors", weights if weights is not None else tensors(seed))
    return directory


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
