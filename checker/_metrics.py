"""Prometheus metrics of the checker (the default registry, served at /metrics by the sidecar).

Label values are bounded: ``producer_group`` is a configured group, or ``other`` for groups seen
in rows without an endpoint (writers choose group names; the metrics must not grow with them).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OTHER_GROUP = "other"

CHECKS = Counter(
    "outbox_checker_checks",
    "Checks of prepared transactions, by producer group and outcome (commit, rollback, unknown, "
    "or why no answer was usable: timeout, connect_error, http_error, redirect, ...).",
    ["producer_group", "outcome"],
)
NOT_SENT = Counter(
    "outbox_checker_checks_not_sent",
    "Due transactions not asked about this time (circuit_open, deferred, no_endpoint); "
    "rescheduled without counting a check.",
    ["producer_group", "why"],
)
LOST = Counter(
    "outbox_checker_checks_lost",
    "Checks whose lease ran out with no outcome recorded (a checker killed, or cut from the "
    "database, mid-check): given back, not counted, and asked again. Not those whose answer "
    "this checker dropped because their application held the rows and then did not end them.",
    ["producer_group"],
)
DISCARD_LIMITS = ("max_checks", "max_age")  # the `limit` label's values
DISCARDS = Counter(
    "outbox_checker_discards",
    "Transactions discarded (handed to the relay for the dead-letter topic), by limit reached.",
    ["producer_group", "limit"],
)
CONFLICTS = Counter(
    "outbox_checker_conflicting_answers",
    "COMMIT or ROLLBACK answers that came after the transaction had ended otherwise "
    "(nothing changed).",
    ["producer_group"],
)
NOT_APPLIED = Counter(
    "outbox_checker_answers_not_applied",
    "COMMIT or ROLLBACK answers not applied: locked (the application was ending the transaction "
    "itself; due again after the lease) or invalid (the library refused the rows).",
    ["producer_group", "why"],
)
LATENCY = Histogram(
    "outbox_checker_endpoint_latency_seconds",
    "Duration of check requests that got an HTTP answer, by producer group.",
    ["producer_group"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CIRCUIT_STATE = Gauge(
    "outbox_checker_circuit_state",
    "Circuit breaker of each endpoint: 0 closed, 1 half-open, 2 open.",
    ["producer_group"],
)
PREPARED = Gauge(
    "outbox_checker_prepared_records",
    "Prepared records older than the given age (older_than=0s: all of them); refreshed at most "
    "every metrics_interval.",
    ["older_than"],
)
OLDEST_PREPARED = Gauge(
    "outbox_checker_oldest_prepared_age_seconds",
    "Age of the oldest prepared record; 0 when none.",
)
ROUNDS = Counter("outbox_checker_rounds", "Check rounds, by result (ok, error).", ["result"])

# (label, column of checker_prepared_ages)
AGE_BUCKETS = (
    ("0s", "total"),
    ("1m", "over_1m"),
    ("10m", "over_10m"),
    ("1h", "over_1h"),
    ("6h", "over_6h"),
    ("24h", "over_24h"),
    ("72h", "over_72h"),
)
