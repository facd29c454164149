"""The kvtier keys of SGLang's `--hicache-storage-backend-extra-config` JSON. Pure: no I/O.

SGLang passes the whole JSON object to the backend as `storage_config.extra_config`, its own keys
(backend_name, module_path, class_name, interface_v1, ...) beside ours. A value of the wrong type
or out of range is refused at start with the key's name; a key nobody knows is named in one
warning (a typo must not pass silently, and SGLang may add keys of its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# Keys SGLang itself reads from the same object (storage/backend_factory.py, cache_controller.py).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
                         "file_storage_path", "allocator"})


class ConfigError(ValueError):
    """A bad kvtier key in the extra config: SGLang's attach fails with this message."""


@dataclass(frozen=True)
class HiCacheSettings:
    pool: str = "default"  # the kvtier pool whose blocks are SGLang's pages
    swa_pool: str | None = None  # hybrid SWA models: the kvtier pool whose blocks are the SWA pool's pages
    runtime_dir: str | None = None  # the daemon's runtime dir; default: KVTIER__NODE__RUNTIME_DIR or the usual place
    remote: bool = True  # read pages this node lacks straight from Redis (read-through)
    salt: str | None = None  # mixed into every key: deployments that must never share pages
    model_path: str | None = None  # where the weights are, when SGLang does not say (hicache_identity.py)
    weights_id: str | None = None  # the weights' identity, for weights kvtier cannot read
    connect_timeout_s: float = 5.0  # one attempt to reach the daemon
    call_timeout_s: float = 5.0  # the longest one storage call may take before it counts as a miss
    remote_timeout_s: float = 2.0  # the longest a read-through may wait on Redis
    save_wait_s: float = 1.0  # how long a set waits for staging room before the rest is dropped
    retry_s: float = 2.0  # how often a backend whose daemon is down tries again
    staging_blocks: int = 128  # staging slots (one SGLang batch is up to 128 pages)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> tuple[HiCacheSettings, list[str]]:
        """(settings, unknown keys). ConfigError names the first bad value."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        for name, f in known.items():
            if name not in extra:
                continue
            v = extra[name]
            default = f.default
            if name in ("runtime_dir", "salt", "model_path", "weights_id", "swa_pool"):
                if v is not None and (not isinstance(v, str) or not v):
                    raise ConfigError(f"kvtier extra config: {name!r} must be a non-empty string, got {v!r}")
            elif name == "pool":
                if not isinstance(v, str) or not v:
                    raise ConfigError(f"kvtier extra config: 'pool' must name a kvtier pool, got {v!r}")
            elif isinstance(default, bool):
                if not isinstance(v, bool):
                    raise ConfigError(f"kvtier extra config: {name!r} must be true or false, got {v!r}")
            elif isinstance(default, int):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"kvtier extra config: {name!r} must be a whole number >= 1, got {v!r}")
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise ConfigError(f"kvtier extra config: {name!r} must be a number of seconds > 0, got {v!r}")
                v = float(v)
            values[name] = v
        return cls(**values), unknown
