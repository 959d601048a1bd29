"""The soak's database: made fresh for a run, read back at its end."""

from __future__ import annotations

import psycopg
from psycopg import sql

import outbox
from scripts.soak.checks import LedgerRow
from scripts.soak.settings import KEYS, Settings

SCHEMA = """
CREATE TABLE soak_seq (k text PRIMARY KEY, seq int NOT NULL DEFAULT 0);
CREATE TABLE soak_ledger (
    uid text PRIMARY KEY,
    tx_uid text NOT NULL,
    k text NOT NULL,
    seq int NOT NULL,
    topic text NOT NULL,
    outbox_id bigint NOT NULL,
    writer text NOT NULL,
    xid xid8 NOT NULL DEFAULT pg_current_xact_id()
);
CREATE TABLE soak_business (id bigserial PRIMARY KEY, tx_uid text NOT NULL);
"""


def create(settings: Settings) -> None:
    """Drop the soak database of an earlier run, make it anew and migrate it."""
    name = sql.Identifier(settings.database)
    with psycopg.connect(settings.admin_dsn, autocommit=True, connect_timeout=10) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(name))
    outbox.migrate(settings.dsn)
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO soak_seq (k) SELECT unnest(%s::text[])", (list(KEYS),))


def outbox_states(settings: Settings) -> dict[str, int]:
    """Rows of the outbox by state (delivered ones are deleted: none is drained)."""
    with psycopg.connect(settings.dsn, connect_timeout=3) as conn:
        conn.execute("SET statement_timeout = '10s'")
        rows = conn.execute(
            "SELECT state::text, count(*) FROM outbox.outbox_record GROUP BY state"
        ).fetchall()
    return {state: count for state, count in rows}


def ledger(settings: Settings) -> list[LedgerRow]:
    """Every record that committed, as the writers' own table says."""
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute(
            "SELECT uid, tx_uid, k, seq, topic, outbox_id, xid::text::bigint FROM soak_ledger"
        ).fetchall()
    return [LedgerRow(*row) for row in rows]
