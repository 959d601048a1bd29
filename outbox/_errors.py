"""Errors of the outbox library: one root, grouped by what the caller does about them.

    OutboxError
    ├── InvalidRecordError          bad input: fix the call; nothing was written
    │   ├── InvalidTopicError
    │   ├── InvalidHeaderError
    │   ├── RecordTooLargeError
    │   ├── InvalidProducerGroupError
    │   ├── InvalidTxIdError
    │   └── SerializationError
    ├── InvalidConfigError          bad settings (OutboxConfig, Outbox(...), migrate's schema)
    ├── OutboxUsageError            the API was used in a way that cannot keep its guarantees
    ├── TransactionStateError       a state change the state machine does not allow; nothing changed
    │   ├── UnknownTransactionError
    │   ├── IllegalTransitionError
    │   └── DuplicateTransactionError
    ├── SchemaError                 the database schema is missing or newer than this library
    └── OutboxDatabaseError         the database failed; psycopg's error is the __cause__
        └── TransactionConflict     a serialization failure or deadlock: run the transaction again

Validation happens before any SQL is sent, so after an InvalidRecordError, an OutboxUsageError or
a TransactionStateError the caller's transaction is still usable. One OutboxUsageError comes
later: send_in_transaction's, for a local transaction's answer it cannot take, after that work
ran; its records were written, prepared, and its message names them. After an
OutboxDatabaseError it is whatever Postgres left it (usually aborted: roll back).
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every error this library raises."""


class InvalidRecordError(OutboxError, ValueError):
    """A record (or its transaction id, group, headers) is not acceptable. Nothing was written."""


class InvalidTopicError(InvalidRecordError):
    pass


class InvalidHeaderError(InvalidRecordError):
    pass


class RecordTooLargeError(InvalidRecordError):
    pass


class InvalidProducerGroupError(InvalidRecordError):
    pass


class InvalidTxIdError(InvalidRecordError):
    pass


class SerializationError(InvalidRecordError):
    pass


class InvalidConfigError(OutboxError, ValueError):
    """A setting of OutboxConfig (or of Outbox(...), or migrate's schema) is not acceptable."""


class OutboxUsageError(OutboxError):
    """The call cannot keep the outbox's guarantees as made (e.g. no transaction is open)."""


class TransactionStateError(OutboxError):
    """The transaction is not in a state that allows this change. Nothing was changed."""

    def __init__(self, message: str, *, producer_group: str, tx_id: str) -> None:
        super().__init__(message)
        self.producer_group = producer_group
        self.tx_id = tx_id


class UnknownTransactionError(TransactionStateError):
    """No record of this (producer group, tx id) is in the outbox."""


class IllegalTransitionError(TransactionStateError):
    """E.g. commit after rollback, rollback after delivery."""

    def __init__(
        self, message: str, *, producer_group: str, tx_id: str, current_states: tuple[str, ...]
    ) -> None:
        super().__init__(message, producer_group=producer_group, tx_id=tx_id)
        self.current_states = current_states


class DuplicateTransactionError(TransactionStateError):
    """The caller-given tx id is already used by another database transaction."""


class SchemaError(OutboxError):
    pass


class OutboxDatabaseError(OutboxError):
    """Postgres reported an error; the original psycopg exception is chained as __cause__, and
    its SQLSTATE is `sqlstate` (None when the connection failed before the server answered)."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class ConnectionLost(OutboxDatabaseError):
    """The connection to Postgres was lost or refused (the server shut down or restarted, a
    failover, a session timeout, the network; SQLSTATE class 08, 57P01-57P05, 25P03, or none:
    no answer came). Run the whole transaction again on a new connection. A call that commits
    on its own (an end on an autocommit connection) may have been applied: ends are
    compare-and-set, so repeating one changes nothing twice (`changed=False`, or the state it
    reached named; UnknownTransactionError once the relay has delivered and removed the
    records)."""


class PrepareOutcomeUnknown(OutboxDatabaseError):
    """`send_in_transaction`'s records reached their COMMIT and the connection was lost there:
    they may be prepared or not, and the local transaction did not run. `tx_id`,
    `producer_group` and `record_ids` say which they are: roll them back (on a new connection)
    before trying again, or the checker asks the producer group's endpoint about them. Not a
    ConnectionLost: run again as it is, a retry left these records behind under a tx id the
    application never saw. `xid`: the prepare's transaction id, by which `was_prepared` asks
    the database what became of it (None only where the error was made by other code)."""

    def __init__(
        self,
        message: str,
        *,
        sqlstate: str | None,
        tx_id: str,
        producer_group: str,
        record_ids: tuple[int, ...],
        xid: str | None = None,
    ) -> None:
        super().__init__(message, sqlstate=sqlstate)
        self.tx_id = tx_id
        self.producer_group = producer_group
        self.record_ids = record_ids
        self.xid = xid


class TransactionConflict(OutboxDatabaseError):
    """Postgres aborted the caller's transaction for a conflict with another one: a
    serialization failure (40001, REPEATABLE READ or SERIALIZABLE) or a deadlock (40P01). Roll
    back and run the whole transaction again, as for the same error raised by your own SQL."""
