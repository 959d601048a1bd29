"""Lease heartbeats of several relays against the real Postgres."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

import outbox
from relay.leases import LeaseManager

LEASE = timedelta(seconds=15)


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"leases_{uuid.uuid4().hex[:8]}"
    outbox.migrate(pg_dsn, schema=name)
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def test_a_heartbeat_waiting_for_its_own_lease_row_holds_up_no_other_relay(
    pg_dsn: str, schema: str
) -> None:
    """The shard-count lock was held through the whole heartbeat: one relay whose renewal
    waited for a lease row (its batch end holds it) made every other relay's heartbeat wait
    behind it, past their leases' end if it lasted."""
    with (
        psycopg.connect(pg_dsn) as a_conn,
        psycopg.connect(pg_dsn) as b_conn,
        psycopg.connect(pg_dsn) as ender,
    ):
        a = LeaseManager(schema, "relay-a", 4, LEASE)
        assert len(a.heartbeat(a_conn).gained) == 4
        # relay A's ender, ending a batch of shard 0: its lease row locked meanwhile
        ender.execute(
            sql.SQL("SELECT 1 FROM {}.shard_lease WHERE shard = 0 FOR UPDATE").format(
                sql.Identifier(schema)
            )
        )
        renewing = threading.Thread(target=a.heartbeat, args=(a_conn,))
        renewing.start()
        time.sleep(0.3)  # A's renewal now waits for the ender
        b_conn.execute("SET lock_timeout = '3s'")
        b_conn.commit()
        b = LeaseManager(schema, "relay-b", 4, LEASE)
        b.heartbeat(b_conn)  # was: LockNotAvailable after 3 s, waiting for A
        ender.rollback()
        renewing.join(10)
        assert not renewing.is_alive()
