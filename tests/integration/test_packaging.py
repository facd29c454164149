"""Installing kvtier beside an inference engine never changes the engine's torch.

kvtier's wheel is built from this checkout, and pip is asked (`install --dry-run --report`) what
it would do to a throwaway venv whose installed torch is a tiny local stand-in distribution named
`torch`, at a version an engine might pin. With a torch inside kvtier's range the plan must leave
it alone; the negative control, a torch outside the range, must plan to replace it (which proves
the check can fail).

Everything is offline and hermetic: pip runs with no configuration files and no PIP_*
variables (`PIP_CONFIG_FILE=/dev/null`), `--no-index`, and finds only a wheelhouse built here:
the kvtier wheel, a second stand-in torch inside the range (so pip could replace torch if
kvtier's metadata asked for it), and stand-ins for every other dependency, mirroring the
name, version and requirements of what this venv has installed. No real torch can be fetched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE_TORCH = "2.13.0"  # the stand-in pip may pick if it decides to replace torch


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _pip(*args: str, target: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip"]
    if target is not None:
        cmd += ["--python", str(target / "bin" / "python")]
    run = subprocess.run([*cmd, *args], env=_pip_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{' '.join(cmd + list(args))}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def _write_wheel(dest: Path, name: str, version: str, meta: list[tuple[str, str]] = ()) -> Path:
    """A metadata-only wheel: enough for pip to install it and to resolve against it."""
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"
    info = f"{stem}.dist-info"
    files = {
        f"{info}/METADATA": "".join(f"{k}: {v}\n" for k, v in
                                    [("Metadata-Version", "2.1"), ("Name", name), ("Version", version), *meta]),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvtier-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = dest / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def _mirror_dependencies(requires: list[str], dest: Path) -> list[str]:
    """Stand-in wheels for the closure of `requires` (torch excepted), copied from this venv."""
    made: list[str] = []
    todo = [(Requirement(r), "") for r in requires]
    seen: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        for wanted in req.extras:  # redis[hiredis]: the extra's requirements too
            todo += [(Requirement(r), wanted) for r in metadata.requires(req.name) or []]
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(req.name)
        sub = dist.requires or []
        meta = [("Provides-Extra", e) for e in dist.metadata.get_all("Provides-Extra") or []]
        meta += [("Requires-Dist", r) for r in sub]
        _write_wheel(dest, dist.metadata["Name"], dist.version, meta)
        made.append(f"{dist.metadata['Name']}=={dist.version}")
        todo += [(Requirement(r), "") for r in sub]
    return made


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(wheelhouse, kvtier wheel): kvtier built from a copy of the checkout (no build/ or
    egg-info left in the tree), with this venv's setuptools and no build isolation (offline)."""
    base = tmp_path_factory.mktemp("packaging")
    src, house = base / "src", base / "wheelhouse"
    house.mkdir()
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / f, src / f)
    # Without the checkout's in-place build of the compiled copy: the wheel must build its own.
    shutil.copytree(ROOT / "kvtier", src / "kvtier", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(house), str(src))
    (kvtier_wheel,) = house.glob("kvtier-*.whl")
    with zipfile.ZipFile(kvtier_wheel) as zf:
        names = zf.namelist()
        assert any(n.startswith("kvtier/shm/_copy_hash.") and n.endswith(".so") for n in names)
        assert any(n.endswith("LICENSE-xxhash") and ".dist-info/" in n for n in names), names  # its code is in there
        (meta_path,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = zf.read(meta_path).decode()
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert any(canonicalize_name(Requirement(r).name) == "torch" for r in requires), requires
    _mirror_dependencies(requires, house)
    _write_wheel(house, "torch", WHEELHOUSE_TORCH)
    return house, kvtier_wheel


def _plan_with_installed_torch(tmp_path: Path, house: Path, kvtier_wheel: Path, torch_version: str) -> dict[str, dict]:
    """What pip would install into a venv holding a stand-in torch `torch_version`: name -> item."""
    env_dir = tmp_path / "engine-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    own = tmp_path / "own"
    own.mkdir()
    _pip("install", "--no-index", "--no-deps", str(_write_wheel(own, "torch", torch_version)), target=env_dir)
    report = tmp_path / "report.json"
    _pip("install", "--dry-run", "--no-index", "--find-links", str(house), "--report", str(report),
         str(kvtier_wheel), target=env_dir)
    plan = {canonicalize_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}
    for item in plan.values():  # nothing could come from anywhere but the wheelhouse
        url = urlparse(item["download_info"]["url"])
        assert url.scheme == "file" and Path(url2pathname(url.path)).resolve().parent == house.resolve(), url
    assert "kvtier" in plan
    return plan


@pytest.mark.parametrize("engine_torch", ["2.11.0+cu128", "2.14.1"])
def test_installing_kvtier_keeps_the_engines_torch(tmp_path: Path, wheelhouse, engine_torch: str) -> None:
    house, kvtier_wheel = wheelhouse
    plan = _plan_with_installed_torch(tmp_path, house, kvtier_wheel, engine_torch)
    assert "torch" not in plan, f"pip plans to replace torch {engine_torch} with {plan['torch']['metadata']['version']}"
    assert {"numpy", "redis", "hiredis", "msgpack"} <= plan.keys()  # the rest of kvtier resolved


def test_negative_control_torch_outside_the_range_is_replaced(tmp_path: Path, wheelhouse) -> None:
    house, kvtier_wheel = wheelhouse
    plan = _plan_with_installed_torch(tmp_path, house, kvtier_wheel, "1.13.0")
    assert "torch" in plan, "torch 1.13 is outside kvtier's range: pip should plan to replace it"
    assert plan["torch"]["metadata"]["version"] == WHEELHOUSE_TORCH
