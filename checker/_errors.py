"""Errors of the checker, under the library's root ``OutboxError``.

    OutboxError
    ├── TransactionStateError            (outbox._errors) nothing changed
    │   ├── UnknownTransactionError      no record of that (producer group, tx id)
    │   └── IllegalTransitionError       rearm / resolve / redrive / drop do not apply to the
    │                                    records' states
    └── CheckerError
        └── TransactionBusyError         another process holds the records' locks right now
                                         (a checker claiming them, the relay ending them):
                                         nothing changed, try again

Manual tools (``rearm``, ``resolve``, ``redrive``, ``drop``) raise these; the checker service
itself never raises them to its caller: an answer it cannot apply is logged and counted.
"""

from __future__ import annotations

from outbox._errors import OutboxError


class CheckerError(OutboxError):
    """Root of the checker's own errors."""


class TransactionBusyError(CheckerError):
    """The transaction's records are locked by another process; nothing was changed."""

    def __init__(self, message: str, *, producer_group: str, tx_id: str) -> None:
        super().__init__(message)
        self.producer_group = producer_group
        self.tx_id = tx_id
