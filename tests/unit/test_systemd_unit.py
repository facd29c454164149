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
                 "RemoveIPC=no", "NoNewPrivileges=yes", "ProtectSystem=strict"):
        assert any(s.startswith(line) for s in settings), line
    assert "PrivateDevices=yes" not in settings, "it would hide the GPU device nodes"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path: Path) -> None:
    kvtier = Path(sys.executable).with_name("kvtier")
    assert kvtier.exists()
    unit = tmp_path / "kvtier.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvtier/venv/bin/kvtier", str(kvtier)))
    out = subprocess.run(["systemd-analyze", "verify", "--recursive-errors=yes", str(unit)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
