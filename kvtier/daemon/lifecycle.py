"""Signal handling for a graceful stop: the first SIGTERM/SIGINT starts it, the second forces it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event, log) -> Iterator[None]:
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
