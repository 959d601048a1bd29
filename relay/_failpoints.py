"""Crash points for the crash tests: OUTBOX_RELAY_FAILPOINT=<name> kills the process there.

`<name>:stop` stops it (SIGSTOP) instead, as a paused zombie would be, until SIGCONT.

A real SIGKILL at a named point of a real relay process is the only honest way to test what a
crash leaves behind. Unset (always, outside those tests), `hit()` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

BEFORE_PRODUCE = "before_produce"
AFTER_PRODUCE = "after_produce"  # records and markers sent, Kafka transaction not committed
AFTER_KAFKA_COMMIT = "after_kafka_commit"  # committed in Kafka, rows not yet removed

_armed, _, _how = os.environ.get("OUTBOX_RELAY_FAILPOINT", "").partition(":")


def hit(name: str) -> None:
    if _armed == name:
        os.kill(os.getpid(), signal.SIGSTOP if _how == "stop" else signal.SIGKILL)
