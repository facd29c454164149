"""Signal handling for a graceful stop: the first SIGTERM/SIGINT starts it, the second forces it.

A graceful stop is also bounded by itself: if the process is still there `force_after_s` after
the first signal (a wedged thread or connection in the teardown), it exits with status 1 and a
`daemon.stop_timeout` line, rather than leave systemd to SIGKILL it at TimeoutStopSec.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event, log, force_after_s: float | None = None) -> Iterator[None]:
    """Install handlers for the duration of the block and restore the defaults afterwards."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            log.info("daemon.signal", signal=sig.name, action="graceful stop")
            stop.set()
            if force_after_s is not None:
                t = threading.Timer(force_after_s, _give_up, args=(log, force_after_s))
                t.daemon = True  # must not itself keep the process alive
                t.start()
        else:
            log.warning("daemon.signal", signal=sig.name, action="forced stop")
            if main is not None:
                main.cancel(msg=f"second {sig.name}")

    sigs = (signal.SIGTERM, signal.SIGINT)
    for s in sigs:
        loop.add_signal_handler(s, on_signal, s)
    try:
        yield
    finally:
        for s in sigs:
            loop.remove_signal_handler(s)


def _give_up(log, after_s: float) -> None:
    log.error("daemon.stop_timeout", after_s=after_s)
    sys.stdout.flush()
    os._exit(1)
