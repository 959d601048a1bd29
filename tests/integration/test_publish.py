"""publish() inside the caller's transaction, against the real Postgres."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row, namedtuple_row, scalar_row

import outbox
from outbox import Outbox, Record
from outbox._session import statement_cursor


def rows(dsn: str, schema: str = "outbox") -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            f"SELECT id, tx_id, producer_group, topic, key, value, headers, partition, state "
            f"FROM {schema}.outbox_record ORDER BY id"
        ).fetchall()


def test_caller_rollback_leaves_nothing(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        conn.commit()
        outbox.publish(conn, "orders.created", {"id": 1}, key="1")
        conn.execute("INSERT INTO orders VALUES (1)")
        conn.rollback()
    assert rows(pg_dsn) == []


def test_commit_leaves_exactly_the_records(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        first = outbox.publish(
            conn,
            "orders.created",
            {"id": 1, "name": "ä"},
            key="1",
            headers=[("h", "v"), ("h", b"\x00")],
        )
        second = outbox.publish(conn, "orders.paid", b"\x01\x02", key=b"k", partition=2)
        third = outbox.publish(conn, "orders.deleted", None, key="1")  # a tombstone
    stored = rows(pg_dsn)
    tx_id = stored[0][1]
    assert tx_id.startswith("xid:")  # a published transaction's id, made by the outbox
    assert stored == [
        (
            first,
            tx_id,
            "default",
            "orders.created",
            b"1",
            '{"id":1,"name":"ä"}'.encode(),
            [["h", base64.b64encode(b"v").decode()], ["h", "AA=="]],
            None,
            "committed",
        ),
        (
            second,
            tx_id,
            "default",
            "orders.paid",
            b"k",
            b"\x01\x02",
            [],
            2,
            "committed",
        ),
        (third, tx_id, "default", "orders.deleted", b"1", None, [], None, "committed"),
    ]


def test_records_of_one_database_transaction_share_a_tx_id(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            outbox.publish(conn, "a", "1")
            outbox.publish(conn, "b", "2")
        with conn.transaction():
            outbox.publish(conn, "a", "3")
    tx_ids = [r[1] for r in rows(pg_dsn)]
    assert tx_ids[0] == tx_ids[1] != tx_ids[2]
    assert all(t.startswith("xid:") for t in tx_ids)


def test_batch_keeps_order_and_returns_ids(pg_dsn: str) -> None:
    records = [Record(f"topic.{i % 3}", f"v{i}", key=str(i)) for i in range(100)]
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        written = outbox.publish_many(conn, records, tx_id="batch-1")
    stored = rows(pg_dsn)
    assert list(written.ids) == [r[0] for r in stored]
    assert [r[5] for r in stored] == [f"v{i}".encode() for i in range(100)]
    assert {r[1] for r in stored} == {"batch-1"} == {written.tx_id}


AWKWARD = [  # what text-format arrays must escape: quotes, backslashes, braces, commas, NUL
    Record("t.a", b'{"q":"\\",\x00\xff}', key=b"k,{1}", headers=[("h", b'"\\'), ("h", None)]),
    Record("t.b", None, key=None, partition=3),  # a keyless tombstone
    Record("t.c", b"", key="ä", headers={"näme": "väl"}),
    Record("t.d", "x" * 5000, key=str(7), partition=0),
]


def test_a_batch_stores_every_field_as_single_publishes_do(pg_dsn: str) -> None:
    """publish_many sends its arrays in binary, publish its values one by one: both must store
    the same bytes, headers, partitions and key hashes (a keyless record hashes by tx id)."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, AWKWARD, tx_id="batch")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for r in AWKWARD:
            outbox.publish(
                conn, r.topic, r.value, key=r.key, headers=r.headers, partition=r.partition,
                tx_id="single",
            )  # fmt: skip
    with psycopg.connect(pg_dsn) as conn:
        stored = conn.execute(
            "SELECT tx_id, topic, key, value, headers, partition, key_hash"
            " FROM outbox.outbox_record ORDER BY id"
        ).fetchall()
    batch, single = stored[: len(AWKWARD)], stored[len(AWKWARD) :]
    assert [r[1:6] for r in batch] == [r[1:6] for r in single]
    assert [r[2:4] for r in batch] == [
        (b"k,{1}", b'{"q":"\\",\x00\xff}'),
        (None, None),
        ("ä".encode(), b""),
        (b"7", b"x" * 5000),
    ]
    assert [r[5] for r in batch] == [None, 3, None, 0]
    keyed = [i for i, r in enumerate(AWKWARD) if r.key is not None]
    assert [batch[i][6] for i in keyed] == [single[i][6] for i in keyed]
    assert batch[1][6] != single[1][6]  # the keyless one: by its tx id, which differs


def stored_fields(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT topic, key, value, headers, partition FROM outbox.outbox_record ORDER BY id"
        ).fetchall()


@pytest.mark.parametrize("factory", [psycopg.ClientCursor, psycopg.RawCursor])
def test_any_cursor_factory_of_the_connection_works(pg_dsn: str, factory: type) -> None:
    """ClientCursor (client-side binding, for poolers that allow no other) is used as it is; a
    RawCursor takes $1 parameters only, so the outbox runs its statements on a plain cursor."""
    with psycopg.connect(pg_dsn) as plain, plain.transaction():
        outbox.publish_many(plain, AWKWARD)
        outbox.publish(plain, "t.single", b"one", key="k")
    expected = stored_fields(pg_dsn)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("TRUNCATE outbox.outbox_record")
        conn.commit()
    with psycopg.connect(pg_dsn, cursor_factory=factory) as conn, conn.transaction():
        outbox.publish_many(conn, AWKWARD)
        outbox.publish(conn, "t.single", b"one", key="k")
        used = type(statement_cursor(conn))
        assert used is (psycopg.ClientCursor if factory is psycopg.ClientCursor else psycopg.Cursor)
    assert stored_fields(pg_dsn) == expected


@pytest.mark.parametrize("row_factory", [dict_row, namedtuple_row, scalar_row])
def test_any_row_factory_of_the_connection_works(pg_dsn: str, row_factory: Any) -> None:
    """The outbox reads its own rows as tuples: a dict_row connection failed after the INSERT."""
    with psycopg.connect(pg_dsn, row_factory=row_factory) as conn:
        with conn.transaction():
            one = outbox.publish(conn, "t", b"one", key="k")
            many = outbox.publish_many(conn, [Record("t", b"two"), Record("t", b"three")])
        with conn.transaction(), conn.cursor() as cur:
            prepared = outbox.prepare(cur, "t", b"four")
        outbox.commit(conn, prepared.tx_id)
    assert [r[0] for r in rows(pg_dsn)] == [one, *many.ids, *prepared.ids]
    assert [r[8] for r in rows(pg_dsn)] == ["committed"] * 4


def test_async_any_row_factory_works(pg_dsn: str) -> None:
    async def main() -> list[int]:
        aoutbox = outbox.AsyncOutbox()
        async with await psycopg.AsyncConnection.connect(pg_dsn, row_factory=dict_row) as conn:
            async with conn.transaction():
                one = await aoutbox.publish(conn, "t", b"one")
                many = await aoutbox.publish_many(conn, [Record("t", b"two")])
            return [one, *many.ids]

    written = asyncio.run(main())
    assert [r[0] for r in rows(pg_dsn)] == written


def test_a_server_cursor_or_raw_cursor_given_writes_in_its_connection(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction(), conn.cursor(name="named") as named:
            outbox.publish(named, "t", b"server")
            outbox.publish_many(psycopg.RawCursor(conn), [Record("t", b"raw")])
        with conn.cursor(name="named2") as named:  # the caller's transaction: rolled back
            outbox.publish(named, "t", b"gone")
            conn.rollback()
    assert [r[2] for r in stored_fields(pg_dsn)] == [b"server", b"raw"]


def test_async_any_cursor_works(pg_dsn: str) -> None:
    async def main() -> None:
        aoutbox = outbox.AsyncOutbox()
        for factory in (psycopg.AsyncClientCursor, psycopg.AsyncRawCursor):
            connecting = psycopg.AsyncConnection.connect(pg_dsn, cursor_factory=factory)
            async with await connecting as conn, conn.transaction():
                await aoutbox.publish_many(conn, [Record("t", factory.__name__)])
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            await aoutbox.publish(psycopg.AsyncRawCursor(conn), "t", "raw")
            async with conn.cursor(name="named") as named:
                await aoutbox.publish(named, "t", "server")

    asyncio.run(main())
    assert [r[2] for r in stored_fields(pg_dsn)] == [
        b"AsyncClientCursor",
        b"AsyncRawCursor",
        b"raw",
        b"server",
    ]


def test_a_cursor_works_as_well_as_a_connection(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.transaction(), conn.cursor() as cur:
        record_id = outbox.publish(cur, "t", "v")
    assert [r[0] for r in rows(pg_dsn)] == [record_id]


def test_autocommit_without_a_transaction_is_refused(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(outbox.OutboxUsageError, match="autocommit"):
            outbox.publish(conn, "t", "v")
        with conn.transaction():  # the same connection inside a transaction is fine
            outbox.publish(conn, "t", "v")
    assert len(rows(pg_dsn)) == 1


def test_async_autocommit_without_a_transaction_names_the_async_block(pg_dsn: str) -> None:
    """It told asyncio users to write `with conn.transaction():`, which an AsyncConnection
    refuses."""

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            with pytest.raises(outbox.OutboxUsageError, match=r"`async with conn\.transaction"):
                await outbox.AsyncOutbox().publish(conn, "t", "v")

    asyncio.run(main())
    assert rows(pg_dsn) == []


def test_every_call_works_in_pipeline_mode(pg_dsn: str) -> None:
    """In pipeline mode the rows of a statement are there only once fetched: every call wrote
    its records, then raised IndexError (commit: UnknownTransactionError, after committing)."""
    with psycopg.connect(pg_dsn) as conn, conn.pipeline():
        one = outbox.publish(conn, "t", "one", key="k")
        batch = outbox.publish_many(conn, [Record("t", "two"), Record("t", "three")])
        named = outbox.publish(conn, "t", "four", tx_id="given")
        half = outbox.prepare(conn, "t", "five")
        ended = outbox.commit(conn, half.tx_id)
    assert (ended.state, ended.changed, ended.ids) == (outbox.State.COMMITTED, True, half.ids)
    assert [r[0] for r in rows(pg_dsn)] == [one, *batch.ids, named, *half.ids]
    assert {r[8] for r in rows(pg_dsn)} == {"committed"}


def test_async_calls_work_in_pipeline_mode(pg_dsn: str) -> None:
    async def main() -> list[int]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            async with conn.pipeline():
                one = await outbox.AsyncOutbox().publish(conn, "t", "one")
                half = await outbox.AsyncOutbox().prepare(conn, "t", "two")
                await outbox.AsyncOutbox().commit(conn, half.tx_id)
            return [one, *half.ids]

    written = asyncio.run(main())
    assert [r[0] for r in rows(pg_dsn)] == written


def test_autocommit_in_pipeline_mode_needs_a_transaction_too(pg_dsn: str) -> None:
    """A statement queued in a pipeline makes the status ACTIVE, not IDLE: an autocommit
    connection's record went through the check, and committed on its own."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn, conn.pipeline():
        conn.execute("SELECT 1")
        with pytest.raises(outbox.OutboxUsageError, match="autocommit"):
            outbox.publish(conn, "t", "alone")
        with conn.transaction():
            kept = outbox.publish(conn, "t", "in a transaction")
    assert [(r[0], r[5]) for r in rows(pg_dsn)] == [(kept, b"in a transaction")]


def test_in_pipeline_mode_the_callers_failed_statement_fails_as_its_own(pg_dsn: str) -> None:
    """Its error surfaced at the outbox's statement and was reported as the outbox's: a
    mistyped table of the caller's was "the outbox tables are missing: run outboxctl
    migrate", a duplicate order "the database failed" (not the UniqueViolation it is)."""
    with psycopg.connect(pg_dsn) as conn, conn.pipeline():
        conn.execute("INSERT INTO no_such_orders VALUES (1)")  # queued, not yet answered
        with pytest.raises(psycopg.errors.UndefinedTable, match="no_such_orders"):
            outbox.publish(conn, "t", "v")
        conn.rollback()

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.pipeline():
            await conn.execute("INSERT INTO no_such_orders VALUES (1)")
            with pytest.raises(psycopg.errors.UndefinedTable, match="no_such_orders"):
                await outbox.AsyncOutbox().publish(conn, "t", "v")
            await conn.rollback()

    asyncio.run(main())
    assert rows(pg_dsn) == []


def test_a_given_tx_id_of_the_outboxs_own_form_is_refused(pg_dsn: str) -> None:
    """Given here, `xid:N` could be the id transaction N gets later, unchecked: two database
    transactions under one tx id."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for write in (outbox.publish, outbox.prepare):
            with pytest.raises(outbox.InvalidTxIdError, match="leave tx_id unset"):
                write(conn, "t", "v", tx_id="xid:1000")
        outbox.publish(conn, "t", "v", tx_id="xid-like-but-mine")  # the transaction goes on
    assert len(rows(pg_dsn)) == 1


def test_records_may_come_from_a_generator_but_not_alone(pg_dsn: str) -> None:
    """A generator was used up by the checks, and the INSERT got none: IndexError."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        written = outbox.publish_many(conn, (Record("t", f"v{i}") for i in range(3)))
        with pytest.raises(outbox.OutboxUsageError, match="single Record given"):
            outbox.publish_many(conn, Record("t", "alone"))  # type: ignore[arg-type]
    assert [r[5] for r in rows(pg_dsn)] == [b"v0", b"v1", b"v2"]
    assert len(written.ids) == 3


def test_migrate_refuses_a_connection_inside_a_transaction(pg_dsn: str) -> None:
    """Its transaction would be a savepoint in the caller's: reported applied, then rolled back
    with the caller's."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(outbox.OutboxUsageError, match="no transaction open"):
            outbox.migrate(conn, schema="inside")
        conn.rollback()
        assert conn.execute("SELECT to_regnamespace('inside')").fetchone() == (None,)
        conn.rollback()
        assert outbox.migrate(conn, schema="inside").applied  # once idle, it migrates


def test_migrate_reports_database_failures_as_the_librarys_error() -> None:
    with pytest.raises(outbox.OutboxDatabaseError, match="migrating schema 'outbox' failed") as e:
        outbox.migrate("host=127.0.0.1 port=1 dbname=none connect_timeout=2")
    assert isinstance(e.value.__cause__, psycopg.OperationalError)


def test_the_longest_schema_name_migrates_publishes_and_wakes_the_relay(pg_dsn: str) -> None:
    schema = "s" * outbox.MAX_SCHEMA_NAME
    outbox.migrate(pg_dsn, schema=schema)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {outbox.wakeup_channel(schema)}")
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            Outbox(schema_name=schema).publish(conn, "t", "v")
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == [
            outbox.wakeup_channel(schema)
        ]


def test_an_aborted_transaction_is_reported_clearly(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(outbox.OutboxUsageError, match="aborted"):
            outbox.publish(conn, "t", "v")


class Unserializable:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"topic": "bad topic"}, outbox.InvalidTopicError, "bad topic"),
        ({"topic": ""}, outbox.InvalidTopicError, "1 to 249"),
        ({"topic": ".."}, outbox.InvalidTopicError, "not allowed"),
        ({"topic": "x" * 250}, outbox.InvalidTopicError, "it has 250"),
        ({"headers": {"": "v"}}, outbox.InvalidHeaderError, "empty"),
        ({"headers": {"h": 5}}, outbox.InvalidHeaderError, "'h'.*bytes, str or None, got int"),
        ({"headers": {"h": bytearray(b"x")}}, outbox.InvalidHeaderError, "got bytearray"),
        ({"headers": {"outbox-id": "1"}}, outbox.InvalidHeaderError, "reserved"),
        ({"headers": [("h",)]}, outbox.InvalidHeaderError, "pair"),
        ({"headers": "h=v"}, outbox.InvalidHeaderError, "mapping"),
        ({"value": b"x" * 1_048_577}, outbox.RecordTooLargeError, "1048577 bytes"),
        ({"value": Unserializable()}, outbox.SerializationError, "Unserializable"),
        ({"partition": -1}, outbox.InvalidRecordError, "partition"),
        ({"tx_id": "has space"}, outbox.InvalidTxIdError, "has space"),
        ({"producer_group": "grp/1"}, outbox.InvalidProducerGroupError, "grp/1"),
    ],
)
def test_bad_input_writes_nothing_and_the_transaction_stays_usable(
    pg_dsn: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    call: dict[str, Any] = {"topic": "ok", "value": "v", **kwargs}
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TABLE business (id int)")
        conn.commit()
        with conn.transaction():
            conn.execute("INSERT INTO business VALUES (1)")
            with pytest.raises(error, match=message):
                outbox.publish(conn, **call)
            conn.execute("INSERT INTO business VALUES (2)")  # still usable
        assert conn.execute("SELECT count(*) FROM business").fetchone() == (2,)
    assert rows(pg_dsn) == []


def test_record_size_limit_is_configurable(pg_dsn: str) -> None:
    small = Outbox(max_record_bytes=10)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        small.publish(conn, "t", b"x" * 9, key=b"k")
        with pytest.raises(outbox.RecordTooLargeError, match="11 bytes"):
            small.publish(conn, "t", b"x" * 9, key=b"kk")
    assert len(rows(pg_dsn)) == 1


def test_a_custom_serializer_is_used(pg_dsn: str) -> None:
    upper = Outbox(value_serializer=lambda v: str(v).upper().encode())
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        upper.publish(conn, "t", "shout")
    assert rows(pg_dsn)[0][5] == b"SHOUT"


def test_unmigrated_database_says_how_to_fix_it(pg_dsn: str) -> None:
    other = Outbox(schema_name="not_migrated")
    with (
        psycopg.connect(pg_dsn) as conn,
        pytest.raises(outbox.SchemaError, match="outboxctl migrate"),
    ):
        other.publish(conn, "t", "v")


def test_another_schema_name(pg_dsn: str) -> None:
    outbox.migrate(pg_dsn, schema="tenant_a")
    tenant = Outbox(schema_name="tenant_a", producer_group="billing")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        tenant.publish(conn, "t", "v")
    assert [(r[2], r[3]) for r in rows(pg_dsn, "tenant_a")] == [("billing", "t")]
    assert rows(pg_dsn) == []


def test_schema_name_must_be_an_identifier() -> None:
    with pytest.raises(ValueError, match="plain identifier"):
        Outbox(schema_name='x"; DROP TABLE y; --')


def test_commit_notifies_the_relay(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {outbox.wakeup_channel('outbox')}")
        with psycopg.connect(pg_dsn) as conn:
            with conn.transaction():
                outbox.publish(conn, "t", "v")
            quiet = Outbox(notify=False)
            with conn.transaction():
                quiet.publish(conn, "t", "v")
        got = [n.channel for n in listener.notifies(timeout=5, stop_after=1)]
        assert got == ["outbox_wakeup"]
        assert list(listener.notifies(timeout=0.5)) == []  # the quiet publish woke nobody


def test_concurrent_writers(pg_dsn: str) -> None:
    writers, per_writer = 8, 25
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            with psycopg.connect(pg_dsn) as conn:
                for i in range(per_writer):
                    with conn.transaction():
                        outbox.publish(conn, "t", f"{n}-{i}", key=str(n))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stored = rows(pg_dsn)
    assert len(stored) == writers * per_writer
    assert len({r[1] for r in stored}) == writers * per_writer  # one tx id per transaction
    for n in range(writers):  # each writer's records in its own order
        mine = [r[5] for r in stored if r[4] == str(n).encode()]
        assert mine == [f"{n}-{i}".encode() for i in range(per_writer)]


def test_async_publish_and_rollback(pg_dsn: str) -> None:
    async def main() -> int:
        aoutbox = outbox.AsyncOutbox()
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            async with conn.transaction():
                kept = await aoutbox.publish(conn, "t", "kept")
            await aoutbox.publish(conn, "t", "dropped")
            await conn.rollback()
            async with conn.transaction(), conn.cursor() as cur:
                await aoutbox.publish_many(cur, [Record("t", "batch")])
            return kept

    kept = asyncio.run(main())
    assert rows(pg_dsn)[0][0] == kept
    assert [r[5] for r in rows(pg_dsn)] == [b"kept", b"batch"]


def test_records_written_in_a_two_phase_transaction_can_be_prepared_and_committed(
    pg_dsn: str,
) -> None:
    """publish and commit NOTIFY the relay, and Postgres refuses to PREPARE a transaction that
    ran NOTIFY: the application's transaction was lost at tpc_prepare."""
    with psycopg.connect(pg_dsn) as conn:
        conn.tpc_begin(conn.xid(1, "outbox-2pc", "sync"))
        outbox.publish(conn, "t", "sync")
        conn.tpc_prepare()
        conn.tpc_commit()
        half = outbox.prepare(conn, "t", "half")
        conn.commit()
        conn.tpc_begin(conn.xid(1, "outbox-2pc", "commit"))
        outbox.commit(conn, half.tx_id)
        conn.tpc_prepare()
        conn.tpc_commit()

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await conn.tpc_begin("outbox-2pc-async")
            await outbox.AsyncOutbox().publish(conn, "t", "async")
            await conn.tpc_prepare()
            await conn.tpc_commit()

    asyncio.run(main())
    assert [(r[5], r[8]) for r in rows(pg_dsn)] == [
        (b"sync", "committed"),
        (b"half", "committed"),
        (b"async", "committed"),
    ]


def test_a_serialization_failure_is_a_transaction_conflict_with_its_sqlstate(
    pg_dsn: str,
) -> None:
    """Wrapped as a plain OutboxDatabaseError without its SQLSTATE, a retry loop that catches
    serialization failures missed those raised inside the outbox's calls."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        half = outbox.prepare(conn, "t", "v")
    with psycopg.connect(pg_dsn) as late, psycopg.connect(pg_dsn) as other:
        late.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        late.execute("SELECT 1")  # its snapshot, taken before the other's rollback
        with other.transaction():
            outbox.rollback(other, half.tx_id)
        with pytest.raises(outbox.TransactionConflict) as conflict:
            outbox.commit(late, half.tx_id)
    assert isinstance(conflict.value, outbox.OutboxDatabaseError)
    assert conflict.value.sqlstate == "40001"
    assert isinstance(conflict.value.__cause__, psycopg.errors.SerializationFailure)


def test_sync_api_refuses_an_async_connection(pg_dsn: str) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            with pytest.raises(outbox.OutboxUsageError, match="AsyncOutbox"):
                outbox.publish(conn, "t", "v")  # type: ignore[arg-type]

    asyncio.run(main())


@pytest.mark.parametrize("batch", [False, True])
def test_header_names_survive_a_global_json_dumps_on_a_latin1_connection(
    pg_dsn: str, batch: bool
) -> None:
    """psycopg sends JSON as UTF-8 in any client encoding: with an application's dumps that
    keeps non-ASCII (orjson's way), 'café' was stored as 'cafÃ©' from a LATIN1 connection."""
    import json

    from psycopg.types.json import set_json_dumps

    set_json_dumps(lambda obj: json.dumps(obj, ensure_ascii=False))
    try:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute("SET client_encoding TO LATIN1")
            with conn.transaction():
                records = [Record("t", b"v", headers={"café": "x"}), Record("t", b"w")]
                written = Outbox().publish_many(conn, records if batch else records[:1])
    finally:
        set_json_dumps(json.dumps)
    with psycopg.connect(pg_dsn, client_encoding="UTF8") as conn:
        row = conn.execute(
            "SELECT headers FROM outbox.outbox_record WHERE id = %s", (written.ids[0],)
        ).fetchone()
    assert row is not None
    assert row[0][0][0] == "café"


def test_the_outbox_works_on_a_sql_ascii_database(database_in: Callable[[str], str]) -> None:
    """Its own text results came back as bytes: every caller-given tx id was refused, the
    tx ids it returned were refused by commit(), and send_in_transaction never ended its
    records."""
    box = Outbox(producer_group="legacy")
    with psycopg.connect(database_in("SQL_ASCII")) as conn:
        with conn.transaction():
            given = box.publish_many(conn, [Record("t", b"a")], tx_id="order-1")
        with conn.transaction():
            half = box.prepare(conn, "t", b"p")
        with conn.transaction():
            assert box.commit(conn, half.tx_id).changed
        with conn.transaction():
            assert not box.commit(conn, half.tx_id).changed  # a repeat stays harmless
        sent = box.send_in_transaction(conn, [Record("t", b"s")], lambda _: "COMMIT")
    assert (given.tx_id, type(half.tx_id)) == ("order-1", str)
    assert sent.state is outbox.State.COMMITTED


def test_what_is_not_a_connection_is_named_with_what_to_give(pg_dsn: str) -> None:
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

    sync_box, async_box = Outbox(), outbox.AsyncOutbox()
    pool = ConnectionPool(pg_dsn, open=False)
    for given, said in [
        (pg_dsn, "got str: connect first"),
        (pool, "got ConnectionPool: take a connection from the pool, `with pool.connection()"),
    ]:
        with pytest.raises(outbox.OutboxUsageError, match=re.escape(said)):
            sync_box.publish(given, "t", "v")  # type: ignore[arg-type]

    async def main() -> None:
        apool = AsyncConnectionPool(pg_dsn, open=False)
        with psycopg.connect(pg_dsn) as conn:
            with pytest.raises(outbox.OutboxUsageError, match="got Connection: use Outbox for"):
                await async_box.publish(conn, "t", "v")  # type: ignore[arg-type]
            with pytest.raises(outbox.OutboxUsageError, match="got str: connect first"):
                await async_box.publish(pg_dsn, "t", "v")  # type: ignore[arg-type]
            with pytest.raises(outbox.OutboxUsageError, match=r"`async with pool\.connection\(\)"):
                await async_box.publish(apool, "t", "v")  # type: ignore[arg-type]
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            with pytest.raises(outbox.OutboxUsageError, match="got AsyncConnection: use Async"):
                sync_box.publish(aconn, "t", "v")  # type: ignore[arg-type]

    asyncio.run(main())


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_a_header_name_the_databases_encoding_cannot_store_is_named(
    database_in: Callable[[str], str], encoding: str
) -> None:
    with psycopg.connect(database_in(encoding)) as conn:
        with pytest.raises(outbox.OutboxDatabaseError, match="a header name or tx id holds a"):
            outbox.publish(conn, "t", b"v", headers={"\u20acuro": "x"})
        conn.rollback()
        with conn.transaction():  # what it can store goes
            outbox.publish(conn, "t", b"v", headers={"euro": "x"})
