"""SIGTERM / SIGINT asking a process to stop, safe against a second signal."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

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

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Installed for the block, the previous handlers back after it: for a job that an
        embedding process (a test, a notebook) runs from its main thread. Off the main thread,
        where Python refuses handlers, nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.install()
        try:
            yield
        finally:
            for sig, handler in before.items():  # None: not set from Python, the default then
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
