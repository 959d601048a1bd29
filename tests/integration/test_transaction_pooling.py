"""The sidecar through a real PgBouncer in transaction pooling (`database.transaction_pooling`).

Such a pooler gives each transaction whichever server connection is free. psycopg prepares a
statement on its 5th run, under a name of its own counter (`_pg3_0`, ...): through the pooler
another client's server connection already has that name, or the next transaction's lacks it.
The relay failed so in its first rounds and delivered nothing; LISTEN hears nothing there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

import outbox
from outbox.checkback import CheckHandler, CheckRequest, TransactionStatus, serve
from relay.cli import main
from relay.config import SidecarSettings
from relay.markers import OUTBOX_ID_HEADER
from tests.fixtures.kafka import consume_all
from tests.integration.test_relay_crashes import FAST, wait_for

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_" + base64.b64encode(b"p" * 32).decode()
GROUP = "billing"
KEYS = 5


def prepared_statements_collide(pooled_dsn: str) -> bool:
    """Two clients that prepare, one after the other, through the pooler: the second's first
    prepared statement meets the first's on the server connection they share."""
    for n in range(2):
        with psycopg.connect(pooled_dsn, autocommit=True) as conn:
            try:
                for _ in range(6):  # prepared on the 5th run
                    conn.execute(f"SELECT {n} + %s::int", (1,))
            except (
                psycopg.errors.DuplicatePreparedStatement,
                psycopg.errors.InvalidSqlStatementName,
            ):
                return True
    return False


def rows_left(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT state, count(*) FROM outbox.outbox_record GROUP BY state")
        return {state: count for state, count in rows}


def test_the_pooler_here_shares_server_connections(pooled_dsn: str) -> None:
    """What the test below relies on: the pooler really pools by transaction (in session pooling
    it would pass without the setting)."""
    assert prepared_statements_collide(pooled_dsn)


def test_the_sidecar_delivers_and_checks_back_through_a_transaction_pooler(
    pooled_dsn: str,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
    tmp_path: Path,
) -> None:
    prepared_statements_collide(pooled_dsn)  # the server connections now hold `_pg3_0`
    topic = topic_factory(partitions=3)
    # small batches over several shards: every statement of a round runs many times
    relay = relay_settings(shards=4, batch_size=7, **FAST).relay
    asked: list[str] = []

    def resolve(request: CheckRequest) -> TransactionStatus:
        asked.append(request.tx_id)
        return (
            TransactionStatus.COMMIT
            if request.tx_id.startswith("yes")
            else TransactionStatus.ROLLBACK
        )

    # The application's side, as psycopg advises for such a pooler: prepare_threshold=None.
    expected: dict[str, list[str]] = defaultdict(list)  # key -> outbox ids in commit order
    with psycopg.connect(pooled_dsn, prepare_threshold=None) as conn:
        for i in range(60):
            key = f"k{i % KEYS}"
            with conn.transaction():
                written = outbox.publish(conn, topic, f"sync-{i}", key=key)
            expected[key].append(str(written))
        with conn.transaction():
            outbox.publish(conn, topic, "rolled-back", key="k0")
            raise psycopg.Rollback
        with conn.transaction():
            yes = outbox.prepare(
                conn,
                topic,
                "checked-yes",
                key="checked",
                producer_group=GROUP,
                tx_id=f"yes-{uuid.uuid4().hex}",
                check_immunity=0,
            )
        with conn.transaction():
            no = outbox.prepare(
                conn,
                topic,
                "checked-no",
                key="checked",
                producer_group=GROUP,
                tx_id=f"no-{uuid.uuid4().hex}",
                check_immunity=0,
            )

    with serve(CheckHandler(resolve, [SECRET])) as server:
        env = {
            **os.environ,
            "OUTBOX_DATABASE__DSN": pooled_dsn,
            "OUTBOX_DATABASE__TRANSACTION_POOLING": "true",
            "OUTBOX_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            # the relay's settings as the fixture gave them: listen_notify unset
            "OUTBOX_RELAY": relay.model_dump_json(exclude_unset=True),
            f"OUTBOX_CHECKER__ENDPOINTS__{GROUP}__URL": server.url,
            f"OUTBOX_CHECKER__ENDPOINTS__{GROUP}__SECRETS": json.dumps([SECRET]),
            "OUTBOX_CHECKER__POLL_INTERVAL": "PT0.2S",
            "OUTBOX_HTTP__ENABLED": "false",
            "OUTBOX_LOG_FORMAT": "text",
        }
        log = tmp_path / "sidecar.log"
        with log.open("wb") as out:
            sidecar = subprocess.Popen(
                [sys.executable, "-m", "relay.cli", "run"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        try:

            async def more() -> None:  # the async helper too, while the sidecar runs
                aconn = await psycopg.AsyncConnection.connect(pooled_dsn, prepare_threshold=None)
                async with aconn:
                    for i in range(20):
                        key = f"k{i % KEYS}"
                        async with aconn.transaction():
                            written = await outbox.AsyncOutbox().publish(
                                aconn, topic, f"async-{i}", key=key
                            )
                        expected[key].append(str(written))

            asyncio.run(more())
            expected["checked"] = [str(yes.ids[0])]
            wait_for(
                lambda: set(rows_left(pg_dsn)) <= {"rolled_back"} and len(asked) >= 2,
                90,
                f"delivery and check-back through the pooler; the sidecar said:\n{log.read_text()}",
            )
            sidecar.terminate()
            assert sidecar.wait(30) == 0, log.read_text()
        finally:
            if sidecar.poll() is None:
                sidecar.kill()

    said = log.read_text()
    assert "prepared statement" not in said
    assert " ERROR " not in said, said
    delivered: dict[str, list[str]] = defaultdict(list)
    for message in consume_all(kafka_bootstrap, topic, "read_committed"):
        headers = dict(message.headers() or [])
        delivered[message.key().decode()].append(headers[OUTBOX_ID_HEADER].decode())
    # once each, in commit order per key; the rolled-back and the checked-no never
    assert dict(delivered) == dict(expected)
    assert set(asked) == {yes.tx_id, no.tx_id}


def test_commands_work_through_a_transaction_pooler(
    pooled_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared_statements_collide(pooled_dsn)  # the server connections now hold `_pg3_0`
    with psycopg.connect(pooled_dsn, prepare_threshold=None) as conn, conn.transaction():
        for i in range(3):
            outbox.publish(conn, "orders.created", f"m{i}")
    assert main(["records", "--dsn", pooled_dsn, "--limit", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    assert main(["status", "--dsn", pooled_dsn, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["states"]["committed"] == 3
