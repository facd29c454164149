"""kvtier as SGLang's HiCache L3 storage backend (`--hicache-storage-backend dynamic`).

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
        "pool": "llama3-8b"}'

docs/integrations/sglang.md has every key and the behaviour under each fault. The backend
subclasses SGLang's HiCacheStorage, so it is imported on first use (SGLang's factory asks for
the attribute): the pure modules beside it (config, keys, pages) import without SGLang.
"""

from typing import Any

__all__ = ["KvtierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KvtierHiCacheStorage":
        from kvtier.integrations.sglang.hicache import KvtierHiCacheStorage

        return KvtierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
