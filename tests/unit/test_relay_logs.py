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
