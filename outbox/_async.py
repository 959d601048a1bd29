"""The asyncio API over psycopg 3 `AsyncConnection` / `AsyncCursor`: the twin of `Outbox`.

Each method behaves exactly as its namesake in `outbox._sync.Outbox`; the docstrings there hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus as PgTxStatus

from outbox import _core
from outbox._callbacks import call_back
from outbox._core import OutboxConfig, State, Transition, Written
from outbox._errors import OutboxDatabaseError, PrepareOutcomeUnknown, TransactionStateError
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
    async_statement_cursor,
    database_errors,
    ends_on_its_own_in_pipeline,
    in_pipeline,
    not_a_connection,
    quiet,
    require_not_aborted,
    require_transaction,
)
from outbox._txid import new_tx_id
from outbox.checkback import TransactionStatus

logger = logging.getLogger(__name__)

AsyncConnectionOrCursor = psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]


async def _run(
    target: AsyncConnectionOrCursor, op: _core.Operation, *, in_transaction: bool
) -> Any:
    conn = target.connection if isinstance(target, psycopg.AsyncCursor) else target
    if not isinstance(conn, psycopg.AsyncConnection):
        raise not_a_connection(target, asynchronous=True)
    query, params = next(op)
    params = quiet(conn, params)
    if in_pipeline(conn):  # see _sync._run
        async with conn.pipeline() as pipeline:
            await pipeline.sync()
    if in_transaction:
        require_transaction(conn)
    else:  # commit/rollback: in the caller's transaction, or on their own
        require_not_aborted(conn)
    on_its_own = not in_transaction and ends_on_its_own_in_pipeline(conn)
    try:
        with database_errors():
            async with async_statement_cursor(target) as cur:
                while True:
                    await cur.execute(query, params)
                    rows = await cur.fetchall()  # see _sync._run
                    try:
                        query, params = op.send(rows)
                        params = quiet(conn, params)
                    except StopIteration as done:
                        if on_its_own:
                            async with conn.pipeline() as pipeline:
                                await pipeline.sync()
                        return done.value
    except asyncio.CancelledError:
        await _abort_after_cancel(conn)
        raise


# Any error aborts the transaction; this one also says why in the server's log.
ABORT_WAIT_S = 5.0  # psycopg waits as long for a cancelled statement's end
_ABORT = (
    "DO $$BEGIN RAISE EXCEPTION 'outbox: a cancelled call aborted this transaction: "
    "roll it back'; END$$"
)


async def _abort_after_cancel(conn: psycopg.AsyncConnection[Any]) -> None:
    """A call cancelled (asyncio.timeout, task.cancel()) whose statement the server had run
    before the cancel reached it ends with the caller's transaction healthy and the records
    in it: psycopg cancels, reads the reply, and raises CancelledError all the same. A caller
    that went on, or retried in the same transaction, committed records the call said were
    not written, twice on a retry. Aborting the transaction makes a cancelled call mean one
    thing whatever its timing: nothing of it commits. Already aborted (the server cancelled
    the statement), or outside a transaction (autocommit), there is nothing to do. In
    pipeline mode the statement below is queued like any other, and fails the caller's next
    Sync (test_async_cancel.py)."""
    if conn.closed or conn.info.transaction_status != PgTxStatus.INTRANS:
        return
    abort = asyncio.ensure_future(conn.execute(_ABORT))
    # its error is the point; retrieved here too when a second cancel leaves it unawaited
    abort.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        await asyncio.wait_for(asyncio.shield(abort), ABORT_WAIT_S)
    except psycopg.Error:
        pass  # aborted now
    except TimeoutError:
        # No answer (a server or network gone quiet): as psycopg does when its own cancel
        # gets none, the connection is closed, which ends the transaction on the server. A
        # wait without a bound kept asyncio.timeout's TimeoutError from ever coming out.
        conn.pgconn.finish()


class AsyncOutbox:
    """`Outbox` for asyncio: same methods, awaited."""

    def __init__(self, config: OutboxConfig | None = None, **settings: Any) -> None:
        self.config = _core.config_of(config, settings)

    async def publish(
        self,
        conn: AsyncConnectionOrCursor,
        topic: str,
        value: Any,
        *,
        key: Any = None,
        headers: Headers | None = None,
        partition: int | None = None,
        tx_id: str | None = None,
        producer_group: str | None = None,
    ) -> int:
        """As `Outbox.publish`, awaited."""
        record = Record(topic, value, key, headers, partition)
        written = await self.publish_many(
            conn, [record], tx_id=tx_id, producer_group=producer_group
        )
        return written.ids[0]

    async def publish_many(
        self,
        conn: AsyncConnectionOrCursor,
        records: Iterable[Record],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
    ) -> Written:
        """As `Outbox.publish_many`, awaited."""
        records = require_records(records)
        op = _core.insert(
            self.config, records, state=State.COMMITTED, tx_id=tx_id, producer_group=producer_group
        )
        return await _run(conn, op, in_transaction=True)  # type: ignore[no-any-return]

    async def prepare(
        self,
        conn: AsyncConnectionOrCursor,
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
        """As `Outbox.prepare`, awaited."""
        record = Record(topic, value, key, headers, partition)
        return await self.prepare_many(
            conn,
            [record],
            tx_id=tx_id,
            producer_group=producer_group,
            check_immunity=check_immunity,
        )

    async def prepare_many(
        self,
        conn: AsyncConnectionOrCursor,
        records: Iterable[Record],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
        check_immunity: timedelta | float | None = None,
    ) -> Written:
        """As `Outbox.prepare_many`, awaited."""
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
        return await _run(conn, op, in_transaction=True)  # type: ignore[no-any-return]

    async def commit(
        self,
        conn: AsyncConnectionOrCursor,
        tx_id: str,
        *,
        producer_group: str | None = None,
        record_ids: Sequence[int] | None = None,
    ) -> Transition:
        """As `Outbox.commit`, awaited."""
        op = _core.end(self.config, tx_id, State.COMMITTED, producer_group, record_ids)
        return await _run(conn, op, in_transaction=False)  # type: ignore[no-any-return]

    async def rollback(
        self,
        conn: AsyncConnectionOrCursor,
        tx_id: str,
        *,
        producer_group: str | None = None,
        record_ids: Sequence[int] | None = None,
    ) -> Transition:
        """As `Outbox.rollback`, awaited."""
        op = _core.end(self.config, tx_id, State.ROLLED_BACK, producer_group, record_ids)
        return await _run(conn, op, in_transaction=False)  # type: ignore[no-any-return]

    async def was_prepared(
        self, conn: psycopg.AsyncConnection[Any], error: PrepareOutcomeUnknown
    ) -> bool | None:
        """As `Outbox.was_prepared`."""
        if error.xid is None:
            return None
        with database_errors():
            async with async_statement_cursor(conn) as cur:
                row = await (await cur.execute(PREPARE_STATUS, (error.xid,))).fetchone()
        return prepared_from_status(row[0] if row else None)

    async def send_in_transaction(
        self,
        conn: psycopg.AsyncConnection[Any],
        records: Iterable[Record],
        local_transaction: Callable[[Written], Awaitable[TransactionStatus | str]]
        | Callable[[Written], TransactionStatus | str],
        *,
        tx_id: str | None = None,
        producer_group: str | None = None,
        check_immunity: timedelta | float | None = None,
    ) -> LocalTransactionResult:
        """As `Outbox.send_in_transaction`; `local_transaction` may be sync (run in a worker
        thread, so that it does not stall the event loop) or async."""
        require_callable(local_transaction)
        require_idle(conn, psycopg.AsyncConnection)
        written: Written | None = None
        xid_row: tuple[Any, ...] | None = None  # the prepare's transaction id, once read
        try:
            with database_errors():  # its BEGIN and COMMIT fail as ours
                async with conn.transaction():
                    written = await self.prepare_many(
                        conn,
                        records,
                        tx_id=tx_id,
                        producer_group=producer_group,
                        check_immunity=check_immunity,
                    )
                    async with async_statement_cursor(conn) as cur:
                        xid_row = await (await cur.execute(PREPARE_XID)).fetchone()
        except OutboxDatabaseError as exc:
            # Lost before its id was read: its COMMIT was never sent, nothing was prepared,
            # and the error stands as it is (ConnectionLost: run it again).
            cut_off = prepare_cut_off(exc, written, conn, xid_row[0]) if xid_row else None
            if cut_off is None:
                raise
            raise cut_off from exc
        except asyncio.CancelledError:
            if written is not None:  # else its transaction was rolled back: nothing written
                _say_cancelled(
                    written,
                    "at the commit of its prepared records",
                    "may or may not be prepared, and the local transaction did not run: roll "
                    "them back (rollback(conn, tx_id, producer_group=..., record_ids=...); "
                    "UnknownTransactionError: none was prepared)",
                )
            raise
        try:
            status = parse_status(
                await call_back(local_transaction, written), written, awaited=True
            )
        except asyncio.CancelledError:
            _say_cancelled(
                written,
                "in its local transaction",
                "stay prepared, whatever the local transaction did (a sync one runs on in its "
                "thread): end them only once you know its outcome",
            )
            raise
        state = State.PREPARED
        try:
            if status is not TransactionStatus.UNKNOWN and left_idle(conn, written):
                end = self.commit if status is TransactionStatus.COMMIT else self.rollback
                async with conn.transaction():
                    ended = await end(
                        conn,
                        written.tx_id,
                        producer_group=written.producer_group,
                        record_ids=written.ids,  # these records, not a later tx id's
                    )
                # only once its COMMIT went through: else still prepared
                state = ended_before(ended, written, status)
        except TransactionStateError as exc:  # the checker or an operator ended it first
            state = settled_first(exc, written, status)
        except asyncio.CancelledError:
            _say_cancelled(
                written,
                f"while ending it ({status.value}, as its local transaction said)",
                f"stay prepared unless that end went through: {status.value.lower()} them as "
                f"it said ({status.value.lower()}(conn, tx_id, producer_group=..., "
                "record_ids=...))",
            )
            raise
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


def _say_cancelled(written: Written, when: str, left: str) -> None:
    """A cancelled send_in_transaction raises CancelledError, which names nothing: the tx id,
    the records it may leave prepared and what to do about them are said here."""
    logger.warning(
        "send_in_transaction of tx %s (producer group %s, record ids %s) was cancelled %s: its "
        "records %s; or leave them to the checker, which asks the endpoint about prepared ones",
        written.tx_id,
        written.producer_group,
        ", ".join(map(str, written.ids)),
        when,
        left,
    )
