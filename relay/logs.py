"""Structured logging for the sidecar process (the library itself never configures logging)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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
