"""The sidecar on a database whose defaults a DBA changed: it pins what it relies on (dbconnect.py).

`ALTER DATABASE ... SET default_transaction_isolation = 'serializable'` (or 'repeatable read',
or on the role) made every relay transaction run so. Its rounds then failed with "could not
serialize access due to concurrent update", round after round: nothing went out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

import outbox
from relay.cli import main
from spark import sink
from tests.fixtures.kafka import consume_all
from tests.fixtures.relay import RelayProcess
from tests.integration.test_relay_crashes import FAST, publish, undelivered, wait_for


def set_database_default(dsn: str, setting: str, value: str) -> None:
    """As a DBA sets it: for every new session of the test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                sql.Identifier(conn.info.dbname), sql.Identifier(setting), sql.Literal(value)
            )
        )


@pytest.mark.parametrize("isolation", ["serializable", "repeatable read"])
def test_a_stricter_isolation_default_does_not_fail_the_relays_rounds(
    isolation: str,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    set_database_default(pg_dsn, "default_transaction_isolation", isolation)
    with psycopg.connect(pg_dsn) as conn:  # new sessions take it
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == (isolation,)
    topic = topic_factory(partitions=3)
    relay = relay_process(shards=4, batch_size=10, **FAST)
    sent = []
    for round_ in range(8):  # while the relay runs: its shards end batches side by side
        sent += publish(pg_dsn, topic, transactions=60, per_tx=1, tag=f"r{round_}-")
    wait_for(lambda: undelivered(pg_dsn) == 0, 90, "delivery", relay)
    assert relay.terminate() == 0, relay.output()
    said = relay.output()
    assert "could not serialize" not in said
    assert "did not end here" not in said
    arrived = Counter(m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed"))
    assert arrived == Counter(sent)


def test_a_read_only_database_default_does_not_stop_the_relay(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """default_transaction_read_only = on (a DBA's guard against stray writes): every relay
    write failed, "cannot execute ... in a read-only transaction", round after round."""
    topic = topic_factory()
    sent = publish(pg_dsn, topic, transactions=30, per_tx=2)
    set_database_default(pg_dsn, "default_transaction_read_only", "on")
    relay = relay_process(shards=2, batch_size=10, **FAST)
    wait_for(lambda: undelivered(pg_dsn) == 0, 60, "delivery", relay)
    assert relay.terminate() == 0, relay.output()
    assert "read-only transaction" not in relay.output()
    arrived = Counter(m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed"))
    assert arrived == Counter(sent)


def test_the_reconciliations_sink_and_outboxctl_write_under_a_read_only_default(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sink wrote its findings in the database's default mode: "cannot execute CREATE
    TABLE in a read-only transaction" (found by a review helper)."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        prepared = outbox.prepare(conn, "orders.created", "v", producer_group="g")
    set_database_default(pg_dsn, "default_transaction_read_only", "on")
    with sink.connect(pg_dsn) as conn:
        sink.write_judgement(conn, "outbox", [], [], detected_in="test")
        sink.prune(conn, "outbox", timedelta(days=1))
    argv = ["resolve", "--dsn", pg_dsn, "--producer-group", "g", "--tx-id", prepared.tx_id]
    assert main([*argv, "--commit", "--actor", "ops", "--reason", "checked by hand"]) == 0
    assert main(["status", "--dsn", pg_dsn, "--json"]) == 0
    assert '"committed": 1' in capsys.readouterr().out.splitlines()[-1]
