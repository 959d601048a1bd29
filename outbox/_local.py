"""Shared parts of the RocketMQ-style `send_in_transaction` helper (sync and async)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus as PgTxStatus

from outbox._core import State, Transition, Written
from outbox._errors import (
    IllegalTransitionError,
    OutboxDatabaseError,
    OutboxUsageError,
    PrepareOutcomeUnknown,
    TransactionStateError,
)
from outbox.checkback import TransactionStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LocalTransactionResult:
    """What `send_in_transaction` did.

    `status` is what the local transaction answered; `state` is where the records are now:
    committed, rolled_back, or prepared (UNKNOWN, or the end could not be written: the checker
    settles it). When the checker or an operator ended the transaction first (the local
    transaction outlasted its check immunity and the endpoint answered meanwhile), `state` is
    what they decided, and `conflict` says whether it contradicts `status`: then the local work
    and the records disagree, and only the application can reconcile them.
    """

    written: Written
    status: TransactionStatus
    state: State

    @property
    def tx_id(self) -> str:
        return self.written.tx_id

    @property
    def conflict(self) -> bool:
        """The records' fate contradicts the answer: never to be delivered after COMMIT
        (rolled back, or discarded by the checker), delivered or to be after ROLLBACK. Records
        still prepared are no conflict: the checker settles them by asking the endpoint."""
        if self.status is TransactionStatus.COMMIT:
            return self.state in (State.ROLLED_BACK, State.DISCARDED)
        if self.status is TransactionStatus.ROLLBACK:
            return self.state in (State.COMMITTED, State.DELIVERED, State.PARKED)
        return False


# The prepare's transaction id, read before its COMMIT (send_in_transaction): what became of
# it is the database's to say once the connection is lost at that COMMIT (was_prepared).
PREPARE_XID = "SELECT pg_current_xact_id()::text"
# committed, aborted, in progress, or NULL (too old for the server to tell)
PREPARE_STATUS = "SELECT pg_xact_status(%s::xid8)"


def prepared_from_status(status: str | None) -> bool | None:
    """was_prepared's answer from pg_xact_status: None while the COMMIT may still finish (the
    server had not seen the connection go), or when the server no longer tells."""
    return {"committed": True, "aborted": False}.get(status or "")


def prepare_cut_off(
    exc: OutboxDatabaseError,
    written: Written | None,
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
    xid: str,
) -> PrepareOutcomeUnknown | None:
    """The error for step 1 (the records prepared and committed on their own) when the
    connection was lost at its COMMIT: raised as any database error, it named no tx id, so
    the caller could not roll back what may have been prepared, and tried again with a new
    one; the checker then asked the endpoint about a tx id the application never saw, and
    discarded the records to the dead-letter topic at the end. None otherwise (nothing
    was written: the error stands as it is)."""
    if written is None or not (conn.broken or conn.closed):
        return None
    ids = ", ".join(map(str, written.ids))
    return PrepareOutcomeUnknown(
        f"the connection was lost at the commit of the prepared records of tx "
        f"{written.tx_id!r} (producer group {written.producer_group!r}, record ids {ids}): "
        "they may be prepared or not, and the local transaction did not run. was_prepared("
        "conn, error) on a new connection tells which (None: not yet); roll them back before "
        "trying again (rollback(conn, tx_id, producer_group=..., record_ids=...) as this "
        "error's attributes give them), or the checker asks the endpoint about them "
        f"({exc})",
        sqlstate=exc.sqlstate,
        tx_id=written.tx_id,
        producer_group=written.producer_group,
        record_ids=tuple(written.ids),
        xid=xid,
    )


_COMMITTED_FAMILY = frozenset({State.COMMITTED, State.DELIVERED, State.PARKED})


def settled_first(exc: TransactionStateError, written: Written, status: TransactionStatus) -> State:
    """The state the checker or an operator left the records in, when the local transaction's
    own end found them no longer prepared; of records the relay ended differently (some
    delivered, one parked), parked if any is, else committed. Raises `exc` when that state
    cannot be told (the relay has removed the rows already): the local work is done all the
    same, and must not be repeated."""
    states = (
        {State(s) for s in exc.current_states} if isinstance(exc, IllegalTransitionError) else set()
    )
    if len(states) == 1:
        (state,) = states
    elif states and states <= _COMMITTED_FAMILY:
        # Committed first, then the relay delivered some and parked others (rows kept by
        # delivered_retention): committed all the same, and a parked one wants an operator.
        state = State.PARKED if State.PARKED in states else State.COMMITTED
    else:
        raise exc
    logger.error(
        "tx %s (%s) was already %s when the local transaction answered %s",
        written.tx_id,
        written.producer_group,
        ", ".join(sorted(states)),
        status.value,
    )
    return state


def ended_before(transition: Transition, written: Written, status: TransactionStatus) -> State:
    """Where the records are when the local transaction's end found them ended as it answered
    already (`changed` False: the checker or an operator was first): parked if the relay
    parked any (one wants an operator), else the state answered."""
    if transition.changed or State.PARKED.value not in transition.found:
        return transition.state
    logger.error(
        "tx %s (%s) was already %s when the local transaction answered %s: a parked record "
        "waits for an operator",
        written.tx_id,
        written.producer_group,
        ", ".join(sorted(transition.found)),
        status.value,
    )
    return State.PARKED


def require_callable(local_transaction: object) -> None:
    """Before anything is written: records prepared for a call that cannot be made were left
    for the checker."""
    if not callable(local_transaction):
        raise OutboxUsageError(
            "local_transaction must be a function taking the written records, got "
            f"{type(local_transaction).__name__} (nothing was written)"
        )


def require_idle(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], expected: type
) -> None:
    """`conn` is a connection of the `expected` kind (it commits on its own, so a cursor would
    not do), with no transaction open."""
    if not isinstance(conn, expected):
        other = "AsyncOutbox" if expected is psycopg.Connection else "Outbox"
        name = type(conn).__name__
        hint = ""
        if "Pool" in name:  # psycopg_pool's ConnectionPool, AsyncConnectionPool
            hint = ": take a connection from the pool (`pool.connection()`)"
        elif isinstance(conn, psycopg.Connection | psycopg.AsyncConnection):
            hint = f": use {other} for it"
        raise OutboxUsageError(
            f"send_in_transaction needs a psycopg {expected.__name__}, got {name}{hint}"
        )
    if conn.closed:  # its status is UNKNOWN, which read as "a transaction is open"
        raise OutboxUsageError("send_in_transaction: the connection is closed")
    if conn.info.transaction_status != PgTxStatus.IDLE:
        raise OutboxUsageError(
            "send_in_transaction needs a connection with no transaction open: the prepared "
            "records must be committed on their own before the local transaction runs"
        )


_OPEN = (PgTxStatus.INTRANS, PgTxStatus.INERROR, PgTxStatus.ACTIVE)


def left_idle(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], written: Written
) -> bool:
    """Whether the local transaction left `conn` with no transaction open. If it used `conn`
    and left one open, the end would run inside it (a savepoint), committed by nobody, and the
    result would say committed while the records stay prepared: they are left prepared for
    the checker instead, and that is said."""
    if conn.info.transaction_status not in _OPEN:
        return True  # idle, or the connection is gone: the end tries, and says why it failed
    logger.error(
        "tx %s (%s): the local transaction left a transaction open on the outbox's connection, "
        "so the records cannot be ended on their own; they stay prepared for the checker. Run "
        "the local transaction on another connection, or end what it opens on this one",
        written.tx_id,
        written.producer_group,
    )
    return False


def _left_prepared(written: Written) -> str:
    ids = written.ids
    which = f"id {ids[0]}" if len(ids) == 1 else f"{len(ids)} records, ids {ids[0]} to {ids[-1]}"
    return (
        f"The records it was given (tx {written.tx_id!r} of producer group "
        f"{written.producer_group!r}, {which}) were written prepared before it ran and stay so, "
        "for the checker to ask your check-back endpoint about: do not run the local "
        "transaction again for them."
    )


def parse_status(answer: object, written: Written, *, awaited: bool = False) -> TransactionStatus:
    """The local transaction's answer (`awaited`: the async API's, which awaited what it
    returned once). Refused after that work ran, its records written: the error names their
    transaction and says they stay prepared, so that nobody runs the work again for them (the
    checker asks the application's check-back endpoint instead)."""
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()  # never awaited: closed, so Python does not warn of it later
        said = (  # the async API awaits once: this came out of that
            "the local transaction's answer, once awaited, was another awaitable (a Task or a "
            "coroutine returned, not awaited): await it inside and return the status"
            if awaited
            else "the local transaction returned an awaitable, which Outbox cannot await: use "
            "AsyncOutbox.send_in_transaction"
        )
        raise OutboxUsageError(f"{said}. {_left_prepared(written)}")
    try:
        if isinstance(answer, TransactionStatus):
            return answer
        if isinstance(answer, str):  # "commit" means what it says, as from a resolver
            return TransactionStatus(answer.upper())
        raise ValueError(answer)
    except ValueError:
        raise OutboxUsageError(
            f"the local transaction returned {answer!r}; expected TransactionStatus.COMMIT, "
            f"ROLLBACK or UNKNOWN (a State is not an answer). {_left_prepared(written)}"
        ) from None
