"""Errors of the reconciliation job, under the project's root `outbox.OutboxError`.

    OutboxError
    └── ReconcileError              the reconciliation could not run or finish
        ├── ReconcileConfigError    bad settings or a window that is not due yet: fix the call
        ├── ReconcileQueryError     the Spark query failed; Spark's error is the __cause__
        └── ReconcileStopped        a --once run stopped (SIGTERM, Ctrl-C) before it judged

Database errors of the sink and the ledger reads stay psycopg's (`outboxctl` reports both).
"""

from __future__ import annotations

from outbox._errors import OutboxError


class ReconcileError(OutboxError):
    """Root of the reconciliation job's errors."""


class ReconcileConfigError(ReconcileError, ValueError):
    """The settings cannot work as given. Nothing was read or written."""


class ReconcileQueryError(ReconcileError):
    """The streaming or batch query failed; findings written before the failure stay."""


class ReconcileStopped(ReconcileError):
    """A `--once` run was stopped while it read Kafka: nothing judged; the next run reads on
    from the checkpoint (a micro-batch cut short is read again)."""
