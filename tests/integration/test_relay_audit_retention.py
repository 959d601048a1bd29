"""The relay trims audit_log entries past relay.audit_retention, on the real Postgres: oldest
first, in slices; 0 keeps them; a role that may not delete keeps them, says so once, and
delivers as before."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from relay.config import SidecarSettings
from tests.fixtures.kafka import consume_all
from tests.fixtures.postgres import GrantedRoles
from tests.fixtures.relay import as_role
from tests.integration.test_relay_delivery import values


def add_entries(dsn: str, *ages: str) -> None:
    """One audit_log entry per age (an interval), in this order of id."""
    with psycopg.connect(dsn) as conn:
        for age in ages:
            conn.execute(
                "INSERT INTO outbox.audit_log (at, actor, action, tx_id)"
                " VALUES (now() - %s::interval, 'test', 'resolve', %s)",
                (age, f"aged {age}"),
            )


def entries(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT tx_id FROM outbox.audit_log ORDER BY id")]


def test_a_round_trims_the_entries_past_the_retention_and_keeps_the_younger(
    pg_dsn: str, relay_factory: Any
) -> None:
    add_entries(pg_dsn, "3 days", "2 days", "1 hour", "0 seconds")
    relay = relay_factory(audit_retention="P1D")
    relay.run_once()  # tests run a heartbeat, and so a trim, every round
    assert entries(pg_dsn) == ["aged 1 hour", "aged 0 seconds"]


def test_the_trim_goes_in_slices_and_stops_at_the_first_young_entry(
    pg_dsn: str, relay_factory: Any
) -> None:
    add_entries(pg_dsn, *(["2 days"] * 5), "0 seconds", "0 seconds")
    relay = relay_factory(audit_retention="P1D")
    assert relay.trim_audit_log(limit=2, budget_s=0) == 2  # one slice, then the budget is spent
    # 2, then a slice with a young entry: the last (tests heartbeat at once: their default
    # budget, half a heartbeat, is one slice)
    assert relay.trim_audit_log(limit=2, budget_s=60) == 3
    assert relay.trim_audit_log(limit=2, budget_s=60) == 0
    assert entries(pg_dsn) == ["aged 0 seconds"] * 2
    # An old entry behind a young one (a transaction that wrote it long) waits for it to age:
    # the trim reads no further than the first young entry.
    add_entries(pg_dsn, "2 days")
    assert relay.trim_audit_log(limit=10, budget_s=60) == 0
    assert entries(pg_dsn) == ["aged 0 seconds"] * 2 + ["aged 2 days"]


def test_a_retention_of_zero_keeps_every_entry(pg_dsn: str, relay_factory: Any) -> None:
    add_entries(pg_dsn, "400 days", "0 seconds")
    relay = relay_factory(audit_retention="PT0S")
    relay.run_once()
    assert relay.trim_audit_log() == 0
    assert entries(pg_dsn) == ["aged 400 days", "aged 0 seconds"]


def test_a_negative_retention_is_refused_by_name(relay_settings: Any) -> None:
    with pytest.raises(ValueError, match="audit_retention"):
        relay_settings(audit_retention="-PT1S")


def test_a_role_that_may_not_delete_keeps_the_entries_says_so_once_and_delivers(
    pg_dsn: str,
    granted_roles: GrantedRoles,  # first: its roles outlive the relay, which is stopped before
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = topic_factory()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:  # as granted before the retention
        admin.execute(
            sql.SQL("REVOKE DELETE ON outbox.audit_log FROM {}").format(
                sql.Identifier(granted_roles.relay)
            )
        )
    add_entries(pg_dsn, "2 days")
    settings = relay_settings(audit_retention="P1D")
    relay = relay_factory(as_role(settings, granted_roles.dsn(granted_roles.relay)))
    caplog.set_level(logging.WARNING, logger="relay.service")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "delivered all the same")
    assert relay.run_once().delivered == 1
    assert relay.run_once().delivered == 0  # a second trim: not tried, not said again
    said = [
        r.getMessage() for r in caplog.records if "audit_log entries are kept" in r.getMessage()
    ]
    assert len(said) == 1
    assert "grant it DELETE on audit_log" in said[0]
    assert entries(pg_dsn) == ["aged 2 days"]
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [
        b"delivered all the same"
    ]
