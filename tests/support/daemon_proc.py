"""Daemon configs for the integration tests; the process harness is kvtier.tools.daemon_process."""

from __future__ import annotations

from pathlib import Path

POOL_TOML = """
[pools.{name}]
model = "test-model"
layers = 2
kv_heads = 2
head_dim = 32
block_tokens = 16
dtype = "float16"
device = "cpu"
gpu_blocks = {gpu}
cpu_blocks = {cpu}
"""


def write_config(directory: Path, *, node: str, redis_url: str, gpu: int = 8, cpu: int = 16,
                 pool: str = "t", persist_arena: bool = False, extra: str = "",
                 pools_toml: str | None = None, bus_url: str | None = None, redis_extra: str = "") -> Path:
    """A daemon config for tests: small blocks (8 KiB), fast bus timings. `pools_toml` replaces
    the default test pool with the caller's [pools.*] tables (engine tests size their own)."""
    path = directory / f"{node}.toml"
    path.write_text(f"""
[node]
id = "{node}"
runtime_dir = "{directory / ('rt-' + node)}"

[log]
format = "json"
level = "info"

[redis]
url = "{redis_url}"
{f'bus_url = "{bus_url}"' if bus_url else ""}
socket_timeout_s = 2.0
{redis_extra}

[bus]
block_ms = 100
claim_idle_ms = 1000
max_deliveries = 3

[daemon]
shutdown_grace_s = 5.0
stats_interval_s = 0.1
persist_arena = {str(persist_arena).lower()}
off_loop_copy_bytes = 0  # every copy off the event loop: the thread path is the one tested
{extra}

[metrics]
listen = "127.0.0.1:0"  # a free port: test daemons run side by side
stream_sample_s = 0.2
""" + (pools_toml if pools_toml is not None else POOL_TOML.format(name=pool, gpu=gpu, cpu=cpu)))
    return path
