"""A pool's block layout: shape, dtype, bytes per block and the fingerprint keys commit to."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# dtype name -> bytes per element. Names match torch's (torch.bfloat16 ...).
DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}
LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class BlockLayout:
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """One block: [num_layers, 2, num_kv_heads, block_tokens, head_dim]."""
        return (self.layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        # Plain ints, not np.prod: the daemon asks for this on every block it handles.
        return self.layers * 2 * self.kv_heads * self.block_tokens * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def fingerprint(self) -> bytes:
        """32 bytes committing to model id, dtype, shape, block_tokens and the layout version."""
        h = hashlib.sha256(b"kvtier/layout/v1")
        model = self.model.encode("utf-8")
        h.update(struct.pack("<I", len(model)) + model)
        dt = self.dtype.encode("ascii")
        h.update(struct.pack("<I", len(dt)) + dt)
        h.update(struct.pack("<6I", LAYOUT_VERSION, *self.shape))
        return h.digest()

    def to_dict(self) -> dict[str, str | int]:
        return {
            "model": self.model,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "block_tokens": self.block_tokens,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockLayout:
        return cls(
            model=str(d["model"]),
            layers=int(d["layers"]),
            kv_heads=int(d["kv_heads"]),
            head_dim=int(d["head_dim"]),
            block_tokens=int(d["block_tokens"]),
            dtype=str(d["dtype"]),
        )
