"""Transactional outbox for Kafka: publish records inside your own psycopg transaction.

    from outbox import Outbox

    outbox = Outbox(producer_group="orders")
    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outbox.publish(conn, "orders.created", {"id": 42}, key="42")

The module-level functions use a default `Outbox()` (schema `outbox`, producer group `default`);
build your own `Outbox` / `AsyncOutbox` for other settings. Errors are in `outbox._errors` and
all derive from `OutboxError`.
"""

from __future__ import annotations

from outbox._async import AsyncOutbox
from outbox._core import MAX_SCHEMA_NAME, OutboxConfig, State, Transition, Written, wakeup_channel
from outbox._errors import (
    ConnectionLost,
    DuplicateTransactionError,
    IllegalTransitionError,
    InvalidConfigError,
    InvalidHeaderError,
    InvalidProducerGroupError,
    InvalidRecordError,
    InvalidTopicError,
    InvalidTxIdError,
    OutboxDatabaseError,
    OutboxError,
    OutboxUsageError,
    PrepareOutcomeUnknown,
    RecordTooLargeError,
    SchemaError,
    SerializationError,
    TransactionConflict,
    TransactionStateError,
    UnknownTransactionError,
)
from outbox._local import LocalTransactionResult
from outbox._records import (
    DEFAULT_MAX_RECORD_BYTES,
    Headers,
    HeaderValue,
    Record,
    default_serializer,
)
from outbox._sync import Outbox
from outbox._txid import new_tx_id
from outbox.checkback import TransactionStatus
from outbox.migrations import MigrationReport, migrate

_default = Outbox()
publish = _default.publish
publish_many = _default.publish_many
prepare = _default.prepare
prepare_many = _default.prepare_many
commit = _default.commit
rollback = _default.rollback
send_in_transaction = _default.send_in_transaction
was_prepared = _default.was_prepared

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "MAX_SCHEMA_NAME",
    "AsyncOutbox",
    "ConnectionLost",
    "DuplicateTransactionError",
    "HeaderValue",
    "Headers",
    "IllegalTransitionError",
    "InvalidConfigError",
    "InvalidHeaderError",
    "InvalidProducerGroupError",
    "InvalidRecordError",
    "InvalidTopicError",
    "InvalidTxIdError",
    "LocalTransactionResult",
    "MigrationReport",
    "Outbox",
    "OutboxConfig",
    "OutboxDatabaseError",
    "OutboxError",
    "OutboxUsageError",
    "PrepareOutcomeUnknown",
    "Record",
    "RecordTooLargeError",
    "SchemaError",
    "SerializationError",
    "State",
    "TransactionConflict",
    "TransactionStateError",
    "TransactionStatus",
    "Transition",
    "UnknownTransactionError",
    "Written",
    "commit",
    "default_serializer",
    "migrate",
    "new_tx_id",
    "prepare",
    "prepare_many",
    "publish",
    "publish_many",
    "rollback",
    "send_in_transaction",
    "wakeup_channel",
    "was_prepared",
]
