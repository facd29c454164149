"""The gpu tier's device memory: the device to use, the preallocated pool, and its CUDA IPC handle.

With CUDA the daemon allocates the gpu tier's payload here as one device tensor [capacity,
block_bytes] (its slot headers live in a shared-memory segment of Kind.GPU_HEADERS) and exports
a CUDA IPC handle for it in the descriptor; a client imports the handle to map the same memory.
Without CUDA (device "cpu", or "auto" on a machine without a GPU) the gpu tier's pool is an
ordinary shared-memory arena instead, which clients read exactly as they read the cpu tier (and
the tests exercise that path). Callers import this module lazily: it pulls in torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvtier.errors import KvtierError


def resolve_device(spec: str) -> torch.device:
    """'auto' picks cuda:0 when CUDA works, else cpu. Asking for CUDA without it is an error."""
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KvtierError(f"device {spec!r} configured but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", 0)
        if dev.index >= torch.cuda.device_count():
            raise KvtierError(f"device {spec!r} does not exist ({torch.cuda.device_count()} GPUs)")
    return dev


def allocate_device_pool(capacity: int, block_bytes: int, device: torch.device) -> torch.Tensor:
    """Preallocate the whole pool up front so a full pool never fails an allocation later."""
    return torch.zeros((capacity, block_bytes), dtype=torch.uint8, device=device)


def export_ipc(pool: torch.Tensor) -> dict[str, list[int | str]]:
    """A JSON-able CUDA IPC handle for the pool's storage (no pickle: raw handle bytes as hex)."""
    fields = pool.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]  # private, unannotated
    return {"fields": [f.hex() if isinstance(f, bytes) else f for f in fields], "shape": list(pool.shape)}


def import_ipc(desc: Mapping[str, Any]) -> torch.Tensor:
    """Open a pool exported by `export_ipc` in another process."""
    raw = [bytes.fromhex(f) if isinstance(f, str) else f for f in desc["fields"]]
    # Opening a handle is not a lazy-init point: in a process that has not touched CUDA yet it
    # died without a word (seen on an H200, torch 2.11). Initialise first, on the pool's device.
    torch.cuda.init()  # type: ignore[no-untyped-call]  # unannotated in torch's sources
    with torch.cuda.device(int(raw[0])):
        storage = torch.UntypedStorage._new_shared_cuda(*raw)
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    t.set_(storage, 0, tuple(desc["shape"]))  # type: ignore[call-overload]  # stubs want a stride; it defaults
    return t
