"""The relay's background connection (its ender's and claimer's): work in order, errors to the
waiter, a stuck end never holds up exit."""

import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from relay.background import BackgroundConnection


class FakeConnection(SimpleNamespace):
    """Stands in for a psycopg connection: the ender only checks and closes it."""

    closed = False
    broken = False

    def close(self) -> None:
        self.closed = True


def test_ends_run_in_order_and_an_error_reaches_the_one_who_waits() -> None:
    connections: list[FakeConnection] = []

    def connect() -> Any:
        connections.append(FakeConnection())
        return connections[-1]

    ender = BackgroundConnection(connect, "ender")
    seen: list[int] = []
    first = ender.submit(lambda conn: seen.append(1) or 1)

    def fails(conn: Any) -> int:
        raise psycopg.OperationalError("the server went away")

    second = ender.submit(fails)
    third = ender.submit(lambda conn: seen.append(3) or 3)
    assert first.result(5) == 1
    with pytest.raises(psycopg.OperationalError, match="went away"):
        second.result(5)
    assert third.result(5) == 3
    assert seen == [1, 3]
    # the connection a database error left in doubt was closed; the next end made a new one
    assert [c.closed for c in connections] == [True, False]
    ender.close(timeout=5)
    assert connections[-1].closed
    with pytest.raises(RuntimeError, match="closed"):
        ender.submit(lambda conn: None)


def test_an_end_that_never_returns_does_not_keep_the_process_alive() -> None:
    script = textwrap.dedent(
        """
        import threading
        from types import SimpleNamespace
        from relay.background import BackgroundConnection

        ender = BackgroundConnection(lambda: SimpleNamespace(closed=False, broken=False), "ender")
        started = threading.Event()
        ender.submit(lambda conn: (started.set(), threading.Event().wait()))
        started.wait(10)
        ender.close(timeout=0.1)  # the shutdown grace ran out
        print("exiting")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting"


def test_close_waits_for_the_ends_submitted() -> None:
    release = threading.Event()
    ender = BackgroundConnection(lambda: FakeConnection(), "ender")
    ended: list[str] = []
    ender.submit(lambda conn: (release.wait(5), ended.append("a")))
    closing = threading.Thread(target=ender.close, kwargs={"timeout": 10})
    closing.start()
    closing.join(0.2)
    assert closing.is_alive()
    release.set()
    closing.join(10)
    assert ended == ["a"]


def test_a_close_that_timed_out_leaves_its_connection_to_the_thread_which_closes_it_after() -> None:
    release, started = threading.Event(), threading.Event()
    connections: list[FakeConnection] = []

    def connect() -> Any:
        connections.append(FakeConnection())
        return connections[-1]

    claimer = BackgroundConnection(connect, "claimer")
    claimer.submit(lambda conn: (started.set(), release.wait(5)))
    assert started.wait(5)
    claimer.close(timeout=0)  # a relay stopping: nothing waits for a claim any more
    assert not connections[0].closed  # still in use by the work in flight
    release.set()
    assert claimer._thread is not None
    claimer._thread.join(5)
    assert connections[0].closed
