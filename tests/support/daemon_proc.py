"""Daemon configs and daemon sets for the tests; the process harness is kvtier.tools.daemon_process."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from kvtier.tools.daemon_process import DaemonProcess

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
                 pools_toml: str | None = None, bus_url: str | None = None, redis_extra: str = "",
                 runtime_dir: Path | None = None, log_level: str = "info", disk_dir: Path | None = None,
                 disk_bytes: int = 0, disk_extra: str = "", bus_extra: str = "") -> Path:
    """A daemon config for tests: small blocks (8 KiB), fast bus timings. `pools_toml` replaces
    the default test pool with the caller's [pools.*] tables (engine tests size their own).
    `disk_dir` and `disk_bytes` give the default test pool a disk tier there, with no reserve."""
    path = directory / f"{node}.toml"
    path.write_text(f"""
[node]
id = "{node}"
runtime_dir = "{runtime_dir or directory / ('rt-' + node)}"

[log]
format = "json"
level = "{log_level}"

[redis]
url = "{redis_url}"
{f'bus_url = "{bus_url}"' if bus_url else ""}
socket_timeout_s = 2.0
{redis_extra}

[bus]
block_ms = 100
claim_idle_ms = 1000
max_deliveries = 3
{bus_extra}

[daemon]
shutdown_grace_s = 5.0
stats_interval_s = 0.1
manifest_interval_s = 0.2
persist_arena = {str(persist_arena).lower()}
off_loop_copy_bytes = 0  # every copy off the event loop: the thread path is the one tested
{extra}

[metrics]
listen = "127.0.0.1:0"  # a free port: test daemons run side by side
stream_sample_s = 0.2
""" + (f'\n[disk]\ndir = "{disk_dir}"\nreserve_bytes = 0\n{disk_extra}\n' if disk_dir else "")
        + (pools_toml if pools_toml is not None else POOL_TOML.format(name=pool, gpu=gpu, cpu=cpu))
        + (f"disk_bytes = {disk_bytes}\n" if disk_bytes else ""))
    return path


def stop_all(started: list[DaemonProcess], *, unlink_segments: bool = False) -> None:
    """Teardown: stop each daemon (kill it if it will not stop); with `unlink_segments`, also
    remove what a killed daemon left in /dev/shm for a warm restart that will not come."""
    for d in started:
        if d.alive:
            try:
                d.stop(10)
            except Exception:
                d.kill()
        if unlink_segments:
            for seg in Path("/dev/shm").glob(f"kvtier.{d.node}.*"):
                seg.unlink(missing_ok=True)


@contextlib.contextmanager
def node_daemons(directory: Path, redis_url: str, pools_toml: Callable[[], str]
                 ) -> Iterator[Callable[..., DaemonProcess]]:
    """Engine tests' nodes: real daemons on one Redis, writing blocks through to it so that another
    node finds them (`policy`), with the suite's pool tables (`pools_toml()`); stopped at exit."""
    started: list[DaemonProcess] = []

    def make(name: str = "n", pools: str | None = None, policy: str = 'redis_write = "write-through"',
             extra: str = "", redis_url: str | None = None) -> DaemonProcess:
        node = f"{name}-{uuid.uuid4().hex[:8]}"  # names /dev/shm segments: unique across sessions
        cfg = write_config(directory, node=node, redis_url=redis_url or default_url,
                           extra=f"[policy]\n{policy}\n{extra}",
                           pools_toml=pools if pools is not None else pools_toml())
        d = DaemonProcess(cfg, directory / f"rt-{node}")
        started.append(d)
        return d.start()

    default_url = redis_url
    try:
        yield make
    finally:
        stop_all(started, unlink_segments=True)
