"""The demo's config when it is asked for a disk tier (`kvtier demo --disk-mib N`): the built-in
demo pool, with a block file of N MiB in the demo's runtime directory."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from kvtier.config import DEMO_POOL


def demo_disk_config(rdir: Path, disk_mib: int) -> Path:
    pool = {f.name: getattr(DEMO_POOL, f.name) for f in fields(DEMO_POOL) if f.name != "name"}
    pool["disk_bytes"] = disk_mib << 20
    lines = [f'[disk]\ndir = "{rdir / "disk"}"\nreserve_bytes = 0\n', f"[pools.{DEMO_POOL.name}]"]
    lines += [f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {v}" for k, v in pool.items()]
    path = rdir / "demo.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
