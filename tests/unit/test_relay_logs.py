"""The sidecar's logging: one JSON object per line, on whatever sys.stderr is at the time."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest

from relay import logs


@pytest.fixture
def configured() -> Iterator[None]:
    root = logging.getLogger()
    kept = (root.handlers[:], root.level, sys.excepthook, threading.excepthook)
    logs.configure("INFO", "json")
    yield
    root.handlers[:], level, sys.excepthook, threading.excepthook = kept
    root.setLevel(level)
    logging.captureWarnings(False)


def test_lines_go_to_stderr_as_it_is_when_they_are_written(
    configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler kept the stderr of when logging was configured: once the caller swapped it
    back and closed it (pytest's capture did), a line logged at exit failed."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("t").info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("t").info("two")
    assert json.loads(second.getvalue())["message"] == "two"


def test_an_exception_no_thread_caught_is_a_json_line(
    configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)

    def fail() -> None:
        raise RuntimeError("lost in a thread")

    worker = threading.Thread(target=fail, name="worker")
    worker.start()
    worker.join()
    entry = json.loads(out.getvalue())
    assert entry["level"] == "CRITICAL"
    assert entry["message"] == "uncaught exception in thread worker"
    assert "RuntimeError: lost in a thread" in entry["exception"]


def test_librdkafkas_lines_alike_pass_once_a_minute_then_say_how_many_were_held(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the broker down every client logged every failed connection: ~14 lines a second."""
    from relay import kafka

    now = [1000.0]
    (repeats,) = [f for f in kafka.CLIENT_LOGGER.filters if isinstance(f, logs.RepeatFilter)]
    monkeypatch.setattr(repeats, "_clock", lambda: now[0])
    monkeypatch.setattr(repeats, "_seen", {})

    def refused(client: int, after_ms: int) -> None:
        kafka.CLIENT_LOGGER.error(
            "FAIL [outbox-sidecar#producer-%s] [thrd:b1:9092/bootstrap]: b1:9092/bootstrap: "
            "Connect to ipv4#10.0.0.1:9092 failed: Connection refused (after %sms in state "
            "CONNECT)",
            client,
            after_ms,
        )

    with caplog.at_level(logging.ERROR, logger="relay.librdkafka"):
        for client in range(1, 6):  # five clients, one second apart
            refused(client, client)
            now[0] += 1
        kafka.CLIENT_LOGGER.error("FATAL [outbox-sidecar#producer-9]: fenced")  # another kind
        now[0] += kafka.CLIENT_REPEATS_S
        refused(7, 0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "producer-1]" in lines[0]
    assert lines[1].endswith("fenced")
    assert "producer-7]" in lines[2]
    assert lines[2].endswith("(4 more like it in 60s)")


def test_an_outage_says_each_reason_once_and_that_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe every few seconds: a reason logged whenever it changed flooded the log when two
    alternated, or when libpq listed the addresses it tried in a shuffled order."""
    outage = logs.Outage(logging.getLogger("test.outage"), "the probe: the database")
    tried = ["connection failed: connection to server at a failed", "connection to b failed"]
    with caplog.at_level(logging.INFO, logger="test.outage"):
        for _ in range(3):
            outage.down("\n".join(tried))
            outage.down("timed out")
            outage.down("\n\t".join(reversed(tried)))  # the same attempts, another order
        outage.up()
        outage.up()
        outage.down("timed out")  # a new outage: said again
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "the probe: the database does not answer: connection failed: connection to server "
            "at a failed connection to b failed",
        ),
        ("WARNING", "the probe: the database does not answer: timed out"),
        ("INFO", "the probe: the database answers again"),
        ("WARNING", "the probe: the database does not answer: timed out"),
    ]
