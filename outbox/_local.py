"""Shared parts of the RocketMQ-style `send_in_transaction` helper (sync and async)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus as PgTxStatus

from outbox._core import State, Written
from outbox._errors import OutboxUsageError
from outbox.checkback import TransactionStatus


@dataclass(frozen=True, slots=True)
class LocalTransactionResult:
    """What `send_in_transaction` did.

    `status` is what the local transaction answered; `state` is where the records are now:
    committed, rolled_back, or prepared (UNKNOWN, or the end could not be written: the checker
    settles it).
    """

    written: Written
    status: TransactionStatus
    state: State

    @property
    def tx_id(self) -> str:
        return self.written.tx_id


def require_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    if conn.info.transaction_status != PgTxStatus.IDLE:
        raise OutboxUsageError(
            "send_in_transaction needs a connection with no transaction open: the prepared "
            "records must be committed on their own before the local transaction runs"
        )


def parse_status(answer: object) -> TransactionStatus:
    try:
        return TransactionStatus(str(answer))
    except ValueError:
        raise OutboxUsageError(
            f"the local transaction returned {answer!r}; expected TransactionStatus.COMMIT, "
            "ROLLBACK or UNKNOWN. The records stay prepared for the checker."
        ) from None
