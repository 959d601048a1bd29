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

    A handler runs in the main thread between two bytecodes, even while that thread holds the
    event's lock: inside a first handler's `stop.set()`, or inside the main loop's own
    `stop.wait()`, which holds it for a moment at each timeout. Setting the event from the
    handler then waited for that lock for ever (`make run` hung so when Ctrl-C reached the
    sidecar just before the demo's SIGTERM). So the handler only notes the signal, and a
    thread of its own sets the event (within WATCH_S)."""

    WATCH_S = 0.1

    def __init__(self, stop: threading.Event, doing: str) -> None:
        self._stop = stop
        self._doing = doing  # what the log line says follows, e.g. "shutting down"
        self._received: int | None = None  # the first signal's number
        self._watcher: threading.Thread | None = None
        self._unwatch = threading.Event()

    @property
    def received(self) -> int | None:
        """The first signal's number; None before one came."""
        return self._received

    def __call__(self, signum: int, _frame: object) -> None:
        if self._received is None:  # an attribute stored: no lock taken, nothing to wait for
            self._received = signum

    def watch(self) -> None:
        """Start the thread that sets `stop` once a signal came (install() does)."""
        if self._watcher is None:
            self._unwatch.clear()
            self._watcher = threading.Thread(
                target=self._watch, name="outbox-stop-signals", daemon=True
            )
            self._watcher.start()

    def _watch(self) -> None:
        while not self._unwatch.wait(self.WATCH_S) and not self._stop.is_set():
            if self._received is not None:
                logger.info("received %s: %s", signal.Signals(self._received).name, self._doing)
                self._stop.set()
                return

    def _unwatched(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            self._unwatch.set()
            watcher.join()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        self.watch()

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
            self._unwatched()
