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


def test_installed_puts_the_handlers_back_after_the_block() -> None:
    """A job run from an embedding process's main thread (a test, a notebook) must not leave
    its handler behind: a later Ctrl-C would set a dead job's event and stop nothing."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = threading.Event()
    handler = StopOnSignals(stop, "stopping")
    with handler.installed():
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGINT) is handler
        signal.raise_signal(signal.SIGINT)  # runs the handler, here in the main thread
        assert stop.is_set()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_installed_off_the_main_thread_installs_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with StopOnSignals(threading.Event(), "stopping").installed():
                assert signal.getsignal(signal.SIGTERM) == before
        except BaseException as exc:  # reported by the test's thread below
            failed.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive()
    assert failed == []
