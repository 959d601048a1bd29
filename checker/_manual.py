"""Manual decisions on one transaction, by an operator, audited: re-arm, resolve, redrive and
drop.

- ``rearm`` (RocketMQ's resumeCheckHalfMessage): a discarded transaction whose records have not
  been handed out yet (the relay has not written their op markers: ``ended_at IS NULL``, and
  none of the ids its discard recorded is gone: the relay ships and deletes a transaction's
  records a batch and a shard at a time, and the rest alone would split it) goes back
  to prepared, with its check count reset, due at once; its maximum prepared age counts from the
  re-arm (RocketMQ puts the half message again, with a new store time).
- ``resolve``: commit or roll back a prepared transaction, or a discarded one not handed out yet,
  by hand. The end itself is the library's compare-and-set (``end_transaction``), so a commit
  NOTIFYs the relay like any other.
- ``redrive``: parked records (the broker refused them for good: too large, unknown topic, not
  authorised; kept with their reason) go back to committed once their cause is fixed, as if
  committed now, and the relay ships them again (``redrive_topic``: all of a topic's). They go
  after whatever of their keys went out meanwhile: a parked record's key lost its order when
  it was parked.
- ``drop``: parked records given up on (a topic retired for good, a record too large for any
  setting) are removed from the outbox once their dead-letter copy and op marker are out, the
  ids, topics and reasons kept in the audit row (``drop_topic``: all of a topic's). Without it
  they stayed for good: the archive keeps parked rows, and the parked-records gauge never
  came back to 0.

Each runs in one database transaction (a savepoint if the caller has one open) that first locks
every record of the transaction with NOWAIT: if a checker is claiming them right now, the call
fails with ``TransactionBusyError`` and changes nothing. The relay holds no row locks while it
ships rows' dead-letter copies and op markers. A parked record redriven meanwhile is left as the
call made it (the relay ends a row only in the state it shipped) and goes to its topic too, as
a redrive means. A discarded one is marked by the relay as it takes it (``shipping_since``,
under its lock), and re-arm and resolve refuse it until it is ended, or unmarked by the
relay's recovery, which finds its Kafka transaction did not commit. Unrefused, it went out
twice, as a dead-letter copy and to its topic (still so on a schema older than
``SHIPPING_CLAIM_VERSION``, where nothing is marked). Every change writes an ``audit_log``
row (actor, action, group, tx id, detail).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from checker._errors import TransactionBusyError
from outbox import sql as queries
from outbox._core import OutboxConfig, State, wakeup_channel
from outbox._errors import IllegalTransitionError, InvalidTopicError, UnknownTransactionError
from outbox._records import (
    check_producer_group,
    check_stored_topic,
    check_stored_tx_id,
    kafka_internal,
)
from outbox._session import database_errors
from outbox._sync import Outbox
from outbox.checkback import TransactionStatus
from outbox.migrations import SHIPPING_CLAIM_VERSION, current_version
from relay.records import shown

logger = logging.getLogger(__name__)

DROPPED = "dropped"  # drop's to_state: the rows are gone

Conn = psycopg.Connection[Any]

_ALREADY = {
    # as outbox._core: parked records are committed ones the relay could not deliver
    TransactionStatus.COMMIT: {State.COMMITTED.value, State.DELIVERED.value, State.PARKED.value},
    TransactionStatus.ROLLBACK: {State.ROLLED_BACK.value},
}


@dataclass(frozen=True)
class ManualResult:
    producer_group: str
    tx_id: str
    action: str  # "rearm", "resolve", "redrive" or "drop"
    from_state: str
    to_state: str
    record_ids: tuple[int, ...]
    #: False when the transaction was already in the asked state (nothing changed, no audit row).
    changed: bool
    audit_id: int | None
    check_count: int | None = None
    next_check_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "producer_group": self.producer_group,
            "tx_id": self.tx_id,
            "action": self.action,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "record_ids": list(self.record_ids),
            "changed": self.changed,
            "audit_id": self.audit_id,
            "check_count": self.check_count,
            "next_check_at": self.next_check_at.isoformat() if self.next_check_at else None,
        }


@dataclass(frozen=True)
class _Row:
    id: int
    state: str
    shipped: bool
    check_count: int


_BUSY_TRIES = 5
_BUSY_WAIT_S = 0.2


def _patiently(act: Callable[[], ManualResult], group: str, tx_id: str) -> ManualResult | None:
    """One transaction of a topic's redrive or drop; None when it is parked no more. The relay
    locks parked rows for a moment while it parks or ends them: that stopped a whole topic's
    run."""
    for attempt in range(1, _BUSY_TRIES + 1):
        try:
            return act()
        except TransactionBusyError:
            if attempt == _BUSY_TRIES:
                raise
            time.sleep(_BUSY_WAIT_S * attempt)
        except (IllegalTransitionError, UnknownTransactionError) as exc:
            # redriven or dropped by another operator meanwhile: parked no more, or gone
            logger.info("tx %s of producer group %s passed by: %s", shown(tx_id), group, exc)
            return None
    raise AssertionError("unreachable: the last try raises")


def _lock(conn: Conn, schema: str, group: str, tx_id: str, action: str) -> list[_Row]:
    try:
        rows = conn.execute(
            queries.query("checker_lock_transaction", schema),
            {"producer_group": group, "tx_id": tx_id},
        ).fetchall()
    except pg_errors.LockNotAvailable:
        raise TransactionBusyError(
            f"the records of tx id {tx_id!r} in producer group {group!r} are locked by another "
            "transaction right now (a checker asking about them or applying an answer, the "
            "application ending them, the relay parking or ending them, another operator's "
            "command); nothing changed: try again",
            producer_group=group,
            tx_id=tx_id,
        ) from None
    if not rows:
        _refuse_if_shipped_away(conn, schema, group, tx_id, action)
        raise UnknownTransactionError(
            f"no records of tx id {tx_id!r} in producer group {group!r}",
            producer_group=group,
            tx_id=tx_id,
        )
    return [_Row(int(r[0]), str(r[1]), bool(r[2]), int(r[3])) for r in rows]


def _refuse_if_shipped_away(conn: Conn, schema: str, group: str, tx_id: str, action: str) -> None:
    """A transaction discarded, then shipped and deleted whole (no archive kept: the default)
    was said to have no records at all, as if the tx id were mistyped."""
    row = conn.execute(
        queries.query("checker_discarded_ids", schema), {"producer_group": group, "tx_id": tx_id}
    ).fetchone()
    if not row or not row[0]:
        return
    shipped = "discarded (already shipped to the dead-letter topic)"
    raise IllegalTransitionError(
        f"tx id {tx_id!r} in producer group {group!r} was discarded, and its {len(row[0])} "
        "records were shipped to the dead-letter topic and removed from the outbox (its discard "
        f"is in audit_log): nothing is left to {action}. To send them anyway, publish them again",
        producer_group=group,
        tx_id=tx_id,
        current_states=(shipped,),
    )


def _parked_or_refuse(
    rows: Sequence[_Row],
    wanted: Sequence[int],
    group: str,
    tx_id: str,
    action: str,
    *,
    shipped_only: bool = False,
) -> list[int]:
    """The transaction's parked record ids; IllegalTransitionError when none is parked, when
    `wanted` names another record, or (`shipped_only`, drop's) when one of those it acts on
    has its dead-letter copy and op marker still to come."""
    parked = {r.id: r for r in rows if r.state == State.PARKED}
    strangers = [i for i in wanted if i not in parked]
    unshipped = [i for i in (wanted or parked) if i in parked and not parked[i].shipped]
    if parked and not strangers and not (shipped_only and unshipped):
        return sorted(parked)
    current = _describe(rows)
    if not parked:
        what = f"none of its records is parked (they are {', '.join(current)})"
    elif strangers:
        what = f"record(s) {strangers} are not among its parked ones ({sorted(parked)})"
    else:
        what = (
            f"record(s) {unshipped} are not on the dead-letter topic yet (the relay writes "
            "their copies and op markers first): try again once it has"
        )
    raise IllegalTransitionError(
        f"cannot {action} tx id {tx_id!r} of producer group {group!r}: {what}",
        producer_group=group,
        tx_id=tx_id,
        current_states=current,
    )


def _describe(rows: Sequence[_Row]) -> tuple[str, ...]:
    found = []
    for row in rows:
        label = row.state
        if row.state == State.DISCARDED and row.shipped:
            label = "discarded (already shipped to the dead-letter topic)"
        if label not in found:
            found.append(label)
    return tuple(found)


def _unshipped_discarded(rows: Sequence[_Row]) -> bool:
    return all(r.state == State.DISCARDED and not r.shipped for r in rows)


def _shipped_away(conn: Conn, schema: str, group: str, tx_id: str, rows: Sequence[_Row]) -> str:
    """Records of a discarded transaction already shipped and deleted (no archive kept), as a
    description; "" when none. The relay ships a discarded transaction a batch and a shard at
    a time: re-arming or resolving the rest split it, half on the dead-letter topic and half
    delivered. Known from the ids its discard recorded in audit_log (trimmed after
    relay.audit_retention: older discards are taken as they are)."""
    row = conn.execute(
        queries.query("checker_discarded_ids", schema), {"producer_group": group, "tx_id": tx_id}
    ).fetchone()
    gone = set(row[0] or ()) - {r.id for r in rows} if row else set()
    if not gone:
        return ""
    return f"discarded and already shipped to the dead-letter topic ({len(gone)} more)"


def _taken_to_ship(conn: Conn, schema: str, rows: Sequence[_Row]) -> str:
    """Discarded records the relay has taken to ship to the dead-letter topic, as a description;
    "" when none. It marks them as it takes them, under their locks (shipping_mark), and holds
    no lock while it ships: a re-arm or resolve then sent them out twice, as dead-letter copies
    and to their topics. On a schema older than SHIPPING_CLAIM_VERSION nothing is marked."""
    ids = [r.id for r in rows if r.state == State.DISCARDED and not r.shipped]
    if not ids or (current_version(conn, schema) or 0) < SHIPPING_CLAIM_VERSION:
        return ""
    taken = conn.execute(queries.query("shipping_taken", schema), {"ids": ids}).fetchall()
    if not taken:
        return ""
    since = min(r[1] for r in taken)
    return (
        f"discarded and taken by the relay to ship to the dead-letter topic ({len(taken)} "
        f"since {since.isoformat(timespec='seconds')}; once there, publish them again to send "
        "them)"
    )


def _audit(
    conn: Conn, schema: str, *, actor: str, action: str, group: str, tx_id: str, detail: Any
) -> int:
    row = conn.execute(
        queries.query("checker_audit", schema),
        {
            "actor": actor,
            "action": action,
            "producer_group": group,
            "tx_id": tx_id,
            "detail": Jsonb(detail),
        },
    ).fetchone()
    assert row is not None
    # The action's last statement: its commit may NOTIFY the relays (resolve's commit,
    # redrive), which takes a cluster-wide lock there, and a role's lock_timeout failed it
    # (the relay's and the checker's commits set it so too).
    conn.execute("SELECT set_config('lock_timeout', '0', true)")
    return int(row[0])


def _require_text(name: str, value: str | None) -> str:
    if value is None or not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value.strip()


def rearm(
    conn: Conn,
    producer_group: str,
    tx_id: str,
    *,
    actor: str,
    reason: str | None = None,
    check_count: int = 0,
    schema: str = "outbox",
    now: datetime | None = None,
) -> ManualResult:
    """discarded (not yet shipped) -> prepared, check count set to ``check_count``, due ``now``
    (default: the database's time, which the checker schedules by).

    Raises UnknownTransactionError, IllegalTransitionError (not discarded, or already shipped,
    or taken by the relay to ship: re-publish instead), TransactionBusyError; in each case
    nothing changed.
    """
    group, tx_id = check_producer_group(producer_group), check_stored_tx_id(tx_id)
    actor = _require_text("actor", actor)
    if check_count < 0:
        raise ValueError("check_count must not be negative")
    schema = OutboxConfig(schema_name=schema).schema_name
    with database_errors(), conn.transaction():
        rows = _lock(conn, schema, group, tx_id, "rearm")
        shipped = _shipped_away(conn, schema, group, tx_id, rows) or _taken_to_ship(
            conn, schema, rows
        )
        if not _unshipped_discarded(rows) or shipped:
            current = (*_describe(rows), shipped) if shipped else _describe(rows)
            raise IllegalTransitionError(
                f"cannot re-arm tx id {tx_id!r} of producer group {group!r}: its records are "
                f"{', '.join(current)}; only a discarded transaction not yet shipped to the "
                "dead-letter topic can go back to prepared",
                producer_group=group,
                tx_id=tx_id,
                current_states=current,
            )
        rearmed = conn.execute(
            queries.query("checker_rearm", schema),
            {"producer_group": group, "tx_id": tx_id, "check_count": check_count, "now": now},
        ).fetchall()
        ids = tuple(int(r[0]) for r in rearmed)
        due = rearmed[0][1] if rearmed else now
        audit_id = _audit(
            conn,
            schema,
            actor=actor,
            action="rearm",
            group=group,
            tx_id=tx_id,
            detail={
                "reason": reason,
                "check_count": check_count,
                "previous_check_count": max(r.check_count for r in rows),
                "record_ids": list(ids),
            },
        )
    logger.info(
        "re-armed tx %s of producer group %s (%d records) by %s",
        shown(tx_id),
        group,
        len(ids),
        actor,
    )
    return ManualResult(
        group,
        tx_id,
        "rearm",
        State.DISCARDED.value,
        State.PREPARED.value,
        ids,
        changed=True,
        audit_id=audit_id,
        check_count=check_count,
        next_check_at=due,
    )


def resolve(
    conn: Conn,
    producer_group: str,
    tx_id: str,
    decision: TransactionStatus | str,
    *,
    actor: str,
    reason: str,
    schema: str = "outbox",
) -> ManualResult:
    """Commit or roll back by hand a prepared transaction, or a discarded one not yet shipped.

    Only its prepared records change (as with ``Outbox.commit``), so a transaction that mixes
    prepared records with others (published under the same tx id) can be settled this way too.

    Already in the asked state: nothing changes (``changed=False``, no audit row). Raises
    UnknownTransactionError, IllegalTransitionError (e.g. commit after a rollback),
    TransactionBusyError; in each case nothing changed.
    """
    group, tx_id = check_producer_group(producer_group), check_stored_tx_id(tx_id)
    status = TransactionStatus(decision)
    if status is TransactionStatus.UNKNOWN:
        raise ValueError("a manual decision is COMMIT or ROLLBACK")
    actor = _require_text("actor", actor)
    reason = _require_text("reason", reason)
    schema = OutboxConfig(schema_name=schema).schema_name
    to_state = State.COMMITTED if status is TransactionStatus.COMMIT else State.ROLLED_BACK
    outbox = Outbox(OutboxConfig(schema_name=schema, producer_group=group))
    with database_errors(), conn.transaction():
        rows = _lock(conn, schema, group, tx_id, "resolve")
        states = {r.state for r in rows}
        if states <= _ALREADY[status]:
            # parked: committed, and refused by the broker for good (redrive's to send again)
            was = State.PARKED.value if State.PARKED.value in states else to_state.value
            return ManualResult(group, tx_id, "resolve", was, to_state.value, (), False, None)
        shipped = ""
        if State.PREPARED.value in states:  # the others (if any) are ended already
            from_state = State.PREPARED.value
        elif _unshipped_discarded(rows) and not (
            shipped := _shipped_away(conn, schema, group, tx_id, rows)
            or _taken_to_ship(conn, schema, rows)
        ):
            from_state = State.DISCARDED.value
            # Back to prepared first, so the end is the library's own compare-and-set.
            conn.execute(
                queries.query("checker_rearm", schema),
                {
                    "producer_group": group,
                    "tx_id": tx_id,
                    "check_count": max(r.check_count for r in rows),
                    "now": None,
                },
            )
        else:
            current = (*_describe(rows), shipped) if shipped else _describe(rows)
            verb = "commit" if status is TransactionStatus.COMMIT else "roll back"
            raise IllegalTransitionError(
                f"cannot {verb} tx id {tx_id!r} of producer group {group!r} by hand: its records "
                f"are {', '.join(current)}; only prepared records, or discarded ones not yet "
                "shipped, can be resolved",
                producer_group=group,
                tx_id=tx_id,
                current_states=current,
            )
        end = outbox.commit if status is TransactionStatus.COMMIT else outbox.rollback
        transition = end(conn, tx_id, producer_group=group)
        audit_id = _audit(
            conn,
            schema,
            actor=actor,
            action="resolve",
            group=group,
            tx_id=tx_id,
            detail={
                "decision": status.value,
                "reason": reason,
                "from_state": from_state,
                "record_ids": list(transition.ids),
            },
        )
    logger.info(
        "resolved tx %s of producer group %s by hand: %s (%s) by %s",
        shown(tx_id),
        group,
        status.value,
        reason,
        actor,
    )
    return ManualResult(
        group, tx_id, "resolve", from_state, to_state.value, transition.ids, True, audit_id
    )


def redrive(
    conn: Conn,
    producer_group: str,
    tx_id: str,
    *,
    actor: str,
    reason: str,
    record_ids: Sequence[int] = (),
    schema: str = "outbox",
) -> ManualResult:
    """parked -> committed, as if committed now: the relay ships the records again (and parks
    them again if the broker still refuses them). ``record_ids``: only those of the
    transaction's parked records (default: all of them).

    Raises UnknownTransactionError, IllegalTransitionError (no parked record, or a record id
    that is not one of the transaction's parked records), TransactionBusyError; in each case
    nothing changed.
    """
    group, tx_id = check_producer_group(producer_group), check_stored_tx_id(tx_id)
    actor = _require_text("actor", actor)
    reason = _require_text("reason", reason)
    wanted = sorted({int(i) for i in record_ids})
    schema = OutboxConfig(schema_name=schema).schema_name
    with database_errors(), conn.transaction():
        rows = _lock(conn, schema, group, tx_id, "redrive")
        _parked_or_refuse(rows, wanted, group, tx_id, "redrive")
        redriven = conn.execute(
            queries.query("checker_redrive", schema),
            {"producer_group": group, "tx_id": tx_id, "ids": wanted},
        ).fetchall()
        ids = tuple(sorted(int(r[0]) for r in redriven))
        conn.execute(
            queries.query("checker_wake_relay", schema), {"channel": wakeup_channel(schema)}
        )
        audit_id = _audit(
            conn,
            schema,
            actor=actor,
            action="redrive",
            group=group,
            tx_id=tx_id,
            detail={
                "reason": reason,
                "record_ids": list(ids),
                "parked_for": {str(r[0]): r[1] for r in redriven},
            },
        )
    logger.info(
        "redrove %d parked record(s) of tx %s of producer group %s by %s: %s",
        len(ids),
        shown(tx_id),
        group,
        actor,
        reason,
    )
    return ManualResult(
        group, tx_id, "redrive", State.PARKED.value, State.COMMITTED.value, ids, True, audit_id
    )


def redrive_topic(
    conn: Conn,
    topic: str,
    *,
    actor: str,
    reason: str,
    schema: str = "outbox",
    limit: int | None = None,
    on_redriven: Callable[[ManualResult], None] | None = None,
    page: int = 1000,
) -> list[ManualResult]:
    """``redrive`` of every record parked for ``topic`` (after the topic was created, say), one
    transaction after another, each audited on its own; other records of those transactions
    stay as they are. All of them (read `page` transactions at a time; it stopped silently
    after 1000), or at most ``limit`` transactions. Records the relay parks again meanwhile
    are not redriven again by this call. An error stops it there; the transactions before it
    are redriven (run it again for the rest), and ``on_redriven`` has been called with each,
    as it was done. A transaction busy for a moment (the relay parking or ending rows of it) is
    tried again a few times; one no longer parked (another operator's redrive) is passed by.
    Each redrive commits as it is reported, unless ``conn`` has a transaction open: then they
    are all part of it, the caller's to commit."""
    topic = check_stored_topic(topic)  # a name no record can have: said so, not "none parked"
    if kafka_internal(topic):
        raise InvalidTopicError(
            f"topic {topic!r} is Kafka's own: the broker takes no records there, and a redrive "
            "would only have them parked again; `outboxctl drop --topic` removes them"
        )
    actor = _require_text("actor", actor)
    reason = _require_text("reason", reason)
    schema = OutboxConfig(schema_name=schema).schema_name
    return _each_of_topic(
        conn,
        topic,
        schema,
        lambda group, tx_id, ids: redrive(
            conn, group, tx_id, actor=actor, reason=reason, record_ids=ids, schema=schema
        ),
        shipped_only=False,
        limit=limit,
        on_done=on_redriven,
        page=page,
    )


def drop(
    conn: Conn,
    producer_group: str,
    tx_id: str,
    *,
    actor: str,
    reason: str,
    record_ids: Sequence[int] = (),
    schema: str = "outbox",
    dry_run: bool = False,
) -> ManualResult:
    """Parked records given up on (a topic retired for good, a record no broker setting will
    take) removed from the outbox, an archive or not: nothing sends them. What is left of them
    is their copy on the dead-letter topic, their ``parked`` op marker, and this drop's
    ``audit_log`` row (ids, topics, why each was parked, the size of each value). A copy the
    dead-letter topic refused whole went without its value (its ``outbox-value-omitted``
    header says so), or not at all: the row held the only copy of that value, and it goes
    with the row. Only records whose copy and marker are out: before that, the relay still
    has to write them. ``record_ids``: only those of the transaction's parked records
    (default: all). ``dry_run``: the same checks, nothing removed (``changed`` False, the
    ids that would go).

    Raises UnknownTransactionError, IllegalTransitionError (no parked record, a record id that
    is not one of them, or one the relay has not shipped to the dead-letter topic yet),
    TransactionBusyError; in each case nothing changed.
    """
    group, tx_id = check_producer_group(producer_group), check_stored_tx_id(tx_id)
    actor = _require_text("actor", actor)
    reason = _require_text("reason", reason)
    wanted = sorted({int(i) for i in record_ids})
    schema = OutboxConfig(schema_name=schema).schema_name
    with database_errors(), conn.transaction():
        rows = _lock(conn, schema, group, tx_id, "drop")
        parked = _parked_or_refuse(rows, wanted, group, tx_id, "drop", shipped_only=True)
        if dry_run:
            ids = tuple(wanted or parked)
            return ManualResult(group, tx_id, "drop", State.PARKED.value, DROPPED, ids, False, None)
        dropped = conn.execute(
            queries.query("checker_drop_parked", schema),
            {"producer_group": group, "tx_id": tx_id, "ids": wanted},
        ).fetchall()
        ids = tuple(sorted(int(r[0]) for r in dropped))
        audit_id = _audit(
            conn,
            schema,
            actor=actor,
            action="drop",
            group=group,
            tx_id=tx_id,
            detail={
                "reason": reason,
                "record_ids": list(ids),
                "topics": {str(r[0]): r[1] for r in dropped},
                "parked_for": {str(r[0]): r[2] for r in dropped},
                "value_bytes": {str(r[0]): r[3] for r in dropped},
            },
        )
    logger.warning(
        "dropped %d parked record(s) of tx %s of producer group %s by %s: %s",
        len(ids),
        shown(tx_id),
        group,
        actor,
        reason,
    )
    return ManualResult(group, tx_id, "drop", State.PARKED.value, DROPPED, ids, True, audit_id)


def drop_topic(
    conn: Conn,
    topic: str,
    *,
    actor: str,
    reason: str,
    schema: str = "outbox",
    limit: int | None = None,
    on_dropped: Callable[[ManualResult], None] | None = None,
    page: int = 1000,
    dry_run: bool = False,
) -> list[ManualResult]:
    """``drop`` of every record parked for ``topic`` whose dead-letter copy and op marker are
    out (those the relay has not shipped yet are left: ``parked_unshipped`` counts them), one
    transaction after another, each audited on its own, as ``redrive_topic`` goes."""
    topic = check_stored_topic(topic)  # a name no record can have: said so, not "none parked"
    actor = _require_text("actor", actor)
    reason = _require_text("reason", reason)
    schema = OutboxConfig(schema_name=schema).schema_name
    return _each_of_topic(
        conn,
        topic,
        schema,
        lambda group, tx_id, ids: drop(
            conn,
            group,
            tx_id,
            actor=actor,
            reason=reason,
            record_ids=ids,
            schema=schema,
            dry_run=dry_run,
        ),
        shipped_only=True,
        limit=limit,
        on_done=on_dropped,
        page=page,
    )


def parked_unshipped(conn: Conn, topic: str, schema: str = "outbox") -> int:
    """Records parked for ``topic`` whose dead-letter copy and op marker are not out yet (the
    relay's next round, or a dead-letter topic that takes nothing): ``drop`` refuses them."""
    schema = OutboxConfig(schema_name=schema).schema_name
    with database_errors(), conn.transaction():
        row = conn.execute(
            queries.query("checker_parked_unshipped_of_topic", schema),
            {"topic": check_stored_topic(topic)},
        ).fetchone()
    return int(row[0]) if row else 0


def _each_of_topic(
    conn: Conn,
    topic: str,
    schema: str,
    act: Callable[[str, str, list[int]], ManualResult],
    *,
    shipped_only: bool,
    limit: int | None,
    on_done: Callable[[ManualResult], None] | None,
    page: int,
) -> list[ManualResult]:
    """`act` on each transaction with records parked for `topic` (those records' ids), in the
    order of their first parked record; see redrive_topic."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if page < 1:
        raise ValueError(f"page must be at least 1, not {page}")
    done: list[ManualResult] = []
    after = 0  # the first parked record id of the last transaction read
    # A transaction of which the relay parks some records again, above `after`, comes on a
    # later page by its first one: it is not redriven twice.
    tried: set[tuple[str, str]] = set()
    while limit is None or len(done) < limit:
        size = page if limit is None else min(page, limit - len(done))
        # In a transaction of its own: read bare on a connection not in autocommit, it began
        # one that every action after it joined, as a savepoint; each reported done, none
        # committed until the caller did (a connection lost, all of them lost). In a
        # transaction the caller has open, they are still the caller's to commit.
        with database_errors(), conn.transaction():
            parked = conn.execute(
                queries.query("checker_parked_of_topic", schema),
                {"topic": topic, "after": after, "limit": size, "shipped_only": shipped_only},
            ).fetchall()
        for group, tx_id, ids in parked:
            if (group, tx_id) in tried:
                continue
            tried.add((group, tx_id))
            result = _patiently(partial(act, group, tx_id, ids), group, tx_id)
            if result is None:
                continue
            done.append(result)
            if on_done is not None:
                on_done(result)
        if len(parked) < size:
            break
        after = parked[-1][2][0]
    return done
