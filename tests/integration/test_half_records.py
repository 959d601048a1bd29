"""Half (prepared) records: prepare, commit, rollback, send_in_transaction, on the real Postgres."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import outbox
from outbox import Record, State, TransactionStatus, Written


def states(dsn: str, tx_id: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT state FROM outbox.outbox_record WHERE tx_id = %s ORDER BY id", (tx_id,)
            )
        ]


def prepared(dsn: str, n: int = 2, **kwargs: Any) -> Written:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return outbox.prepare_many(conn, [Record("t", f"v{i}") for i in range(n)], **kwargs)


def test_prepared_records_commit_together(pg_dsn: str) -> None:
    written = prepared(pg_dsn, 3)
    assert states(pg_dsn, written.tx_id) == ["prepared"] * 3
    with psycopg.connect(pg_dsn) as conn:
        result = outbox.commit(conn, written.tx_id)
        conn.commit()
    assert result.changed
    assert result.ids == written.ids
    assert states(pg_dsn, written.tx_id) == ["committed"] * 3


def test_prepared_records_roll_back_together(pg_dsn: str) -> None:
    written = prepared(pg_dsn, 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert outbox.rollback(conn, written.tx_id).ids == written.ids
    assert states(pg_dsn, written.tx_id) == ["rolled_back"] * 2


def test_generated_tx_ids_are_uuid7_and_sort_by_time(pg_dsn: str) -> None:
    before_ms = time.time_ns() // 1_000_000
    first = prepared(pg_dsn, 1)
    time.sleep(0.002)  # another millisecond: the ids must sort by it
    second = prepared(pg_dsn, 1)
    after_ms = time.time_ns() // 1_000_000
    ids = [uuid.UUID(first.tx_id), uuid.UUID(second.tx_id)]
    assert [u.version for u in ids] == [7, 7]
    assert [u.variant for u in ids] == [uuid.RFC_4122] * 2
    stamped = [u.int >> 80 for u in ids]  # the 48-bit Unix time in milliseconds
    assert before_ms <= stamped[0] < stamped[1] <= after_ms
    assert first.tx_id < second.tx_id  # as text, too


def test_repeated_commit_or_rollback_changes_nothing(pg_dsn: str) -> None:
    committed, rolled_back = prepared(pg_dsn), prepared(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        outbox.commit(conn, committed.tx_id)
        outbox.rollback(conn, rolled_back.tx_id)
        again = outbox.commit(conn, committed.tx_id)
        assert (again.changed, again.ids) == (False, ())
        assert outbox.rollback(conn, rolled_back.tx_id).changed is False


@pytest.mark.parametrize(
    ("first", "then", "current"),
    [
        ("rollback", "commit", "rolled_back"),
        ("commit", "rollback", "committed"),
    ],
)
def test_illegal_transitions_raise_and_change_nothing(
    pg_dsn: str, first: str, then: str, current: str
) -> None:
    written = prepared(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        getattr(outbox, first)(conn, written.tx_id)
        with pytest.raises(outbox.IllegalTransitionError, match=current) as raised:
            getattr(outbox, then)(conn, written.tx_id)
    assert raised.value.current_states == (current,)
    assert states(pg_dsn, written.tx_id) == [current] * 2


@pytest.mark.parametrize("ended", ["delivered", "discarded", "parked"])
def test_rollback_after_the_relay_or_checker_ended_it_is_illegal(pg_dsn: str, ended: str) -> None:
    written = prepared(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET state = %s, reason = 'test',"
            " committed_xid = pg_current_xact_id() WHERE tx_id = %s",
            (ended, written.tx_id),
        )
        with pytest.raises(outbox.IllegalTransitionError, match=ended) as refused:
            outbox.rollback(conn, written.tx_id)
    assert states(pg_dsn, written.tx_id) == [ended] * 2
    # Re-arming so that a rollback can be made again would only discard them once more: that
    # advice is a commit's.
    assert "rearm" not in str(refused.value)
    if ended == "discarded":
        assert "never to their own, which is what a rollback wants" in str(refused.value)


def test_commit_after_discard_is_illegal(pg_dsn: str) -> None:
    written = prepared(pg_dsn, 1)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'discarded', reason = 'max checks' "
            "WHERE tx_id = %s",
            (written.tx_id,),
        )
        with pytest.raises(
            outbox.IllegalTransitionError, match=r"are discarded, .*`outboxctl rearm` makes"
        ):
            outbox.commit(conn, written.tx_id)


def test_unknown_tx_id(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(outbox.UnknownTransactionError, match="nope") as raised:
            outbox.commit(conn, "nope")
        assert raised.value.tx_id == "nope"
        prepared_in_other_group = prepared(pg_dsn, 1, producer_group="other")
        with pytest.raises(  # default group: not ours; the message names the likely cause
            outbox.UnknownTransactionError,
            match=r"never prepared in this producer group .*pass its producer_group",
        ):
            outbox.commit(conn, prepared_in_other_group.tx_id)
        with pytest.raises(
            outbox.InvalidTxIdError,
            match=re.escape(
                "tx id must be a str, not a Written: pass its tx_id "
                f"({prepared_in_other_group.tx_id!r}), as `written.tx_id`, and its producer "
                "group ('other'), as `producer_group=written.producer_group`"
            ),
        ):
            outbox.commit(conn, prepared_in_other_group, producer_group="other")  # type: ignore[arg-type]
        assert outbox.commit(conn, prepared_in_other_group.tx_id, producer_group="other").changed


def test_an_end_for_a_record_no_longer_held_leaves_a_later_transaction_of_the_tx_id_alone(
    pg_dsn: str,
) -> None:
    """A tx id is taken again once its records are removed; an end about the transaction
    before (the checker's late answer) names its records and leaves the later alone."""
    tx_id = f"order-{uuid.uuid4()}"
    earlier = prepared(pg_dsn, 2, tx_id=tx_id)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        outbox.rollback(conn, tx_id)
        conn.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,))  # the relay
    later = prepared(pg_dsn, 1, tx_id=tx_id)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            with pytest.raises(outbox.UnknownTransactionError, match="holds none of"):
                await outbox.AsyncOutbox().commit(conn, tx_id, record_ids=earlier.ids)

    asyncio.run(main())
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(outbox.UnknownTransactionError, match="holds none of") as raised:
            outbox.rollback(conn, tx_id, record_ids=earlier.ids)
        assert raised.value.tx_id == tx_id
        assert states(pg_dsn, tx_id) == ["prepared"]
        assert outbox.commit(conn, tx_id, record_ids=later.ids).ids == later.ids
    assert states(pg_dsn, tx_id) == ["committed"]


def test_an_end_given_another_transactions_records_says_they_are_not_its(pg_dsn: str) -> None:
    """The records of another prepared transaction, given by mistake, were refused with "its
    records are prepared, and only prepared records can change"."""
    mine, other = prepared(pg_dsn, 1), prepared(pg_dsn, 1)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for end in (outbox.commit, outbox.rollback):
            with pytest.raises(outbox.UnknownTransactionError, match="holds none of records"):
                end(conn, mine.tx_id, record_ids=other.ids)
    assert states(pg_dsn, mine.tx_id) == states(pg_dsn, other.tx_id) == ["prepared"]


@pytest.mark.parametrize("record_ids", [5, "12", [], [True], [0], [1.0]])
def test_record_ids_that_are_no_records_ids_are_refused(pg_dsn: str, record_ids: Any) -> None:
    written = prepared(pg_dsn, 1)
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(outbox.OutboxUsageError, match="record_ids must be"),
    ):
        outbox.commit(conn, written.tx_id, record_ids=record_ids)
    assert states(pg_dsn, written.tx_id) == ["prepared"]


def test_an_end_naming_its_records_sees_those_left_when_the_relay_removed_some(
    pg_dsn: str,
) -> None:
    """Committed, then one record delivered and removed (no retention), the other parked: the
    end of those records says what is left of them, not "none of them"."""
    written = prepared(pg_dsn, 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        outbox.commit(conn, written.tx_id)
        conn.execute("DELETE FROM outbox.outbox_record WHERE id = %s", (written.ids[0],))
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'parked', reason = 'poison' WHERE id = %s",
            (written.ids[1],),
        )
        again = outbox.commit(conn, written.tx_id, record_ids=written.ids)
        assert (again.changed, again.found) == (False, ("parked",))
        with pytest.raises(outbox.IllegalTransitionError) as raised:
            outbox.rollback(conn, written.tx_id, record_ids=written.ids)
        assert raised.value.current_states == ("parked",)


def test_a_tx_id_belongs_to_one_database_transaction(pg_dsn: str) -> None:
    prepared(pg_dsn, 1, tx_id="order-42")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        with pytest.raises(outbox.DuplicateTransactionError, match="order-42"):
            outbox.prepare(conn, "t", "again", tx_id="order-42")
        with pytest.raises(outbox.DuplicateTransactionError):
            outbox.publish(conn, "t", "again", tx_id="order-42")
        # ...while the same tx id in the same transaction adds records to it
        outbox.prepare(conn, "t", "a", tx_id="order-43")
        outbox.prepare(conn, "t", "b", tx_id="order-43")
    assert states(pg_dsn, "order-42") == ["prepared"]
    assert states(pg_dsn, "order-43") == ["prepared", "prepared"]


def test_a_refused_tx_id_holds_no_lock_for_the_rest_of_the_transaction(pg_dsn: str) -> None:
    """A caller that catches the refusal and goes on with its transaction (an "already
    published" retry) held the id's lock to its end: every later writer of the id waited for
    it, or failed on lock_timeout, instead of being refused at once."""
    prepared(pg_dsn, 1, tx_id="order-9")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        with pytest.raises(outbox.DuplicateTransactionError):
            outbox.publish(conn, "t", "again", tx_id="order-9")
        advisory = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s"
        assert conn.execute(advisory, (conn.info.backend_pid,)).fetchone() == (0,)
        with psycopg.connect(pg_dsn) as other:
            other.execute("SET lock_timeout = '2s'")
            with pytest.raises(outbox.DuplicateTransactionError):
                outbox.publish(other, "t", "later", tx_id="order-9")
            other.rollback()
    assert states(pg_dsn, "order-9") == ["prepared"]


def test_concurrent_reuse_of_a_tx_id_is_caught(pg_dsn: str) -> None:
    first = psycopg.connect(pg_dsn)
    first.execute("SELECT 1")
    outbox.prepare(first, "t", "first", tx_id="shared")  # holds the tx id's lock, uncommitted
    outcome: list[BaseException | None] = []

    def second_writer() -> None:
        with psycopg.connect(pg_dsn) as conn:
            try:
                with conn.transaction():
                    outbox.prepare(conn, "t", "second", tx_id="shared")
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=second_writer)
    thread.start()
    with psycopg.connect(pg_dsn, autocommit=True) as probe:
        waiting = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        for _ in range(1500):  # until the second writer waits on the lock (30 s at most)
            if probe.execute(waiting).fetchone() == (1,):
                break
            threading.Event().wait(0.02)
        else:
            pytest.fail("the second writer never waited for the tx id lock")
    first.commit()
    first.close()
    thread.join(10)
    assert isinstance(outcome[0], outbox.DuplicateTransactionError)
    assert states(pg_dsn, "shared") == ["prepared"]


@pytest.mark.parametrize(
    ("level", "refused"),
    [
        (psycopg.IsolationLevel.REPEATABLE_READ, True),  # blind to a later-committed reuse
        (psycopg.IsolationLevel.SERIALIZABLE, True),  # too, against a READ COMMITTED writer
        (psycopg.IsolationLevel.READ_COMMITTED, False),
        (psycopg.IsolationLevel.READ_UNCOMMITTED, False),  # Postgres runs it as READ COMMITTED
    ],
)
def test_a_given_tx_id_needs_an_isolation_that_sees_its_reuse(
    pg_dsn: str, level: psycopg.IsolationLevel, refused: bool
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = level
        with conn.transaction():
            if refused:
                with pytest.raises(outbox.OutboxUsageError, match="READ COMMITTED transactions"):
                    outbox.prepare(conn, "t", "v", tx_id="order-7")
                # the refusal holds no lock on the id: it held one till the end, and another
                # writer of the id waited for it
                with psycopg.connect(pg_dsn) as other:
                    other.execute("SET lock_timeout = '2s'")
                    outbox.prepare(other, "t", "x", tx_id="order-7")
                    other.rollback()
            else:
                outbox.prepare(conn, "t", "v", tx_id="order-7")
            outbox.prepare(conn, "t", "w")  # a tx id of the outbox's own needs no check
    assert states(pg_dsn, "order-7") == ([] if refused else ["prepared"])


def test_an_empty_tx_id_is_refused_not_replaced(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        with pytest.raises(outbox.InvalidTxIdError):
            outbox.prepare(conn, "t", "v", tx_id="")
        with pytest.raises(outbox.InvalidTxIdError):
            outbox.publish(conn, "t", "v", tx_id="")


@pytest.mark.parametrize("tx_id", ["a\x00b", "\ud800"], ids=["NUL", "lone surrogate"])
@pytest.mark.parametrize("action", ["commit", "rollback"])
def test_ending_a_tx_id_no_row_can_hold_is_refused_before_any_sql(
    pg_dsn: str, tx_id: str, action: str
) -> None:
    """Checked by length only, a NUL came back as "the database failed", and a lone surrogate
    as a bare UnicodeEncodeError, which an `except OutboxError` missed."""
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(outbox.InvalidTxIdError, match="NUL or a lone surrogate"):
            getattr(outbox, action)(conn, tx_id)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # nothing sent


@pytest.mark.parametrize("action", ["commit", "rollback"])
def test_ending_in_an_aborted_transaction_says_to_roll_it_back(pg_dsn: str, action: str) -> None:
    """publish said so; commit and rollback came back as "the database failed"."""
    written = prepared(pg_dsn, 1)
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(outbox.OutboxUsageError, match=r"aborted.*roll it back"):
            getattr(outbox, action)(conn, written.tx_id)
        conn.rollback()
        assert getattr(outbox, action)(conn, written.tx_id).changed
    assert states(pg_dsn, written.tx_id) == ["committed" if action == "commit" else "rolled_back"]


def test_commit_and_rollback_racing_one_wins(pg_dsn: str) -> None:
    for _ in range(10):
        written = prepared(pg_dsn, 3)
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}

        def end(
            action: str,
            tx_id: str = written.tx_id,
            b: threading.Barrier = barrier,
            results: dict[str, object] = results,
        ) -> None:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                b.wait()
                try:
                    results[action] = getattr(outbox, action)(conn, tx_id).changed
                except outbox.IllegalTransitionError as exc:
                    results[action] = exc

        threads = [threading.Thread(target=end, args=(a,)) for a in ("commit", "rollback")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) == {"commit", "rollback"}  # neither died on something else
        winners = [a for a, r in results.items() if r is True]
        assert len(winners) == 1
        (loser,) = {"commit", "rollback"} - set(winners)
        assert results[loser] is False or isinstance(results[loser], outbox.IllegalTransitionError)
        final = states(pg_dsn, written.tx_id)
        assert final == [{"commit": "committed", "rollback": "rolled_back"}[winners[0]]] * 3


def test_check_immunity_is_stored_per_record(pg_dsn: str) -> None:
    written = prepared(pg_dsn, 1, check_immunity=timedelta(seconds=90))
    default = prepared(pg_dsn, 1)
    with psycopg.connect(pg_dsn) as conn:
        got = dict(
            conn.execute("SELECT tx_id, check_immunity FROM outbox.outbox_record").fetchall()
        )
    assert got == {written.tx_id: timedelta(seconds=90), default.tx_id: None}
    with pytest.raises(outbox.InvalidRecordError, match="negative"):
        prepared(pg_dsn, 1, check_immunity=-1)


# --- send_in_transaction ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "state"),
    [
        (TransactionStatus.COMMIT, State.COMMITTED),
        (TransactionStatus.ROLLBACK, State.ROLLED_BACK),
        (TransactionStatus.UNKNOWN, State.PREPARED),
        ("COMMIT", State.COMMITTED),
        ("commit", State.COMMITTED),  # as a resolver's answer: it was refused, the work done
        ("Rollback", State.ROLLED_BACK),
        ("unknown", State.PREPARED),
    ],
)
def test_send_in_transaction_ends_as_the_local_transaction_says(
    pg_dsn: str, answer: TransactionStatus | str, state: State
) -> None:
    seen_during_local_transaction: list[list[str]] = []

    def local_transaction(written: Written) -> TransactionStatus | str:
        # The half records are already committed: another connection sees them prepared.
        seen_during_local_transaction.append(states(pg_dsn, written.tx_id))
        return answer

    with psycopg.connect(pg_dsn) as conn:
        result = outbox.send_in_transaction(
            conn, [Record("t", "a"), Record("t", "b")], local_transaction
        )
    assert seen_during_local_transaction == [["prepared", "prepared"]]
    assert result.state is state
    assert result.status is TransactionStatus(answer.upper())
    assert states(pg_dsn, result.tx_id) == [state.value] * 2


def test_send_in_transaction_leaves_records_prepared_when_the_local_transaction_raises(
    pg_dsn: str,
) -> None:
    tx_ids: list[str] = []

    def local_transaction(written: Written) -> TransactionStatus:
        tx_ids.append(written.tx_id)
        raise RuntimeError("payment service down")

    with psycopg.connect(pg_dsn) as conn, pytest.raises(RuntimeError, match="payment"):
        outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)
    assert states(pg_dsn, tx_ids[0]) == ["prepared"]


@pytest.mark.parametrize("answer", ["MAYBE", 1, None, outbox.State.COMMITTED])
def test_send_in_transaction_rejects_a_bad_answer_and_keeps_records(
    pg_dsn: str, answer: Any
) -> None:
    """Refused after the work ran: the error names the records left prepared, so that the
    caller does not run the work again (it said neither, and the library's errors say an
    OutboxUsageError comes before anything is written)."""
    tx_ids: list[str] = []

    def local_transaction(written: Written) -> Any:
        tx_ids.append(written.tx_id)
        return answer

    with (
        psycopg.connect(pg_dsn) as conn,
        pytest.raises(
            outbox.OutboxUsageError, match=re.escape(f"returned {answer!r}; expected")
        ) as refused,
    ):
        outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)
    assert states(pg_dsn, tx_ids[0]) == ["prepared"]
    assert f"(tx {tx_ids[0]!r} of producer group" in str(refused.value)
    assert "do not run the local transaction again" in str(refused.value)


def test_sync_send_in_transaction_refuses_an_async_local_transaction_before_writing(
    pg_dsn: str,
) -> None:
    """It was called, never awaited: the records stayed prepared, the work never ran, and the
    error said only that a coroutine is not a status."""
    ran: list[str] = []

    async def charge(written: Written) -> TransactionStatus:
        ran.append(written.tx_id)
        return TransactionStatus.COMMIT

    def charge_later(written: Written) -> Any:  # a sync function that returns a coroutine
        return charge(written)

    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(outbox.OutboxUsageError, match=r"AsyncOutbox\.send_in_transaction"):
            outbox.send_in_transaction(conn, [Record("t", "a")], charge)  # type: ignore[arg-type]
        assert conn.execute("SELECT count(*) FROM outbox.outbox_record").fetchone() == (0,)
        conn.rollback()
        with pytest.raises(outbox.OutboxUsageError, match=r"AsyncOutbox\.send_in_transaction"):
            outbox.send_in_transaction(conn, [Record("t", "b")], charge_later)
    assert ran == []


@pytest.mark.parametrize("local_transaction", ["COMMIT", None, TransactionStatus.COMMIT])
def test_send_in_transaction_refuses_what_cannot_be_called_before_writing(
    pg_dsn: str, local_transaction: Any
) -> None:
    """The records were prepared and committed first; then the call failed with a TypeError
    and they were left for the checker."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(outbox.OutboxUsageError, match=r"local_transaction must be a function"):
            outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)

        async def main() -> None:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
                with pytest.raises(outbox.OutboxUsageError, match=r"nothing was written"):
                    await outbox.AsyncOutbox().send_in_transaction(
                        aconn, [Record("t", "b")], local_transaction
                    )

        asyncio.run(main())
        assert conn.execute("SELECT count(*) FROM outbox.outbox_record").fetchone() == (0,)


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_an_end_in_an_autocommit_pipeline_stays_when_the_next_statement_fails(
    pg_dsn: str, end: str
) -> None:
    """In pipeline mode an autocommit connection's statements commit at the next Sync: the
    end was reported changed, and the caller's next statement failing rolled it back."""
    sync_written, async_written = prepared(pg_dsn), prepared(pg_dsn)
    ended = "committed" if end == "commit" else "rolled_back"

    def end_then_fail(conn: psycopg.Connection[Any]) -> None:
        with conn.pipeline():
            assert getattr(outbox.Outbox(), end)(conn, sync_written.tx_id).changed
            conn.execute("SELECT 1 / 0")

    async def end_then_fail_async(aconn: psycopg.AsyncConnection[Any]) -> None:
        async with aconn.pipeline():
            assert (await getattr(outbox.AsyncOutbox(), end)(aconn, async_written.tx_id)).changed
            await aconn.execute("SELECT 1 / 0")

    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(psycopg.errors.DivisionByZero),
    ):
        end_then_fail(conn)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            with pytest.raises(psycopg.errors.DivisionByZero):
                await end_then_fail_async(aconn)

    asyncio.run(main())
    assert states(pg_dsn, sync_written.tx_id) == [ended] * 2
    assert states(pg_dsn, async_written.tx_id) == [ended] * 2


def test_send_in_transaction_needs_a_connection_without_an_open_transaction(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction
        with pytest.raises(outbox.OutboxUsageError, match="no transaction open"):
            outbox.send_in_transaction(conn, [Record("t", "a")], lambda w: "COMMIT")


def test_send_in_transaction_fails_as_the_outbox_on_a_dropped_or_closed_connection(
    pg_dsn: str,
) -> None:
    """Its own BEGIN failed as a bare psycopg error (the README: every error is an
    OutboxError), and a closed connection was said to have "a transaction open"."""
    box = outbox.Outbox()

    def drop(pid: int) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    conn = psycopg.connect(pg_dsn, autocommit=True)
    drop(conn.info.backend_pid)  # a failover, idle_session_timeout
    with pytest.raises(outbox.ConnectionLost, match="the database failed: terminating"):
        box.send_in_transaction(conn, [Record("t", b"v")], lambda _: "COMMIT")
    with pytest.raises(outbox.OutboxUsageError, match="the connection is closed"):
        box.send_in_transaction(conn, [Record("t", b"v")], lambda _: "COMMIT")

    async def main() -> None:
        send = outbox.AsyncOutbox().send_in_transaction
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        drop(aconn.info.backend_pid)
        with pytest.raises(outbox.ConnectionLost):
            await send(aconn, [Record("t", b"v")], lambda _: "COMMIT")
        await aconn.close()
        with pytest.raises(outbox.OutboxUsageError, match="the connection is closed"):
            await send(aconn, [Record("t", b"v")], lambda _: "COMMIT")

    asyncio.run(main())


def test_send_in_transaction_refuses_what_is_not_its_kind_of_connection_by_name(
    pg_dsn: str,
) -> None:
    """A cursor, None or the other kind of connection failed with a bare AttributeError or
    TypeError, though every error of the library derives from OutboxError."""
    called: list[Written] = []

    def never(written: Written) -> str:
        called.append(written)
        return "COMMIT"

    with psycopg.connect(pg_dsn) as conn:
        for wrong in (None, conn.cursor()):
            with pytest.raises(outbox.OutboxUsageError, match="needs a psycopg Connection"):
                outbox.send_in_transaction(wrong, [Record("t", "a")], never)  # type: ignore[arg-type]

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            with pytest.raises(outbox.OutboxUsageError, match="use AsyncOutbox"):
                outbox.send_in_transaction(aconn, [Record("t", "a")], never)  # type: ignore[arg-type]
        with (
            psycopg.connect(pg_dsn) as conn,
            pytest.raises(outbox.OutboxUsageError, match="needs a psycopg AsyncConnection"),
        ):
            await outbox.AsyncOutbox().send_in_transaction(conn, [Record("t", "a")], never)  # type: ignore[arg-type]
        apool = AsyncConnectionPool(pg_dsn, open=False)
        with pytest.raises(outbox.OutboxUsageError, match="take a connection from the pool"):
            await outbox.AsyncOutbox().send_in_transaction(apool, [Record("t", "a")], never)  # type: ignore[arg-type]

    asyncio.run(main())
    pool = ConnectionPool(pg_dsn, open=False)  # told to use AsyncOutbox for it, before
    with pytest.raises(outbox.OutboxUsageError, match="take a connection from the pool"):
        outbox.send_in_transaction(pool, [Record("t", "a")], never)  # type: ignore[arg-type]
    assert called == []


def test_send_in_transaction_keeps_records_prepared_when_the_end_cannot_be_written(
    pg_dsn: str,
) -> None:
    def local_transaction(written: Written) -> TransactionStatus:
        # The database goes away after the local work is done.
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        return TransactionStatus.COMMIT

    with psycopg.connect(pg_dsn) as conn:
        result = outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)
    assert result.status is TransactionStatus.COMMIT
    assert result.state is State.PREPARED
    assert not result.conflict  # the checker settles them: the endpoint will say COMMIT
    assert states(pg_dsn, result.tx_id) == ["prepared"]


@pytest.mark.parametrize("answer", [TransactionStatus.COMMIT, TransactionStatus.ROLLBACK])
def test_an_end_whose_commit_fails_leaves_the_result_prepared_as_the_records_are(
    pg_dsn: str, answer: TransactionStatus
) -> None:
    """The end's UPDATE went through and its COMMIT failed (here a deferred trigger; a
    connection lost at COMMIT is the same to the caller): the result said committed or
    rolled back, taken from the UPDATE, while the records stayed prepared."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            "CREATE FUNCTION refuse_end() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'the end cannot commit'; END $$"
        )
        admin.execute(
            "CREATE CONSTRAINT TRIGGER refuse_end AFTER UPDATE ON outbox.outbox_record "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            "WHEN (NEW.state IN ('committed', 'rolled_back')) EXECUTE FUNCTION refuse_end()"
        )

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        result = outbox.send_in_transaction(conn, [Record("t", "a")], lambda _: answer)
    assert (result.status, result.state, result.conflict) == (answer, State.PREPARED, False)
    assert states(pg_dsn, result.tx_id) == ["prepared"]

    async def main() -> outbox.LocalTransactionResult:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            send = outbox.AsyncOutbox().send_in_transaction
            return await send(conn, [Record("t", "a")], lambda _: answer)

    result = asyncio.run(main())
    assert (result.status, result.state, result.conflict) == (answer, State.PREPARED, False)
    assert states(pg_dsn, result.tx_id) == ["prepared"]


@pytest.mark.parametrize("answer", [TransactionStatus.COMMIT, TransactionStatus.ROLLBACK])
def test_a_local_transaction_that_leaves_the_connection_in_a_transaction_leaves_them_prepared(
    pg_dsn: str, answer: TransactionStatus, caplog: pytest.LogCaptureFixture
) -> None:
    """The end ran as a savepoint in the transaction the local one left open, which nobody
    committed: the result said committed, and the records stayed prepared."""

    def local_transaction(written: Written) -> TransactionStatus:
        conn.execute("SELECT 1")  # work on the outbox's connection, left uncommitted
        return answer

    with psycopg.connect(pg_dsn) as conn:
        result = outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)
        conn.rollback()
    assert (result.status, result.state, result.conflict) == (answer, State.PREPARED, False)
    assert states(pg_dsn, result.tx_id) == ["prepared"]
    assert "left a transaction open on the outbox's connection" in caplog.text


def test_async_a_local_transaction_that_leaves_a_transaction_open_leaves_them_prepared(
    pg_dsn: str,
) -> None:
    async def main() -> outbox.LocalTransactionResult:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:

            async def local_transaction(written: Written) -> TransactionStatus:
                await conn.execute("SELECT 1")
                return TransactionStatus.COMMIT

            result = await outbox.AsyncOutbox().send_in_transaction(
                conn, [Record("t", "a")], local_transaction
            )
            await conn.rollback()
            return result

    result = asyncio.run(main())
    assert result.state is State.PREPARED
    assert states(pg_dsn, result.tx_id) == ["prepared"]


def test_async_half_records_and_send_in_transaction(pg_dsn: str) -> None:
    aoutbox = outbox.AsyncOutbox(producer_group="async-app")

    async def main() -> tuple[str, str]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            async with conn.transaction():
                written = await aoutbox.prepare(conn, "t", "half")
            await aoutbox.rollback(conn, written.tx_id)
            await conn.commit()

            async def local_transaction(w: Written) -> TransactionStatus:
                await asyncio.sleep(0)
                return TransactionStatus.COMMIT

            result = await aoutbox.send_in_transaction(conn, [Record("t", "x")], local_transaction)
            return written.tx_id, result.tx_id

    rolled_back, committed = asyncio.run(main())
    assert states(pg_dsn, rolled_back) == ["rolled_back"]
    assert states(pg_dsn, committed) == ["committed"]


def _settled_meanwhile(dsn: str, how: str) -> None:
    """What the checker (or an operator) does while a long local transaction runs."""
    with psycopg.connect(dsn) as other:
        tx_id = other.execute(
            "SELECT tx_id FROM outbox.outbox_record WHERE state = 'prepared'"
        ).fetchone()[0]  # type: ignore[index]
        if how == "rolled back":
            outbox.rollback(other, tx_id)
        elif how.startswith("delivered") and how.endswith("parked"):
            outbox.commit(other, tx_id)
            other.execute(
                "UPDATE outbox.outbox_record SET state = 'parked', reason = 'poison'"
                " WHERE id = (SELECT max(id) FROM outbox.outbox_record WHERE tx_id = %s)",
                (tx_id,),
            )
            delivered = (  # kept by a relay's delivered_retention, or removed (the default)
                "UPDATE outbox.outbox_record SET state = 'delivered'"
                if how == "delivered and parked"
                else "DELETE FROM outbox.outbox_record"
            )
            other.execute(delivered + " WHERE tx_id = %s AND state = 'committed'", (tx_id,))
        else:  # committed, delivered, and the row removed by the relay
            other.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,))
        other.commit()


def test_send_in_transaction_reports_what_the_checker_decided_first(pg_dsn: str) -> None:
    """The local transaction outlasted its check immunity; the endpoint answered ROLLBACK (no
    payment yet) and the checker rolled the records back; then the local work succeeded."""

    def local_transaction(written: Written) -> TransactionStatus:
        _settled_meanwhile(pg_dsn, "rolled back")
        return TransactionStatus.COMMIT

    with psycopg.connect(pg_dsn) as conn:
        result = outbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert (result.status, result.state, result.conflict) == (
        TransactionStatus.COMMIT,
        State.ROLLED_BACK,
        True,
    )
    assert states(pg_dsn, result.tx_id) == ["rolled_back"]


@pytest.mark.parametrize("how", ["delivered and parked", "delivered, removed and parked"])
@pytest.mark.parametrize("answer", [TransactionStatus.ROLLBACK, TransactionStatus.COMMIT])
def test_records_the_relay_ended_apart_after_the_checker_committed_are_reported_parked(
    pg_dsn: str, answer: TransactionStatus, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Committed by the checker, then one record delivered and one parked (kept by the relay's
    delivered_retention), then the local work answered. ROLLBACK: the mixed states raised
    TransactionStateError, though the outcome (committed, against the answer) is known.
    COMMIT: the result said committed, and nothing told of the parked record."""

    def local_transaction(written: Written) -> TransactionStatus:
        _settled_meanwhile(pg_dsn, how)
        return answer

    with psycopg.connect(pg_dsn) as conn:
        records = [Record("t", "a"), Record("t", "b")]
        result = outbox.send_in_transaction(conn, records, local_transaction)
    assert (result.status, result.state, result.conflict) == (
        answer,
        State.PARKED,
        answer is TransactionStatus.ROLLBACK,
    )
    left = ["delivered", "parked"] if how == "delivered and parked" else ["parked"]
    assert states(pg_dsn, result.tx_id) == left
    assert f"tx {result.tx_id} (default) was already {', '.join(left)}" in caplog.text


def test_async_send_in_transaction_raises_when_the_records_are_gone_already(pg_dsn: str) -> None:
    aoutbox = outbox.AsyncOutbox()

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:

            def local_transaction(written: Written) -> TransactionStatus:
                _settled_meanwhile(pg_dsn, "removed")
                return TransactionStatus.ROLLBACK

            await aoutbox.send_in_transaction(conn, [Record("t", "a")], local_transaction)

    with pytest.raises(outbox.UnknownTransactionError):
        asyncio.run(main())


@pytest.mark.parametrize("first", ["publish", "prepare"])
def test_published_and_prepared_records_do_not_share_a_tx_id(pg_dsn: str, first: str) -> None:
    """A rollback would move the prepared ones only: the library refuses the mix, and the
    caller's transaction stays usable."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        write = {"publish": outbox.publish, "prepare": outbox.prepare}
        second = "prepare" if first == "publish" else "publish"
        write[first](conn, "t", "one", tx_id="shared")
        with pytest.raises(outbox.OutboxUsageError, match="need a tx id of their own"):
            write[second](conn, "t", "two", tx_id="shared")
        write[first](conn, "t", "three", tx_id="shared")  # the same kind again is fine
    assert len(states(pg_dsn, "shared")) == 2


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_tx_id_prepared_again_after_its_end_is_refused_naming_what_it_holds(
    pg_dsn: str, end: str
) -> None:
    """Its ended half records were called "published records", which it never had."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.prepare(conn, "t", "one", tx_id="again")
        getattr(outbox, end)(conn, "again")
        with pytest.raises(outbox.OutboxUsageError) as refused:
            outbox.prepare(conn, "t", "two", tx_id="again")
        assert "already holds published or already ended records" in str(refused.value)


def test_send_in_transaction_names_the_records_it_may_have_prepared_when_cut_off_at_commit(
    pg_dsn: str,
) -> None:
    """Cut off at the COMMIT of step 1, it raised a bare database error: the caller never
    learnt the tx id (generated), could not roll back what may have been prepared, and tried
    again under a new one; the checker then asked the endpoint about the first id, unknown to
    the application. Staged with a trigger that ends its own session at the commit."""
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            """
            CREATE FUNCTION outbox.cut_off() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NULL; END $$;
            CREATE CONSTRAINT TRIGGER cut_off_at_commit AFTER INSERT ON outbox.outbox_record
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
            WHEN (NEW.producer_group = 'cut-off') EXECUTE FUNCTION outbox.cut_off();
            """
        )
    ran: list[Written] = []

    def local(written: Written) -> str:
        ran.append(written)
        return "COMMIT"

    records = [Record("orders.paid", b"a"), Record("orders.paid", b"b")]
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(outbox.PrepareOutcomeUnknown, match="may be prepared or not") as sync,
    ):
        outbox.Outbox(producer_group="cut-off").send_in_transaction(conn, records, local)

    async def main() -> outbox.PrepareOutcomeUnknown:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            with pytest.raises(outbox.PrepareOutcomeUnknown) as caught:
                await outbox.AsyncOutbox(producer_group="cut-off").send_in_transaction(
                    aconn, records, local
                )
        finally:
            await aconn.close()
        return caught.value

    for cut in (sync.value, asyncio.run(main())):
        assert ran == []  # the local transaction never ran
        assert cut.producer_group == "cut-off"
        assert len(cut.record_ids) == 2
        assert cut.tx_id in str(cut)
        # what the error names is what the caller rolls back: here nothing was prepared
        with (
            psycopg.connect(pg_dsn, autocommit=True) as conn,
            pytest.raises(outbox.UnknownTransactionError),
        ):
            outbox.rollback(conn, cut.tx_id, producer_group=cut.producer_group,
                            record_ids=cut.record_ids)  # fmt: skip
        # and the database says so: the prepare's transaction aborted (None while the ended
        # session's backend has not finished aborting it: asked again)
        assert cut.xid is not None
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 10
            while (answer := outbox.was_prepared(conn, cut)) is None:
                assert time.monotonic() < deadline, "the prepare's outcome never became known"
                time.sleep(0.01)
            assert answer is False


def test_send_in_transaction_cut_off_before_its_commit_raises_connection_lost(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lost while the prepare's transaction id was read, before its COMMIT was sent: nothing
    can have been prepared, and the error is the retryable one, not PrepareOutcomeUnknown
    with an outcome no database could tell."""
    import outbox._async
    import outbox._sync

    ended_there = "SELECT pg_terminate_backend(pg_backend_pid())::text"
    monkeypatch.setattr(outbox._sync, "PREPARE_XID", ended_there)
    monkeypatch.setattr(outbox._async, "PREPARE_XID", ended_there)
    records = [Record("orders.paid", b"a")]
    group = outbox.Outbox(producer_group="cut-before")
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(outbox.ConnectionLost) as sync,
    ):
        group.send_in_transaction(conn, records, lambda _: "COMMIT")

    async def main() -> BaseException:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            with pytest.raises(outbox.ConnectionLost) as caught:
                await outbox.AsyncOutbox(producer_group="cut-before").send_in_transaction(
                    aconn, records, lambda _: "COMMIT"
                )
        finally:
            await aconn.close()
        return caught.value

    for lost in (sync.value, asyncio.run(main())):
        assert not isinstance(lost, outbox.PrepareOutcomeUnknown)
    with psycopg.connect(pg_dsn) as conn:
        (count,) = conn.execute(
            "SELECT count(*) FROM outbox.outbox_record WHERE producer_group = 'cut-before'"
        ).fetchone()  # type: ignore[misc]
    assert count == 0


def test_was_prepared_asks_the_database_what_became_of_the_prepares_transaction(
    pg_dsn: str,
) -> None:
    """After a connection lost at the prepare's COMMIT, a rollback's UnknownTransactionError
    was no proof that nothing was prepared while that COMMIT might still be finishing."""

    def cut_off(xid: str | None) -> outbox.PrepareOutcomeUnknown:
        return outbox.PrepareOutcomeUnknown(
            "cut off", sqlstate=None, tx_id="t", producer_group="g", record_ids=(1,), xid=xid
        )

    with psycopg.connect(pg_dsn) as running, psycopg.connect(pg_dsn, autocommit=True) as conn:
        with running.transaction():
            outbox.prepare(running, "orders.paid", "v")
            (committed,) = running.execute("SELECT pg_current_xact_id()::text").fetchone()  # type: ignore[misc]
        outbox.prepare(running, "orders.paid", "w")
        (in_progress,) = running.execute("SELECT pg_current_xact_id()::text").fetchone()  # type: ignore[misc]
        assert outbox.was_prepared(conn, cut_off(committed)) is True
        assert outbox.was_prepared(conn, cut_off(in_progress)) is None  # not known yet
        running.rollback()
        assert outbox.was_prepared(conn, cut_off(in_progress)) is False
        assert outbox.was_prepared(conn, cut_off(None)) is None  # its id never read

        async def asked() -> bool | None:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
                return await outbox.AsyncOutbox().was_prepared(aconn, cut_off(committed))

        assert asyncio.run(asked()) is True
