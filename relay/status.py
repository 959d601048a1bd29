"""What `outboxctl status` shows: records by state, the oldest undelivered one, relays, leases."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql


def outbox_status(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    s = sql.Identifier(schema)
    states = dict(
        conn.execute(
            sql.SQL(
                "SELECT state, count(*) FROM {}.outbox_record GROUP BY state ORDER BY state"
            ).format(s)
        ).fetchall()
    )
    # The commit time of a row not stamped yet is looked up, where Postgres keeps them (the
    # relay needs it to): its state_changed_at is when its transaction began.
    # Its age by the database's clock, which the relays' leases and the commit times run on
    # (an operator's host may be off).
    oldest = conn.execute(
        sql.SQL(
            "SELECT o, extract(epoch FROM now() - o)::float8 FROM (SELECT min(coalesce(commit_ts,"
            " CASE WHEN current_setting('track_commit_timestamp')::bool"
            " THEN pg_xact_commit_timestamp(committed_xid::xid) END, state_changed_at)) AS o"
            " FROM {}.outbox_record WHERE state = 'committed') AS oldest"
        ).format(s)
    ).fetchone()
    relays = [
        r[0]
        for r in conn.execute(
            sql.SQL(
                "SELECT relay_id FROM {}.relay_member WHERE expires_at > now() ORDER BY relay_id"
            ).format(s)
        )
    ]
    # Where each shard's markers are recorded, and by which producer: what recovery reads
    # and fences (operators changing the marker topic or the transactional id prefix look
    # here). As JSON: a schema before 0007 has some of these columns only.
    leases = [
        {
            "shard": r[0],
            "owner": r[1],
            "epoch": r[2],
            "lease_until": r[3],
            # by the database's clock: a lease not renewed is its owner's no more (a relay
            # killed, or stuck); the shard waits for another relay to take it. None: never
            # held, or handed back (no lease_until)
            "expired": r[5],
            "marker_topic": r[4].get("marker_topic"),
            "marker_partition": r[4].get("marker_partition"),
            "marker_offset": r[4].get("marker_offset"),
            "transactional_id": r[4].get("transactional_id"),
        }
        for r in conn.execute(
            sql.SQL(
                "SELECT shard, owner, epoch, lease_until, to_jsonb(lease), "
                "lease_until < now() "
                "FROM {}.shard_lease AS lease ORDER BY shard"
            ).format(s)
        )
    ]
    return {
        "states": states,
        "oldest_undelivered": oldest[0] if oldest else None,
        "oldest_undelivered_age_s": oldest[1] if oldest else None,
        "relays": relays,
        "leases": leases,
    }
