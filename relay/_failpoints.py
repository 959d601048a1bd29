"""Crash points for the crash tests: OUTBOX_RELAY_FAILPOINT=<name> kills the process there
(the relay's, and the reconciliation job's).

`<name>:stop` stops it (SIGSTOP) instead, as a paused zombie would be, until SIGCONT.

A real SIGKILL at a named point of a real relay process is the only honest way to test what a
crash leaves behind. Unset (always, outside those tests), `hit()` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

BEFORE_PRODUCE = "before_produce"
AFTER_PRODUCE = "after_produce"  # records and markers sent, Kafka transaction not committed
AFTER_KAFKA_COMMIT = "after_kafka_commit"  # committed in Kafka, rows not yet removed
# a micro-batch's observations stored, not judged, the batch not committed in the checkpoint
RECONCILE_AFTER_STORE_WRITE = "reconcile_after_store_write"
RECONCILE_BEFORE_QUERY = "reconcile_before_query"  # --once: before its query; an audit: its read

_armed, _, _how = os.environ.get("OUTBOX_RELAY_FAILPOINT", "").partition(":")


def hit(name: str) -> None:
    if _armed == name:
        # To this thread, not the process: a process-directed SIGSTOP is taken by the main
        # thread, which the sidecar keeps waiting on an event; on a busy machine it got a CPU
        # only later, and the relay's thread meanwhile went on past this point and committed.
        sig = signal.SIGSTOP if _how == "stop" else signal.SIGKILL
        signal.pthread_kill(threading.get_ident(), sig)
