"""The SQL side of the checker: find due transactions, claim, discard, reschedule.

All statements are named queries (``outbox/sql/queries.sql``, ``checker_*``); these functions
only bind parameters and shape rows. The claim transaction is short: lock due transactions
(``FOR UPDATE SKIP LOCKED``), then discard, reschedule or claim each, then commit, all before
any request goes out.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from outbox import sql as queries
from outbox.checkback import CheckRecord, CheckRequest

Conn = psycopg.Connection[Any]


@dataclass(frozen=True, slots=True)
class DueTransaction:
    """A transaction whose every record is prepared and due, locked by the claim transaction."""

    producer_group: str
    tx_id: str
    check_count: int
    first_created_at: datetime
    locked: int  # prepared records locked by this claim transaction
    prepared: int  # prepared records of the transaction
    records: int  # all its records
    age_from: datetime  # its maximum prepared age counts from here: created, or re-armed
    #: Its last check was claimed (and counted), and the lease ran out with no outcome recorded:
    #: a checker killed or cut from the database mid-check. That check is given back.
    check_lost: bool = False

    @property
    def checks_made(self) -> int:
        """Checks counted against ``max_checks``: a lost check is not one."""
        return max(self.check_count - 1, 0) if self.check_lost else self.check_count

    @property
    def held_elsewhere(self) -> bool:
        """Another process holds some of its records right now: leave it for this round."""
        return self.locked < self.prepared

    @property
    def mixed(self) -> bool:
        """Some of its records are not prepared: never checked (the state machine has no
        answer for it); only discarded at max age, its prepared records only."""
        return self.prepared < self.records


@dataclass(frozen=True, slots=True)
class Claim:
    """A check counted and leased: ask the endpoint, then apply the answer."""

    producer_group: str
    tx_id: str
    check_count: int  # including this check
    first_created_at: datetime
    claimed_at: datetime
    lease_until: datetime
    #: A request not started by then is not sent (it could outlive the lease): given back.
    send_by: datetime
    #: Its maximum prepared age: it is due again by then at the latest, to be discarded.
    discard_at: datetime
    record_count: int = 0  # all the transaction's records: `records` holds the first ones
    records: tuple[CheckRecord, ...] = field(default=())

    #: The transaction's first and last record ids, as claimed: its answer ends no other.
    record_ids: tuple[int, int] | None = None

    def request(self, max_bytes: int) -> CheckRequest:
        """The check request, its body under ``max_bytes``: the records that do not fit are
        left out (``record_count`` tells). Sent whole, a transaction with large keys or headers
        was refused by the endpoint's body limit at every check, and discarded at max checks
        however the application would have answered."""
        request = CheckRequest(
            producer_group=self.producer_group,
            tx_id=self.tx_id,
            check_count=self.check_count,
            first_prepared_at=self.first_created_at,
            records=[],
            record_count=self.record_count,
        )
        # bytes as sent (UTF-8), not characters: a header of 1000 "€" is 3000 bytes
        room = max_bytes - len(request.model_dump_json().encode())
        kept: list[CheckRecord] = []
        for record in self.records:
            room -= len(record.model_dump_json().encode()) + 1  # and a comma
            if room < 0:
                break
            kept.append(record)
        return request.model_copy(update={"records": kept})


@dataclass(frozen=True, slots=True)
class Reschedule:
    """Set the next check of a transaction if its check count is still ``expected_count`` and,
    for the outcome of a claimed check, its lease is still that claim's (a check given back after
    a lost lease is claimed again with the same count)."""

    producer_group: str
    tx_id: str
    expected_count: int
    new_count: int
    next_check_at: datetime
    expected_lease: datetime | None = None  # None: under the claim transaction's own locks
    #: A claimed check's transaction's first record time: its tx id may be used again later.
    first_created_at: datetime | None = None


def lock_due(
    conn: Conn,
    schema: str,
    *,
    now: datetime,
    limit: int,
    default_immunity: timedelta,
    max_age: timedelta,
) -> tuple[list[DueTransaction], bool]:
    """Due transactions, oldest due first, locked until the caller's transaction ends: after
    their check immunity, or their maximum prepared age if that comes first; and whether the
    scan came full (more may be due, however few transactions it found: it reads `limit`
    records, and a transaction may have many).

    Check ``held_elsewhere`` and ``mixed`` before claiming one."""
    rows = conn.execute(
        queries.query("checker_lock_due", schema),
        {
            "now": now,
            "limit": limit,
            "default_immunity_s": default_immunity.total_seconds(),
            "max_age_s": max_age.total_seconds(),
        },
    ).fetchall()
    due = [
        DueTransaction(
            # in UTC: psycopg gives the session's zone, where adding a timedelta counts wall
            # time (72 hours from before a spring DST change ended an hour early)
            r[0],
            r[1],
            int(r[2]),
            r[3].astimezone(UTC),
            int(r[4]),
            int(r[5]),
            int(r[6]),
            r[7].astimezone(UTC),
            bool(r[9]),
        )
        for r in rows
    ]
    return due, bool(rows) and bool(rows[0][8])


def claim(
    conn: Conn, schema: str, claims: Sequence[Claim], *, now: datetime, max_records: int
) -> list[Claim]:
    """Count and lease the checks; return them with their records' summaries."""
    if not claims:
        return []
    rows = conn.execute(
        queries.query("checker_claim", schema),
        {
            "now": now,
            "producer_groups": [c.producer_group for c in claims],
            "tx_ids": [c.tx_id for c in claims],
            "check_counts": [c.check_count for c in claims],
            "lease_until": [c.lease_until for c in claims],
            "max_records": max_records,
        },
    ).fetchall()
    records: dict[tuple[str, str], list[CheckRecord]] = {}
    last: dict[tuple[str, str], int] = {}
    for group, tx_id, record_id, topic, key, headers, last_id in rows:
        records.setdefault((group, tx_id), []).append(
            CheckRecord(id=record_id, topic=topic, key=key, headers=wire_headers(headers))
        )
        last[(group, tx_id)] = last_id
    claimed = []
    for c in claims:
        key = (c.producer_group, c.tx_id)
        found = records.get(key)
        if found:  # under our locks it always is; skip rather than ask about nothing
            claimed.append(replace(c, records=tuple(found), record_ids=(found[0].id, last[key])))
    return claimed


def lock_answered(conn: Conn, schema: str, txs: Sequence[tuple[str, str]]) -> None:
    """Lock the prepared rows of these (group, tx id) at once, or raise LockNotAvailable: some
    are held."""
    if txs:
        conn.execute(
            queries.query("checker_lock_answered", schema),
            {"producer_groups": [g for g, _ in txs], "tx_ids": [t for _, t in txs]},
        )


def reschedule(conn: Conn, schema: str, items: Sequence[Reschedule]) -> set[tuple[str, str]]:
    """Compare-and-set the next check; returns the (group, tx id) of those it applied to."""
    if not items:
        return set()
    rows = conn.execute(
        queries.query("checker_reschedule", schema),
        {
            "producer_groups": [i.producer_group for i in items],
            "tx_ids": [i.tx_id for i in items],
            "expected_counts": [i.expected_count for i in items],
            "new_counts": [i.new_count for i in items],
            "next_check_at": [i.next_check_at for i in items],
            "expected_leases": [i.expected_lease for i in items],
        },
    ).fetchall()
    return {(group, tx_id) for group, tx_id in rows}


def discard(
    conn: Conn, schema: str, items: Sequence[tuple[str, str, str]], *, actor: str
) -> list[tuple[str, str]]:
    """prepared -> discarded with a reason, audited; ``items`` are (group, tx id, reason)."""
    if not items:
        return []
    rows = conn.execute(
        queries.query("checker_discard", schema),
        {
            "producer_groups": [i[0] for i in items],
            "tx_ids": [i[1] for i in items],
            "reasons": [i[2] for i in items],
            "actor": actor,
        },
    ).fetchall()
    return [(r[0], r[1]) for r in rows]


def wake_relay(conn: Conn, schema: str, channel: str) -> None:
    conn.execute(queries.query("checker_wake_relay", schema), {"channel": channel})


def wire_headers(stored: object) -> dict[str, str]:
    """The stored headers (``[[name, base64 value or null], ...]``) as the wire's name -> text.

    The wire format has one text value per name: the first occurrence of a name wins, values are
    decoded as UTF-8 (undecodable bytes replaced), a null value becomes "".
    """
    headers: dict[str, str] = {}
    if not isinstance(stored, list):
        return headers
    for item in stored:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            continue
        name, value = item
        if name in headers:
            continue
        text = ""
        if isinstance(value, str):
            try:
                text = base64.b64decode(value, validate=True).decode("utf-8", errors="replace")
            except binascii.Error:
                text = value
        headers[name] = text
    return headers
