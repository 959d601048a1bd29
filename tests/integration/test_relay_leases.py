"""Lease heartbeats of several relays against the real Postgres."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql

import outbox
from relay.leases import LeaseManager
from relay.service import Relay

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
        a_pid = a_conn.info.backend_pid
        renewing = threading.Thread(target=a.heartbeat, args=(a_conn,))
        renewing.start()
        with psycopg.connect(pg_dsn, autocommit=True) as admin:  # A's renewal waits for it
            waiting = "SELECT count(*) > 0 FROM pg_locks WHERE pid = %s AND NOT granted"
            deadline = time.monotonic() + 10
            while admin.execute(waiting, (a_pid,)).fetchone() != (True,):
                assert time.monotonic() < deadline, "A's renewal never waited for the ender"
                time.sleep(0.02)
        b_conn.execute("SET lock_timeout = '3s'")
        b_conn.commit()
        b = LeaseManager(schema, "relay-b", 4, LEASE)
        b.heartbeat(b_conn)  # was: LockNotAvailable after 3 s, waiting for A
        ender.rollback()
        renewing.join(10)
        assert not renewing.is_alive()


def test_a_renewal_waits_for_its_own_batch_end_past_a_roles_timeouts(
    pg_dsn: str, schema: str
) -> None:
    """A role's (or database's) lock_timeout and statement_timeout cancelled a renewal that
    waited for the relay's own batch end, and the whole round failed, every shard recovering."""
    with psycopg.connect(pg_dsn) as a_conn, psycopg.connect(pg_dsn) as ender:
        a = LeaseManager(schema, "relay-a", 1, LEASE)
        a.heartbeat(a_conn)
        a_conn.execute("SET lock_timeout = '300ms'")
        a_conn.execute("SET statement_timeout = '300ms'")
        a_conn.commit()
        ender.execute(  # the relay's ender, ending a batch of shard 0
            sql.SQL("SELECT 1 FROM {}.shard_lease WHERE shard = 0 FOR UPDATE").format(
                sql.Identifier(schema)
            )
        )
        failed: list[BaseException] = []

        def heartbeat() -> None:
            try:
                a.heartbeat(a_conn)
            except BaseException as exc:
                failed.append(exc)

        renewing = threading.Thread(target=heartbeat)
        renewing.start()
        renewing.join(1.5)  # the end takes its time; the renewal was cancelled at 0.3 s
        ender.rollback()
        renewing.join(10)
    assert failed == []
    assert list(a.owned) == [0]


def test_a_shard_lost_and_taken_again_in_one_heartbeat_is_renewed_after(
    pg_dsn: str, relay_factory: Callable[..., Relay]
) -> None:
    """Paused past its lease, a relay's shard went to another relay, which stopped (a rolling
    deploy) before the first one's next heartbeat: that heartbeat found the shard lost and took
    it again, and then forgot the new lease along with the old worker. Its new worker delivered
    with a lease no heartbeat renewed, lost it again at its end, and so on."""
    relay = relay_factory(shards=1)
    relay.run_once()
    schema = sql.Identifier(relay.schema)
    first = relay.leases.owned[0].epoch
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for table, column in (("shard_lease", "lease_until"), ("relay_member", "expires_at")):
            conn.execute(
                sql.SQL("UPDATE {}.{} SET {} = now() - interval '1 second'").format(
                    schema, sql.Identifier(table), sql.Identifier(column)
                )
            )
        other = LeaseManager(relay.schema, "relay-other", 1, LEASE)
        assert [lease.shard for lease in other.heartbeat(conn).gained] == [0]
        other.leave(conn)

    relay.heartbeat()
    taken = relay.leases.owned.get(0)
    assert taken is not None, "the lease taken again was forgotten"
    assert taken.epoch == first + 2
    assert relay.workers[0].lease.epoch == taken.epoch
    relay.heartbeat()  # renews it
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT owner, epoch, lease_until > now() + interval '5 seconds'"
                " FROM {}.shard_lease"
            ).format(schema)
        ).fetchone()
    assert row == (relay.relay_id, taken.epoch, True)


def test_three_relays_share_four_shards_two_one_one(pg_dsn: str, schema: str) -> None:
    """Each took up to ceil(4 / 3) = 2, and the third relay got none: 2, 2, 0."""
    with (
        psycopg.connect(pg_dsn) as a_conn,
        psycopg.connect(pg_dsn) as b_conn,
        psycopg.connect(pg_dsn) as c_conn,
    ):
        relays = [
            (LeaseManager(schema, f"relay-{name}", 4, LEASE), conn)
            for name, conn in (("a", a_conn), ("b", b_conn), ("c", c_conn))
        ]
        for _ in range(3):  # each relay heartbeats in turn, handing back what is over its share
            for leases, conn in relays:
                for shard in leases.heartbeat(conn).to_release:
                    leases.release(conn, shard)
        assert [len(leases.owned) for leases, _ in relays] == [2, 1, 1]
        owned = [shard for leases, _ in relays for shard in leases.owned]
        assert sorted(owned) == [0, 1, 2, 3]


def test_lease_changes_are_counted_once_each(pg_dsn: str, schema: str) -> None:
    """outbox_relay_lease_changes_total: a relay's leases taken, lost (found by a heartbeat, by
    a fenced batch: forget, or by a hand-back that finds it taken over) and handed back, each
    once; a heartbeat that changes nothing counts nothing."""

    def counts() -> dict[str, float]:
        return {
            change: REGISTRY.get_sample_value(
                "outbox_relay_lease_changes_total", {"change": change}
            )
            or 0.0
            for change in ("taken", "lost", "handed_back")
        }

    before = counts()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        a = LeaseManager(schema, "relay-a", 2, LEASE)
        assert len(a.heartbeat(conn).gained) == 2
        a.heartbeat(conn)  # renews: no change
        for table, column in (("shard_lease", "lease_until"), ("relay_member", "expires_at")):
            conn.execute(
                sql.SQL("UPDATE {}.{} SET {} = now() - interval '1 second'").format(
                    sql.Identifier(schema), sql.Identifier(table), sql.Identifier(column)
                )
            )
        b = LeaseManager(schema, "relay-b", 2, LEASE)
        assert len(b.heartbeat(conn).gained) == 2
        assert a.heartbeat(conn).lost == [0, 1]
        a.forget(0)  # what the heartbeat found lost is gone already: not counted again
        (over,) = b.heartbeat(conn).to_release  # a is back: one each
        b.release(conn, over)
        (kept,) = b.owned
        b.forget(kept)  # its batch fenced
        b.forget(kept)  # forgotten already
        assert [lease.shard for lease in a.heartbeat(conn).gained] == [over]
        conn.execute(  # taken over before a's stop hands it back
            sql.SQL(
                "UPDATE {}.shard_lease SET owner = 'relay-c', epoch = epoch + 1 WHERE shard = %s"
            ).format(sql.Identifier(schema)),
            (over,),
        )
        a.leave(conn)
    after = counts()
    assert {change: after[change] - before[change] for change in after} == {
        "taken": 5,
        "lost": 4,
        "handed_back": 1,
    }
