"""Records whose transaction ids come from another Postgres cluster (a logical move: a dump
restored, a logical replica promoted): said, and delivered once given this cluster's ids by the
README's repair."""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

import outbox
from tests.fixtures.kafka import consume_all
from tests.integration.test_relay_delivery import rows, values

README = Path(__file__).parents[2] / "README.md"


def readme_repair() -> str:
    """The README's repair, as written there."""
    section = README.read_text().split("**Moving the database to another cluster.**")[1]
    found = re.search(r"```sql\n(.*?)```", section, re.S)
    assert found is not None, "the README shows no repair"
    return textwrap.dedent(found.group(1))


def far_xid_errors() -> float:
    value = REGISTRY.get_sample_value(
        "outbox_relay_errors_total", {"kind": "xid_of_another_cluster"}
    )
    return value or 0.0


def test_records_of_another_clusters_transaction_ids_are_said_and_the_repair_delivers_them(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No xid horizon of this cluster passes them: they were waited for in silence."""
    topic = topic_factory()  # one partition: the order is the delivery's
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            first = outbox.publish(conn, topic, "a")
        with conn.transaction():
            outbox.publish(conn, topic, "b")
        # as a dump restored in a younger cluster leaves them: ids it has not given yet
        conn.execute(
            "UPDATE outbox.outbox_record"
            " SET committed_xid = (committed_xid::text::bigint + 4000000000)::text::xid8"
        )
    with psycopg.connect(pg_dsn) as conn, conn.transaction():  # committed in this cluster
        outbox.publish(conn, topic, "c")
    relay = relay_factory()
    before = far_xid_errors()
    caplog.set_level(logging.ERROR, logger="relay.service")
    assert relay.run_once().delivered == 0  # "c" is held back behind them
    assert "2 committed records of shards 0 (id " in caplog.text
    assert "this database has not given yet" in caplog.text
    assert far_xid_errors() == before + 1
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(readme_repair())
        xids = conn.execute(
            "SELECT committed_xid::text::bigint FROM outbox.outbox_record ORDER BY id"
        ).fetchall()
    assert xids[0][0] < xids[1][0]  # a transaction each, in their old order
    assert xids[1][0] > xids[2][0]  # committed after "c" now
    until = 0
    while rows(pg_dsn) and until < 20:
        relay.run_once()
        until += 1
    assert rows(pg_dsn) == []
    delivered = consume_all(kafka_bootstrap, topic, "read_committed")
    assert values(delivered) == [b"c", b"a", b"b"]  # as the README says: after what came before
    assert dict(delivered[1].headers() or [])["outbox-id"] == str(first).encode()
