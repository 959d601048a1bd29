"""Structured logging for the sidecar process (the library itself never configures logging)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_REPEATS_KEPT = 1000  # kinds of line a RepeatFilter remembers at most


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, exception, and any `extra`."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to sys.stderr as it is at each line, not as it was when configured: a caller that
    swaps it (pytest's capture) closed the one kept, and a line logged at exit then failed."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(level: str, fmt: str) -> None:
    """The sidecar's logging. Whatever else would reach stderr on its own goes through it too:
    warnings, and exceptions no code caught (in any thread), so that JSON logs stay one object
    per line."""
    handler = _StderrHandler()
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def configure_from_environment() -> None:
    """Before the settings are read (a process that fails to read them logs why, as JSON too):
    OUTBOX_LOG_LEVEL and OUTBOX_LOG_FORMAT as the settings would take them."""
    level = os.environ.get("OUTBOX_LOG_LEVEL", "INFO").upper()
    fmt = os.environ.get("OUTBOX_LOG_FORMAT", "json").lower()
    configure(level if level in _LEVELS else "INFO", "text" if fmt == "text" else "json")


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("outbox").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    logging.getLogger("outbox").critical(
        "uncaught exception in thread %s",
        args.thread.name if args.thread is not None else "?",
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


class RepeatFilter(logging.Filter):
    """Lets a line through once per `window_s` among those alike (the same once `alike` has
    rewritten them), and says with the next one let through how many were held back.

    For librdkafka's lines: with the broker down, every client logs every failed connection
    attempt, ~14 lines a second from one relay (each recovery makes a new producer, which
    tries again from its shortest backoff)."""

    def __init__(
        self,
        window_s: float,
        alike: Callable[[str], str] = lambda text: text,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self._alike = alike
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # alike -> (let through at, held since)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = self._alike(text)
        now = self._clock()
        passed_at, held = self._seen.get(key, (-math.inf, 0))
        if now - passed_at < self.window_s:
            self._seen[key] = (passed_at, held + 1)
            return False
        if len(self._seen) >= _REPEATS_KEPT:  # lines alike only in a window: forget the rest
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
        self._seen[key] = (now, 0)
        if held:
            record.msg, record.args = f"{text} ({held} more like it in {self.window_s:g}s)", ()
        return True


class Outage:
    """What a readiness probe said about a service being down: each reason once an outage (a
    reason is kept by its lines in any order: libpq lists the addresses a connect tried, in
    an order that load_balance_hosts or round-robin DNS shuffles), and once that it is back.
    A probe runs every few seconds: a reason logged each time it changed flooded the log when
    two alternated (refused, timed out)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what  # "the relay's readiness probe: the database"
        self._said: set[frozenset[str]] = set()

    def down(self, why: str) -> None:
        lines = [" ".join(line.split()) for line in why.splitlines()]
        key = frozenset(line for line in lines if line)
        if key not in self._said:
            self._said.add(key)
            self._logger.warning("%s does not answer: %s", self._what, " ".join(lines).strip())

    def up(self) -> None:
        if self._said:
            self._said.clear()
            self._logger.info("%s answers again", self._what)
