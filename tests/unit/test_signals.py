"""The stop signals' handler: a second signal while the first is handled must not hang."""

from __future__ import annotations

import signal
import threading

from relay.signals import StopOnSignals


def test_the_first_signal_sets_stop() -> None:
    stop = threading.Event()
    StopOnSignals(stop, "shutting down")(signal.SIGTERM, None)
    assert stop.is_set()


def test_a_second_signal_inside_the_first_ones_set_returns_at_once() -> None:
    """What the interpreter does when a signal arrives while the first handler is inside
    Event.set(): the second handler runs in the same thread, the event's lock held. The
    handler that set the event again waited for that lock for ever."""
    stop = threading.Event()
    handler = StopOnSignals(stop, "shutting down")
    handler(signal.SIGINT, None)

    def nested() -> None:
        with stop._cond:  # type: ignore[attr-defined]  # as inside the first handler's set()
            handler(signal.SIGTERM, None)

    worker = threading.Thread(target=nested, daemon=True)  # a hang stays there, not in pytest
    worker.start()
    worker.join(5)
    assert not worker.is_alive()
