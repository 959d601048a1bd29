"""relay.pipelined against the real Postgres: one transaction, two round trips."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import _pipeline_base
from psycopg.pq import TransactionStatus

from relay.pipelined import pipelined_transaction


@pytest.fixture
def conn(pg_dsn: str) -> Any:
    with psycopg.connect(pg_dsn) as c:
        c.execute("CREATE TABLE t (n int)")
        c.commit()
        yield c


def count(conn: psycopg.Connection[Any]) -> int:
    return conn.execute("SELECT count(*) FROM t").fetchone()[0]  # type: ignore[index]


def test_commits_with_two_syncs(
    conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[None] = []
    enqueue = _pipeline_base.BasePipeline._enqueue_sync

    def counted(self: Any) -> None:
        syncs.append(None)
        enqueue(self)

    monkeypatch.setattr(_pipeline_base.BasePipeline, "_enqueue_sync", counted)
    with pipelined_transaction(conn):
        conn.execute("SELECT set_config('jit', 'off', true)")  # local: the transaction's
        conn.execute("INSERT INTO t VALUES (1)")
        jit = conn.execute("SHOW jit")
        assert jit.fetchone() == ("off",)
    assert len(syncs) == 2  # the fetch, then COMMIT; conn.transaction() in a pipeline took 4
    monkeypatch.undo()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert count(conn) == 1
    assert conn.execute("SHOW jit").fetchone() == ("on",)


def test_an_error_rolls_back_and_leaves_the_connection_usable(
    conn: psycopg.Connection[Any],
) -> None:
    def divide_by_zero() -> None:
        with pipelined_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
            conn.execute("SELECT 1 / 0").fetchall()

    with pytest.raises(psycopg.errors.DivisionByZero):
        divide_by_zero()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert count(conn) == 0
    conn.rollback()


def test_an_error_found_only_as_it_commits_rolls_back_too(
    conn: psycopg.Connection[Any],
) -> None:
    """Nothing fetched in the transaction: the error comes with the pipeline's last Sync."""

    def divide_by_zero_unfetched() -> None:
        with pipelined_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
            conn.execute("SELECT 1 / 0")

    with pytest.raises(psycopg.errors.DivisionByZero):
        divide_by_zero_unfetched()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    with pipelined_transaction(conn):  # the connection goes on
        conn.execute("INSERT INTO t VALUES (2)")
    assert count(conn) == 1
    conn.rollback()


def test_an_exception_of_the_caller_rolls_back(conn: psycopg.Connection[Any]) -> None:
    def fail() -> None:
        with pipelined_transaction(conn):
            conn.execute("INSERT INTO t VALUES (1)")
            raise LookupError

    with pytest.raises(LookupError):
        fail()
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert count(conn) == 0
    conn.rollback()


def test_refuses_an_open_transaction_and_autocommit(conn: psycopg.Connection[Any]) -> None:
    conn.execute("INSERT INTO t VALUES (1)")  # psycopg began a transaction
    refused = pytest.raises(psycopg.ProgrammingError, match="idle connection")
    with refused, pipelined_transaction(conn):
        pass
    conn.rollback()
    conn.autocommit = True
    refused = pytest.raises(psycopg.ProgrammingError, match="not in autocommit")
    with refused, pipelined_transaction(conn):
        pass
