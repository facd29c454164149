"""sd_notify(3) in a few lines: one datagram to $NOTIFY_SOCKET. No dependency needed."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends READY=1, WATCHDOG=1, STOPPING=1... A no-op when not run under systemd."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        addr = environ.get("NOTIFY_SOCKET", "")
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr  # '@' = abstract namespace
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and ours else None

    @property
    def enabled(self) -> bool:
        return bool(self._addr)

    def notify(self, *states: str) -> bool:
        """Best effort: a stale NOTIFY_SOCKET must not fail a start or a graceful stop."""
        if not self._addr:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto("\n".join(states).encode(), self._addr)
        except OSError:
            return False
        return True
