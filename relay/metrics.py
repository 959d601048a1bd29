"""Prometheus metrics of the relay (the default registry, served at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DELIVERED = Counter(
    "outbox_relay_records_delivered", "Records delivered to their topic.", ["topic"]
)
ENDED = Counter(
    "outbox_relay_records_ended", "Op markers written, by what ended the record.", ["op"]
)
PARKED = Counter(
    "outbox_relay_records_parked", "Poison records parked, by kind of reason.", ["reason"]
)
BATCH_SIZE = Histogram(
    "outbox_relay_batch_records",
    "Records (and dead-letter copies) per Kafka transaction.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
COMMIT_SECONDS = Histogram(
    "outbox_relay_kafka_commit_seconds",
    "Latency of commit_transaction.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
DELIVERY_LAG = Histogram(
    "outbox_relay_delivery_lag_seconds",
    "From an outbox transaction's database commit (the database server's clock) to the Kafka "
    "commit that delivered it (the relay's clock); one observation per transaction.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
BACKLOG = Gauge("outbox_relay_backlog_records", "Committed records not delivered yet.")
OLDEST_AGE = Gauge(
    "outbox_relay_oldest_undelivered_seconds",
    "Age (since commit) of the oldest committed record not delivered yet; 0 when none.",
)
PARKED_NOW = Gauge(
    "outbox_relay_parked_records",
    "Records parked now, waiting for a redrive (outboxctl records --state parked).",
)
HORIZON_HELD = Gauge(
    "outbox_relay_horizon_held_seconds",
    "How long the oldest running transaction has held back the xid horizon.",
)
HORIZON_HOLDER_PID = Gauge(
    "outbox_relay_horizon_holder_pid",
    "Backend pid of that transaction; 0 when none, or when it is a prepared transaction.",
)
SHARDS_OWNED = Gauge("outbox_relay_shards_owned", "Shards this relay holds a lease on.")
SHARDS = Gauge(
    "outbox_relay_shards",
    "Shards the outbox's records are split into (relay.shards): the relays' owned sum to it.",
)
STAMP_LOCK_WAITS = Counter(
    "outbox_relay_stamp_lock_waits",
    "Stamps made again after waiting too long for a row lock (another relay's end).",
)
ERRORS = Counter("outbox_relay_errors", "Errors by kind.", ["kind"])
RECOVERIES = Counter("outbox_relay_recoveries", "Recoveries from the op-marker topic.")
LEASE_CHANGES = Counter(
    "outbox_relay_lease_changes",
    "Shard leases this relay took, lost (taken over by another relay: this one stalled longer "
    "than relay.lease_duration) and handed back (a rebalance, a stop).",
    ["change"],
)
for _change in ("taken", "lost", "handed_back"):  # at 0 from the start: a first loss is an increase
    LEASE_CHANGES.labels(_change)
DEAD_LETTER_COPIES = Counter(
    "outbox_relay_dead_letter_copies",
    "Dead-letter copies of discarded and parked records, once their Kafka transaction "
    "committed, by form: full; without_value or bare (the full copy was refused, by the Kafka "
    "client or the broker: header outbox-value-omitted); none (not even the bare copy fit: the "
    "op marker went alone). A discarded record's row is deleted (kept only with an archive): "
    "past `full`, its value is lost.",
    ["form"],
)
DEAD_LETTER_FORMS = ("full", "without_value", "bare", "none")
for _form in DEAD_LETTER_FORMS:  # at 0 from the start: a first shrunk copy is an increase
    DEAD_LETTER_COPIES.labels(_form)
PART_STOPPED = Gauge(
    "outbox_sidecar_part_stopped",
    "1 while a part of the sidecar (relay, checker) stopped on something that cannot work waits "
    "to be started again (on_part_stopped = retry): it delivers or checks nothing meanwhile.",
    ["part"],
)
