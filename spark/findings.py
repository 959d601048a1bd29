"""Read what the reconciliation job found, with plain psycopg (no Spark needed).

from spark.findings import read_findings, read_windows

for f in read_findings(dsn, "outbox", kinds=["missing", "duplicate"], limit=20):
    print(f.kind, f.topic, f.outbox_id, f.detail)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row

from outbox._core import OutboxConfig
from spark import _sql
from spark.config import FINDING_KINDS
from spark.sink import connect, schema_needed


@dataclass(frozen=True)
class Finding:
    """One row of `reconciliation_finding` (see outbox/sql/migrations/0002_reconciliation.sql)."""

    id: int
    kind: str
    topic: str
    outbox_id: int
    occurrence: str
    producer_group: str | None
    tx_id: str | None
    kafka_partition: int | None
    kafka_offset: int | None
    event_time: datetime
    detail: dict[str, Any]
    detected_at: datetime
    detected_in: str
    last_seen_at: datetime  # by a judgement (hourly at most): the retention counts from it

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (times as ISO 8601 text)."""
        out = dict(self.__dict__)
        for name in ("event_time", "detected_at", "last_seen_at"):
            out[name] = out[name].isoformat()
        return out


@dataclass(frozen=True)
class WindowSummary:
    """One summary window: deliveries, latency, and the findings whose event time is inside."""

    window_start: datetime
    window_end: datetime
    records: int
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None
    updated_at: datetime
    findings: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for name in ("window_start", "window_end", "updated_at"):
            out[name] = out[name].isoformat()
        return out


def check_options(kinds: Iterable[str] | None, limit: int) -> list[str] | None:
    """The kinds asked for (None: all), or ValueError naming what is wrong with them or the
    limit: checked before any connection."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if kinds is None:
        return None
    chosen = list(kinds)
    unknown = sorted(set(chosen) - set(FINDING_KINDS))
    if unknown:
        raise ValueError(f"unknown finding kinds {unknown}; known: {', '.join(FINDING_KINDS)}")
    return chosen


def read_findings(
    dsn: str,
    schema: str = "outbox",
    kinds: Iterable[str] | None = None,
    limit: int = 100,
    since: datetime | None = None,
) -> list[Finding]:
    """The newest findings first (by detection time), optionally of some kinds only."""
    chosen = check_options(kinds, limit)
    schema = OutboxConfig(schema_name=schema).schema_name
    params = {"kinds": chosen, "since": since, "limit": limit}
    with connect(dsn, write=False) as conn, schema_needed(schema):
        cur = conn.cursor(row_factory=dict_row)
        rows = cur.execute(_sql.query("read_findings", schema), params).fetchall()
    return [Finding(**row) for row in rows]


def read_windows(
    dsn: str, schema: str = "outbox", limit: int = 60, since: datetime | None = None
) -> list[WindowSummary]:
    """The newest summary windows first, with their findings counted by kind."""
    schema = OutboxConfig(schema_name=schema).schema_name
    with connect(dsn, write=False) as conn, schema_needed(schema):
        cur = conn.cursor(row_factory=dict_row)
        rows = cur.execute(
            _sql.query("read_windows", schema), {"limit": limit, "since": since}
        ).fetchall()
    return [
        WindowSummary(
            **{k: v for k, v in row.items() if k not in FINDING_KINDS},
            findings={k: row[k] for k in FINDING_KINDS},
        )
        for row in rows
    ]
