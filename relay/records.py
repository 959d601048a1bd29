"""What `outboxctl records` lists: outbox records by state, producer group, tx id or topic."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import psycopg

from outbox import sql as queries
from outbox._core import State
from outbox.migrations import SHIPPING_CLAIM_VERSION, current_version


def shown(text: str) -> str:
    """Text as it is when printable, else with its control characters escaped (``\\n``,
    ``\\x1b``): a tx id or a reason, stored by any writer, could fake rows of a listing as a
    key could."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


@dataclass(frozen=True)
class RecordRow:
    id: int
    producer_group: str
    tx_id: str
    state: str
    topic: str
    key: bytes | None
    partition: int | None
    value_bytes: int | None
    created_at: datetime
    state_changed_at: datetime
    check_count: int
    next_check_at: datetime | None
    ended_at: datetime | None
    kafka_partition: int | None
    kafka_offset: int | None
    reason: str | None
    # a discarded record the relay has taken to ship to the dead-letter topic: since when
    # (re-arm and resolve refuse it meanwhile); None on a schema without the mark
    shipping_since: datetime | None = None

    def key_text(self) -> str:
        """The key as text when it is printable UTF-8, else base64 (marked so): a newline or a
        terminal escape in a key printed as it is could fake rows of the listing."""
        if self.key is None:
            return "-"
        try:
            text = self.key.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and text.isprintable() and not text.startswith("base64:"):
            return text
        return "base64:" + base64.b64encode(self.key).decode("ascii")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["key"] = None if self.key is None else base64.b64encode(self.key).decode("ascii")
        return out


def check_filters(state: str | None, limit: int) -> None:
    """ValueError naming what is wrong with a listing's state or limit: checked before any
    connection, so that a bad option is told as one with the database away too."""
    if state is not None and state not in {s.value for s in State}:
        raise ValueError(f"state must be one of {', '.join(s.value for s in State)}, not {state!r}")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")


def list_records(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    state: str | None = None,
    producer_group: str | None = None,
    tx_id: str | None = None,
    topic: str | None = None,
    limit: int = 100,
) -> list[RecordRow]:
    """Records matching every filter given, oldest first, at most `limit`."""
    check_filters(state, limit)
    rows = conn.execute(
        queries.query("cli_records", schema),
        {
            "state": state,
            "producer_group": producer_group,
            "tx_id": tx_id,
            "topic": topic,
            "limit": limit,
        },
    ).fetchall()
    found = [RecordRow(*r) for r in rows]
    return _with_shipping_marks(conn, schema, found)


def _with_shipping_marks(
    conn: psycopg.Connection[Any], schema: str, found: list[RecordRow]
) -> list[RecordRow]:
    """The discarded records among `found` the relay has taken to ship, with since when: the
    commands that refuse them say so, and the listing did not show why. Asked apart
    (shipping_taken), so that a schema older than SHIPPING_CLAIM_VERSION is listed as before."""
    discarded = [r.id for r in found if r.state == State.DISCARDED and r.ended_at is None]
    if not discarded or (current_version(conn, schema) or 0) < SHIPPING_CLAIM_VERSION:
        return found
    taken = dict(
        conn.execute(queries.query("shipping_taken", schema), {"ids": discarded}).fetchall()
    )
    return [replace(r, shipping_since=taken.get(r.id)) for r in found]
