"""SIGTERM / SIGINT asking a process to stop, safe against a second signal."""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)


class StopOnSignals:
    """Sets `stop` on the first SIGTERM or SIGINT and ignores the ones after it.

    A handler runs in the main thread between two bytecodes, even inside the first handler's
    `stop.set()` while that holds the event's lock: a second handler then waited for that lock
    for ever. `make run` hung so when Ctrl-C reached the sidecar just before the demo's SIGTERM.
    The flag is set before anything that takes a lock."""

    def __init__(self, stop: threading.Event, doing: str) -> None:
        self._stop = stop
        self._doing = doing  # what the log line says follows, e.g. "shutting down"
        self._received = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self._received:
            return
        self._received = True
        logger.info("received %s: %s", signal.Signals(signum).name, self._doing)
        self._stop.set()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
