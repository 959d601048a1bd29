"""The synchronous API over psycopg 3 `Connection` / `Cursor`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import psycopg

from outbox import _core
from outbox._callbacks import is_async
from outbox._core import OutboxConfig, State, Transition, Written
from outbox._errors import (
    OutboxDatabaseError,
    OutboxUsageError,
    PrepareOutcomeUnknown,
    TransactionStateError,
)
from outbox._local import (
    PREPARE_STATUS,
    PREPARE_XID,
    LocalTransactionResult,
    ended_before,
    left_idle,
    parse_status,
    prepare_cut_off,
    prepared_from_status,
    require_callable,
    require_idle,
    settled_first,
)
from outbox._records import Headers, Record, check_immunity_interval, require_records
from outbox._session import (
    database_errors,
    ends_on_its_own_in_pipeline,
    in_pipeline,
    not_a_connection,
    quiet,
    require_not_aborted,
    require_transaction,
    statement_cursor,
)
from outbox._txid import new_tx_id
from outbox.checkback import TransactionStatus

logger = logging.getLogger(__name__)

ConnectionOrCursor = psycopg.Connection[Any] | psycopg.Cursor[Any]


def _run(target: ConnectionOrCursor, op: _core.Operation, *, in_transaction: bool) -> Any:
    conn = target.connection if isinstance(target, psycopg.Cursor) else target
    if not isinstance(conn, psycopg.Connection):
        raise not_a_connection(target, asynchronous=False)
    query, params = next(op)  # validation runs here, before anything is sent
    params = quiet(conn, params)
    if in_pipeline(conn):
        # Until a Sync the status says ACTIVE, not whether a block is open; and the caller's
        # statements queued before ours fail here as the caller's own psycopg errors, not as
        # the outbox's (a mistyped table of theirs was "the outbox tables are missing").
        with conn.pipeline() as pipeline:
            pipeline.sync()
    if in_transaction:
        require_transaction(conn)
    else:  # commit/rollback: in the caller's transaction, or on their own
        require_not_aborted(conn)
    on_its_own = not in_transaction and ends_on_its_own_in_pipeline(conn)
    with database_errors(), statement_cursor(target) as cur:
        while True:
            cur.execute(query, params)
            # Every statement returns rows. Not `if cur.description`: in pipeline mode it is None
            # until fetchall() fetches the results, and the rows written were read as none.
            rows = cur.fetchall()
            try:
                query, params = op.send(rows)
                params = quiet(conn, params)
            except StopIteration as done:
                if on_its_own:
                    with conn.pipeline() as pipeline:
                        pipeline.sync()
                return done.value


class Outbox:
    """Writes outbox records inside the caller's transaction.

    No method opens, commits or rolls back a transaction (except `send_in_transaction`, whose job
    it is): what you write is committed or rolled back with your own business rows.
    """

    def __init__(self, config: OutboxConfig | None = None, **settings: Any) -> None:
        self.config = _core.config_of(config, settings)

    def publish(
        self,
        conn: ConnectionOrCursor,
        topic: str,
        value: Any,
        *,
        key: Any = None,
        headers: Headers | None = None,
        partition: int | None = None,
        tx_id: str | None = None,
        producer_group: str | None = None,
    ) -> int:
        """Insert one committed record in the caller's open transaction; return its id.

        If the caller's transaction rolls back, the record is gone with it; if it commits, the
        relay delivers the record exactly once. Without a `tx_id`, every record written in the
        same database transaction shares one tx id and goes out in one Kafka transaction.
        """
        record = Record(topic, value, key, headers, partition)
        written = self.publish_many(conn, [record], tx_id=tx_id, producer_group=producer_group)
        return written.ids[0]

    def publish_many(
        self,
        conn: ConnectionOrCursor,
        records: Iterable[Record],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
    ) -> Written:
        """Insert several committed records in one statement, in the caller's transaction."""
        records = require_records(records)
        op = _core.insert(
            self.config, records, state=State.COMMITTED, tx_id=tx_id, producer_group=producer_group
        )
        return _run(conn, op, in_transaction=True)  # type: ignore[no-any-return]

    def prepare(
        self,
        conn: ConnectionOrCursor,
        topic: str,
        value: Any,
        *,
        key: Any = None,
        headers: Headers | None = None,
        partition: int | None = None,
        tx_id: str | None = None,
        producer_group: str | None = None,
        check_immunity: timedelta | float | None = None,
    ) -> Written:
        """Insert one half (prepared) record in the caller's transaction.

        The relay does not deliver it until `commit(conn, tx_id)`; `rollback` drops it; if neither
        comes, the checker asks the producer group's endpoint after `check_immunity`.
        Without a `tx_id` a new one is generated (UUIDv7 text, see `outbox._txid`).
        """
        record = Record(topic, value, key, headers, partition)
        return self.prepare_many(
            conn,
            [record],
            tx_id=tx_id,
            producer_group=producer_group,
            check_immunity=check_immunity,
        )

    def prepare_many(
        self,
        conn: ConnectionOrCursor,
        records: Iterable[Record],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
        check_immunity: timedelta | float | None = None,
    ) -> Written:
        """Insert several half records of one transaction; they change state together."""
        records = require_records(records)
        op = _core.insert(
            self.config,
            records,
            state=State.PREPARED,
            tx_id=new_tx_id() if tx_id is None else tx_id,  # "" is refused, not replaced
            producer_group=producer_group,
            check_immunity=check_immunity_interval(check_immunity),
            tx_id_generated=tx_id is None,
        )
        return _run(conn, op, in_transaction=True)  # type: ignore[no-any-return]

    def commit(
        self,
        conn: ConnectionOrCursor,
        tx_id: str,
        *,
        producer_group: str | None = None,
        record_ids: Sequence[int] | None = None,
    ) -> Transition:
        """prepared -> committed for every record of `tx_id`; a repeat changes nothing (while the
        records are in the outbox: removed by the relay, UnknownTransactionError).

        Like publish, it writes in the caller's transaction: `changed=True` counts once that
        commits (on an autocommit connection the statement commits on its own).
        `record_ids` (the transaction's record ids, as `Written.ids` has them; its first and
        last at least): only while the tx id holds one of them. A tx id is taken again once its
        records are removed, and a decision about the earlier transaction must not end the
        later one.
        Raises UnknownTransactionError or IllegalTransitionError (e.g. after a rollback).
        """
        op = _core.end(self.config, tx_id, State.COMMITTED, producer_group, record_ids)
        return _run(conn, op, in_transaction=False)  # type: ignore[no-any-return]

    def rollback(
        self,
        conn: ConnectionOrCursor,
        tx_id: str,
        *,
        producer_group: str | None = None,
        record_ids: Sequence[int] | None = None,
    ) -> Transition:
        """prepared -> rolled_back for every record of `tx_id`; a repeat changes nothing. In
        the caller's transaction, and `record_ids` as commit()."""
        op = _core.end(self.config, tx_id, State.ROLLED_BACK, producer_group, record_ids)
        return _run(conn, op, in_transaction=False)  # type: ignore[no-any-return]

    def was_prepared(
        self, conn: psycopg.Connection[Any], error: PrepareOutcomeUnknown
    ) -> bool | None:
        """What became of the prepare that `error` (send_in_transaction's, the connection lost
        at its COMMIT) names, asked on `conn`, a new connection to the same server: True, its
        records are prepared (roll them back before trying again, or the checker settles them);
        False, nothing was written (try again); None, not known yet or never: roll back as the
        error says.

        Not known yet: the server may still be committing it, or, the network cut before the
        COMMIT reached it, its session holds the transaction open until the server finds the
        client gone (TCP keepalives; `idle_in_transaction_session_timeout`): by default up to
        about two hours. Never: the server no longer remembers an id that old. After a
        failover the answer is the new primary's, whose ids are not the old one's: there, an
        error or a wrong answer; roll back instead (compare-and-set: a repeat changes
        nothing)."""
        if error.xid is None:
            return None
        with database_errors(), statement_cursor(conn) as cur:
            row = cur.execute(PREPARE_STATUS, (error.xid,)).fetchone()
        return prepared_from_status(row[0] if row else None)

    def send_in_transaction(
        self,
        conn: psycopg.Connection[Any],
        records: Iterable[Record],
        local_transaction: Callable[[Written], TransactionStatus | str],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
        check_immunity: timedelta | float | None = None,
    ) -> LocalTransactionResult:
        """RocketMQ's sendMessageInTransaction for a local transaction on another resource.

        1. The records are prepared and committed on their own (so they survive a crash).
        2. `local_transaction(written)` runs the work elsewhere and returns COMMIT, ROLLBACK or
           UNKNOWN.
        3. COMMIT commits the records, ROLLBACK rolls them back, UNKNOWN leaves them prepared.

        If the connection is lost at step 1's commit, PrepareOutcomeUnknown names the records
        that may be prepared (the local transaction did not run): roll them back before trying
        again.
        If `local_transaction` raises, the records stay prepared and the exception propagates.
        If step 3 fails (the database is unreachable), the records stay prepared and the result
        says so instead of raising: the local work is done, so retrying it would do it twice.
        If the checker or an operator ended them first (the local transaction outlasted the
        check immunity), the result says what they decided (`conflict`: it contradicts the
        answer); if the relay has removed them since, TransactionStateError is raised.
        Records left prepared are settled by the checker, which asks the producer group's
        endpoint after `check_immunity`. `conn` must have no transaction open.
        """
        if is_async(local_transaction):
            raise OutboxUsageError(
                "local_transaction is async, and Outbox cannot await it: use "
                "AsyncOutbox.send_in_transaction (nothing was written)"
            )
        require_callable(local_transaction)
        require_idle(conn, psycopg.Connection)
        written: Written | None = None
        xid_row: tuple[Any, ...] | None = None  # the prepare's transaction id, once read
        try:
            with database_errors(), conn.transaction():  # its BEGIN and COMMIT fail as ours
                written = self.prepare_many(
                    conn,
                    records,
                    tx_id=tx_id,
                    producer_group=producer_group,
                    check_immunity=check_immunity,
                )
                with statement_cursor(conn) as cur:
                    xid_row = cur.execute(PREPARE_XID).fetchone()
        except OutboxDatabaseError as exc:
            # Lost before its id was read: its COMMIT was never sent, nothing was prepared,
            # and the error stands as it is (ConnectionLost: run it again).
            cut_off = prepare_cut_off(exc, written, conn, xid_row[0]) if xid_row else None
            if cut_off is None:
                raise
            raise cut_off from exc
        status = parse_status(local_transaction(written), written)
        state = State.PREPARED
        try:
            if status is not TransactionStatus.UNKNOWN and left_idle(conn, written):
                end = self.commit if status is TransactionStatus.COMMIT else self.rollback
                with conn.transaction():
                    ended = end(
                        conn,
                        written.tx_id,
                        producer_group=written.producer_group,
                        record_ids=written.ids,  # these records, not a later tx id's
                    )
                # only once its COMMIT went through: else still prepared
                state = ended_before(ended, written, status)
        except TransactionStateError as exc:  # the checker or an operator ended it first
            state = settled_first(exc, written, status)
        except Exception:
            logger.warning(
                "could not end tx %s (%s) after the local transaction said %s; "
                "it stays prepared for the checker",
                written.tx_id,
                written.producer_group,
                status.value,
                exc_info=True,
            )
        return LocalTransactionResult(written, status, state)
