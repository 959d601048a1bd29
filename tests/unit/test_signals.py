"""The stop signals' handler: a second signal while the first is handled must not hang."""

from __future__ import annotations

import signal
import threading

from relay.signals import StopOnSignals


def test_the_first_signal_sets_stop() -> None:
    stop = threading.Event()
    handler = StopOnSignals(stop, "shutting down")
    handler.watch()
    handler(signal.SIGTERM, None)
    assert stop.wait(5)


def held_while_handled(stop: threading.Event, handler: StopOnSignals, signum: int) -> None:
    """The handler run while its thread holds the event's lock, as the interpreter runs it:
    in the same thread, between two bytecodes. It must return at once."""

    def nested() -> None:
        with stop._cond:  # type: ignore[attr-defined]
            handler(signum, None)

    worker = threading.Thread(target=nested, daemon=True)  # a hang stays there, not in pytest
    worker.start()
    worker.join(5)
    assert not worker.is_alive()


def test_a_signal_while_the_main_loop_holds_the_events_lock_does_not_hang() -> None:
    """The main loop's stop.wait(1) holds the event's (not reentrant) lock for a moment at
    each timeout: a handler run then that set the event waited for that lock for ever."""
    stop = threading.Event()
    handler = StopOnSignals(stop, "shutting down")
    handler.watch()
    held_while_handled(stop, handler, signal.SIGTERM)
    assert stop.wait(5)  # set by the watching thread, once the lock was free


def test_a_second_signal_inside_the_first_ones_set_returns_at_once() -> None:
    stop = threading.Event()
    handler = StopOnSignals(stop, "shutting down")
    handler(signal.SIGINT, None)
    held_while_handled(stop, handler, signal.SIGTERM)


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
        assert stop.wait(5)
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
