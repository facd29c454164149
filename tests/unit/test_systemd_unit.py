"""The shipped unit passes `systemd-analyze verify` (with the ExecStart pointed at this venv's kvtier)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvtier.service"


def test_unit_declares_the_contract() -> None:
    text = UNIT.read_text()
    settings = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=kvtier", "RuntimeDirectory=kvtier",
                 "RemoveIPC=no", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "TimeoutStartSec=", "StateDirectory=kvtier"):
        assert any(s.startswith(line) for s in settings), line
    assert "PrivateDevices=yes" not in settings, "it would hide the GPU device nodes"
    # The disk tier's directory is the one writable place it gets; nothing else is granted.
    assert not any(s.startswith(("ReadWritePaths=", "ProtectSystem=full", "ProtectSystem=no")) for s in settings)


EXPOSURE_MAX = 4.0  # systemd-analyze security: 3.4 today ("OK"); a regression above this fails


def _unit_here(tmp_path: Path) -> Path:
    """The shipped unit, with ExecStart pointed at this venv's kvtier (verify checks it exists)."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: run scripts/ensure-test-tools.sh (make test does)")
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists()
    unit = tmp_path / "kvtier.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvtier/venv/bin/kvtier", str(kvtier)))
    return unit


def test_unit_verifies(tmp_path: Path) -> None:
    out = subprocess.run(["systemd-analyze", "verify", "--recursive-errors=yes", str(_unit_here(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_unit_security_exposure_stays_low(tmp_path: Path) -> None:
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--threshold={EXPOSURE_MAX * 10:.0f}",
                          "--no-pager", str(_unit_here(tmp_path))], capture_output=True, text=True, timeout=60)
    score = next((ln for ln in out.stdout.splitlines() if "Overall exposure level" in ln), out.stdout[-500:])
    assert out.returncode == 0, f"exposure above {EXPOSURE_MAX}: {score}\n{out.stderr}"
