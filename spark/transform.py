"""The reconciliation as pure DataFrame transformations: Kafka and ledger rows in, findings out.

No I/O and no clock here: `spark/job.py` reads Kafka, the observation store and the ledger, and
passes the time window; these functions only combine DataFrames, so a test runs them on a few
in-memory rows. Only Spark's built-in functions are used (no Python UDFs): executors need no
Python code of ours.

Three views of each outbox record (by its id):
  ledger   `outbox_record`: state, commit time, where the relay says it delivered the record
  markers  the op-marker topic: the relay's `delivered` / `rolled_back` / ... marker
  copies   the delivered topics: each record carrying the `outbox-id` header

The *claimed position* of a record is where the ledger (a delivered row) or else its first
`delivered` marker says it landed; a copy at the claimed position, or the first copy when nothing
is claimed, is the record's *canonical* copy. First: the first to arrive (the job's micro-batch),
then by Kafka time. Findings, one of each kind per record at most
(duplicate and orphan: per extra copy), most specific first:
  orphan           a copy of a record that was never committed (ledger: prepared, rolled back or
                   discarded; or no ledger row but a rolled_back / discarded marker), of an id the
                   ledger does not know although its retention covers the copy's time, or a copy
                   on another topic than the ledger's
  duplicate        any other copy than the canonical one
  marker_mismatch  a canonical copy of a known record without a `delivered` marker
                   ('record_without_marker'); a `delivered` marker without a copy on its topic
                   when the ledger does not say committed/delivered ('marker_without_record')
  missing          a committed or delivered ledger row without a copy on its topic (this takes
                   the place of marker_without_record while the ledger keeps the row); one
                   still committed (waiting for the relay) only once it has waited long enough
                   (see missing_records)
  out_of_order     a canonical copy placed (offset) after a copy of the same topic, partition and
                   key whose record committed later (commit time, then the committing
                   transaction's xid, then id: the relay's order)
and per summary window of delivery time: the canonical copies and the latency from commit time
to Kafka timestamp, as a histogram (spark/latency.py merges the judgements' histograms of a window
and summarises it: p50, p95, p99, max).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from relay.markers import (
    OUTBOX_ID_HEADER,
    OUTBOX_NAME_HEADER,
    OUTBOX_PRODUCER_GROUP_HEADER,
    OUTBOX_TX_ID_HEADER,
    Op,
)
from spark.config import JudgeWindow, spark_interval
from spark.latency import LATENCY_DIGITS

RECORD = "record"
MARKER = "marker"

COMMITTED_STATES = ("committed", "delivered")
NEVER_COMMITTED_STATES = ("prepared", "rolled_back", "discarded")
NEVER_COMMITTED_OPS = (Op.ROLLED_BACK.value, Op.DISCARDED.value)
RECORD_WITHOUT_MARKER = "record_without_marker"
MARKER_WITHOUT_RECORD = "marker_without_record"

# What Spark's Kafka source gives with includeHeaders=true.
KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)

# One marker of an op-marker message (relay/markers.py). commit_ts is parsed after reading, so
# that a malformed time loses only itself, not the marker.
_MARKER_ENTRY_FIELDS = [
    StructField("op", StringType()),
    StructField("id", LongType()),
    StructField("tx_id", StringType()),
    StructField("producer_group", StringType()),
    StructField("topic", StringType()),
    StructField("key", StringType()),
    StructField("partition", IntegerType()),
    StructField("offset", LongType()),
    StructField("commit_ts", StringType()),
    StructField("reason", StringType()),
    StructField("xid", LongType()),
]
MARKER_ENTRY_SCHEMA = StructType(_MARKER_ENTRY_FIELDS)
# An op-marker message's JSON value: version 2 (an envelope with many entries) or version 1 (one
# entry, its fields at the top).
MARKER_VALUE_SCHEMA = StructType(
    [
        StructField("v", IntegerType()),
        StructField("shard", IntegerType()),
        StructField("relay", StringType()),
        StructField("epoch", LongType()),
        StructField("outbox", StringType()),  # "<database>/<schema>"; null: an older relay
        StructField("markers", ArrayType(MARKER_ENTRY_SCHEMA)),
        *_MARKER_ENTRY_FIELDS,
    ]
)

# One row per copy or marker read from Kafka: what the observation store keeps (no values).
# `target_*` is where the record is: the copy's own position, or where the marker says it landed.
OBSERVATION_SCHEMA = StructType(
    [
        StructField("source", StringType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("ts", TimestampType()),
        StructField("outbox_id", LongType()),
        StructField("tx_id", StringType()),
        StructField("producer_group", StringType()),
        StructField("key", BinaryType()),
        StructField("op", StringType()),
        StructField("target_topic", StringType()),
        StructField("target_partition", IntegerType()),
        StructField("target_offset", LongType()),
        StructField("commit_ts", TimestampType()),
        StructField("commit_xid", LongType()),  # a marker's xid (null: a copy, an older relay)
    ]
)

# The ledger columns a judgement reads (spark/queries.sql, ledger_window).
LEDGER_SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("producer_group", StringType()),
        StructField("tx_id", StringType()),
        StructField("topic", StringType()),
        StructField("key", BinaryType()),
        StructField("state", StringType()),
        StructField("commit_time", TimestampType()),
        StructField("ended_at", TimestampType()),
        StructField("kafka_partition", IntegerType()),
        StructField("kafka_offset", LongType()),
        StructField("commit_xid", LongType()),
    ]
)

# The sink's columns (reconciliation_finding), detail as JSON text.
FINDING_SCHEMA = StructType(
    [
        StructField("kind", StringType()),
        StructField("topic", StringType()),
        StructField("outbox_id", LongType()),
        StructField("occurrence", StringType()),
        StructField("producer_group", StringType()),
        StructField("tx_id", StringType()),
        StructField("kafka_partition", IntegerType()),
        StructField("kafka_offset", LongType()),
        StructField("event_time", TimestampType()),
        StructField("detail", StringType()),
    ]
)
FINDING_COLUMNS = tuple(f.name for f in FINDING_SCHEMA.fields)

LATENCY_SCHEMA = StructType(
    [
        StructField("window_start", TimestampType()),
        StructField("window_end", TimestampType()),
        StructField("bucket_ms", DoubleType()),  # latency.bucket(): LATENCY_DIGITS digits
        StructField("records", LongType()),
        StructField("max_ms", DoubleType()),
    ]
)


@dataclass(frozen=True)
class Judgement:
    findings: DataFrame  # FINDING_SCHEMA
    latency: DataFrame  # LATENCY_SCHEMA
    classified: DataFrame  # every copy with its verdict (persist it: two outputs read it)


def _header(name: str) -> Column:
    """The first value of a Kafka header as text (NULL when absent).

    By position, not F.filter: a lambda is interpreted row by row where this is generated
    code (a tenth of the observations' cost, three headers a copy). Position 0 (absent) reads
    index -1, which F.get answers with NULL."""
    position = F.array_position(F.col("headers")["key"], name)
    return F.get("headers", (position - 1).cast("int"))["value"].cast("string")


def watched(
    topic: Column, topics: tuple[str, ...], pattern: str | None, ignored: tuple[str, ...] = ()
) -> Column:
    """Whether `topic` is one the job reads: by name, or a whole match of the Java regex, as
    Kafka's subscribePattern matches (Spark's rlike is Java's regex too); not one `ignored`
    (its copies are dropped: its markers and ledger rows, judged, were all findings)."""
    if pattern is not None:
        read = topic.rlike(f"^(?:{pattern})$")
    else:
        read = topic.isin(list(topics)) if topics else F.lit(True)
    return read & ~topic.isin(list(ignored)) if ignored else read


def observations(
    kafka: DataFrame,
    *,
    marker_topic: str,
    ignored_topics: tuple[str, ...] = (),
    topics: tuple[str, ...] = (),
    topic_pattern: str | None = None,
    outbox: str | None = None,
    former_outboxes: tuple[str, ...] = (),
) -> DataFrame:
    """Kafka source rows (KAFKA_SCHEMA) as observations (OBSERVATION_SCHEMA), in one pass.

    Records of the op-marker topic are markers; records of other topics are copies when they carry
    an outbox id header. Anything else (records of other producers, malformed markers or markers
    without an op or a topic, records of `ignored_topics` such as the dead-letter topic, markers
    of records on topics the job does not read: `topics` / `topic_pattern`) is dropped. Kept,
    those markers made every record of another topic a marker without its record. So are
    the markers of another outbox than `outbox` ("<database>/<schema>", as their messages name
    it) on a marker topic shared by mistake, and the copies of another outbox on a topic both
    write (their OUTBOX_NAME_HEADER; a copy without one is judged): its ids are not this
    ledger's, and were judged orphans, records without markers or duplicates.
    `former_outboxes`: names `outbox` had before a rename of its database or schema, whose
    markers and copies are its own (judged foreign, the records archived before the rename
    were reported missing).
    """
    names = [F.lit(n) for n in (outbox, *former_outboxes)] if outbox is not None else []
    is_marker = F.col("topic") == F.lit(marker_topic)
    message = F.from_json(F.when(is_marker, F.col("value").cast("string")), MARKER_VALUE_SCHEMA)
    version = F.coalesce(message["v"], F.lit(1))
    foreign = F.lit(False)
    if outbox is not None:
        foreign = F.coalesce(~message["outbox"].isin(*names), F.lit(False))
    # One row per copy, and per marker of a message: a copy's row carries a null entry; a
    # message of a version not known here, or of another outbox, yields none (dropped, like a
    # malformed one).
    entries = (
        F.when(~is_marker, F.array(F.lit(None).cast(MARKER_ENTRY_SCHEMA)))
        .when(foreign, F.lit(None).cast(ArrayType(MARKER_ENTRY_SCHEMA)))
        .when(version == 2, message["markers"])
        .when(
            version == 1,
            F.array(F.struct(*[message[f.name].alias(f.name) for f in _MARKER_ENTRY_FIELDS])),
        )
    )
    # ignored topics' records dropped before the markers are parsed; never the marker topic's
    # (the settings refuse to ignore it)
    rows = kafka.where(~F.col("topic").isin(list(ignored_topics))) if ignored_topics else kafka
    rows = rows.select(
        "topic", "partition", "offset", "timestamp", "key", "headers",
        F.explode(entries).alias("marker"),
    )  # fmt: skip
    marker = F.col("marker")
    obs = rows.select(
        F.when(is_marker, F.lit(MARKER)).otherwise(F.lit(RECORD)).alias("source"),
        "topic",
        "partition",
        "offset",
        F.col("timestamp").alias("ts"),
        F.when(is_marker, marker["id"])
        .otherwise(_header(OUTBOX_ID_HEADER).try_cast("bigint"))
        .alias("outbox_id"),
        F.when(is_marker, marker["tx_id"]).otherwise(_header(OUTBOX_TX_ID_HEADER)).alias("tx_id"),
        F.when(is_marker, marker["producer_group"])
        .otherwise(_header(OUTBOX_PRODUCER_GROUP_HEADER))
        .alias("producer_group"),
        F.when(is_marker, F.try_to_binary(marker["key"], F.lit("base64")))
        .otherwise(F.col("key"))
        .alias("key"),
        F.when(is_marker, marker["op"]).alias("op"),
        F.when(is_marker, marker["topic"]).otherwise(F.col("topic")).alias("target_topic"),
        F.when(is_marker, marker["partition"])
        .otherwise(F.col("partition"))
        .alias("target_partition"),
        F.when(is_marker, marker["offset"]).otherwise(F.col("offset")).alias("target_offset"),
        F.when(is_marker, marker["commit_ts"].try_cast("timestamp")).alias("commit_ts"),
        F.when(is_marker, marker["xid"]).alias("commit_xid"),
        *([] if outbox is None else [_header(OUTBOX_NAME_HEADER).alias("outbox_name")]),
    )
    # a marker without an op or a topic is not a relay's (the sink would refuse its finding);
    # copies of topics not read here too: a source may read more than the pattern's whole match
    ours = F.lit(True)
    if outbox is not None:
        ours = F.coalesce(F.col("outbox_name").isin(*names), F.lit(True))
    complete = (
        (F.col("source") == RECORD)
        & watched(F.col("topic"), topics, topic_pattern, ignored_topics)
        & ours
    ) | (
        F.col("op").isNotNull()
        & F.col("target_topic").isNotNull()
        & watched(F.col("target_topic"), topics, topic_pattern, ignored_topics)
    )
    return obs.where(F.col("outbox_id").isNotNull() & complete).drop("outbox_name")


# On late observations (see judge): judged although their Kafka time is before the window.
LATE_JUDGED = "late_judged"
# ... and read for the first time: classified now (their summary windows may close before they
# are judged), not judged.
LATE_READ = "late_read"
# The store's micro-batch of an observation: the order in which they arrived.
BATCH = "batch"


def _carried(rows: DataFrame) -> list[str]:
    return [c for c in (LATE_JUDGED, LATE_READ, BATCH) if c in rows.columns]


def _flag(rows: DataFrame, name: str) -> Column:
    return F.coalesce(F.col(name), F.lit(False)) if name in rows.columns else F.lit(False)


def copies(obs: DataFrame) -> DataFrame:
    """The copies of records seen on the delivered topics."""
    return obs.where(F.col("source") == RECORD).select(
        "outbox_id", "topic", "partition", "offset", "ts", "key", "tx_id", "producer_group",
        *_carried(obs),
    )  # fmt: skip


def markers(obs: DataFrame) -> DataFrame:
    """The op markers, with the position they claim for their record."""
    return obs.where(F.col("source") == MARKER).select(
        *_carried(obs),
        "outbox_id",
        "op",
        F.col("ts").alias("m_ts"),
        F.col("target_topic").alias("m_topic"),
        F.col("target_partition").alias("m_partition"),
        F.col("target_offset").alias("m_offset"),
        "commit_ts",
        "commit_xid",
        F.col("tx_id").alias("m_tx_id"),
        F.col("producer_group").alias("m_producer_group"),
    )


def _position(topic: str, partition: str, offset: str) -> Column:
    return F.struct(
        F.col(topic).alias("topic"),
        F.col(partition).alias("partition"),
        F.col(offset).alias("offset"),
    )


def _arrived_late(rows: DataFrame) -> Column:
    """Ranked after the store batch (_arrival; all one in an audit), false before true: what
    an earlier judgement read (its verdicts stand) comes before a late observation read or
    judged now, whatever their Kafka times. A zombie's transaction that committed late, stamped
    long before, took the place of the copy judged canonical already: then neither was
    reported as the duplicate."""
    return _flag(rows, LATE_JUDGED) | _flag(rows, LATE_READ)


def late_now(late: DataFrame) -> DataFrame:
    """The late observations read or judged now: those a judgement classifies."""
    return late.where(_arrived_late(late))


def _arrival(rows: DataFrame) -> Column:
    """The store batch an observation came in (-1: read back from Kafka, older than the store;
    an audit's, all read at once), ranked first: what came first, whichever judgement ranks it.
    Kafka times do not tell: a zombie's late marker, read and judged a judgement before its
    copy, is stamped before the marker of the record's first delivery."""
    return F.coalesce(F.col(BATCH), F.lit(-1)) if BATCH in rows.columns else F.lit(-1)


def marker_facts(marker_rows: DataFrame) -> DataFrame:
    """Per outbox id: its delivered markers, the position the first claims, its commit time."""
    delivered = F.col("op") == Op.DELIVERED.value
    return marker_rows.groupBy("outbox_id").agg(
        F.count(F.when(delivered, 1)).alias("delivered_markers"),
        F.min_by(
            F.when(delivered, _position("m_topic", "m_partition", "m_offset")),
            F.when(
                delivered,
                F.struct(_arrival(marker_rows), _arrived_late(marker_rows), "m_ts", "m_offset"),
            ),
        ).alias("marker_position"),
        F.min(F.when(delivered, F.col("commit_ts"))).alias("marker_commit_ts"),
        F.min(F.when(delivered, F.col("commit_xid"))).alias("marker_commit_xid"),
        F.bool_or(F.col("op").isin(*NEVER_COMMITTED_OPS)).alias("never_committed_marker"),
        F.first("m_producer_group", ignorenulls=True).alias("marker_producer_group"),
        F.first("m_tx_id", ignorenulls=True).alias("marker_tx_id"),
    )


def _judged(col: str, window: JudgeWindow, rows: DataFrame) -> Column:
    """In the judged range of Kafka time, or a late observation judged now."""
    in_window = F.col(col).between(F.lit(window.lo), F.lit(window.hi))
    if LATE_JUDGED not in rows.columns:
        return in_window
    return in_window | F.coalesce(F.col(LATE_JUDGED), F.lit(False))


def classify_copies(
    copy_rows: DataFrame,
    ledger: DataFrame,
    facts: DataFrame,
    window: JudgeWindow,
    *,
    coverage_start: datetime | None,
) -> DataFrame:
    """Every copy with its canonical flag, its record's commit time and its finding, if any.

    `coverage_start`: copies at or after it whose id the ledger does not know are orphans (the
    ledger keeps every row since then); None when that cannot be known (no retention).
    """
    rows = ledger.select(
        F.col("id").alias("outbox_id"),
        "state",
        F.col("topic").alias("l_topic"),
        F.col("commit_time").alias("l_commit_time"),
        F.col("commit_xid").alias("l_commit_xid"),
        F.col("kafka_partition").alias("l_partition"),
        F.col("kafka_offset").alias("l_offset"),
        F.col("producer_group").alias("l_producer_group"),
        F.col("tx_id").alias("l_tx_id"),
    )
    c = copy_rows.join(rows, "outbox_id", "left").join(facts, "outbox_id", "left")

    known = F.col("state").isNotNull()
    delivered_markers = F.coalesce(F.col("delivered_markers"), F.lit(0))
    never_committed_marker = F.coalesce(F.col("never_committed_marker"), F.lit(False))
    ledger_position = F.when(
        (F.col("state") == "delivered") & F.col("l_offset").isNotNull(),
        _position("l_topic", "l_partition", "l_offset"),
    )
    claimed = F.coalesce(ledger_position, F.col("marker_position"))
    # the same partitioning and order (frames may differ): Spark computes both in one pass
    by_id = Window.partitionBy("outbox_id").orderBy(
        _arrival(copy_rows), _arrived_late(copy_rows), "ts", "partition", "offset"
    )
    all_of_id = by_id.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    first_copy = F.row_number().over(by_id) == 1
    canonical = F.when(
        claimed.isNotNull(), claimed == _position("topic", "partition", "offset")
    ).otherwise(first_copy)

    # A discarded transaction resolved by hand as the relay shipped its discard has both
    # markers: it was delivered after all, and its copy is no orphan (README, the repair
    # commands)
    never_committed = F.col("state").isin(*NEVER_COMMITTED_STATES) | (
        ~known & never_committed_marker & (delivered_markers == 0)
    )
    unknown = ~known & (delivered_markers == 0) & ~never_committed_marker
    covered = F.col("ts") >= F.lit(coverage_start) if coverage_start is not None else F.lit(False)
    orphan_reason = (
        F.when(
            never_committed,
            F.when(known, F.concat(F.lit("ledger_"), F.col("state"))).otherwise(
                F.lit("never_committed_marker")
            ),
        )
        .when(unknown & covered, F.lit("unknown_to_ledger"))
        .when(known & (F.col("l_topic") != F.col("topic")), F.lit("wrong_topic"))
    )
    kind = (
        F.when(orphan_reason.isNotNull(), F.lit("orphan"))
        .when(~F.col("canonical"), F.lit("duplicate"))
        # Known to the ledger or not: the relay writes a copy's marker in its Kafka
        # transaction, after its report, so the marker is in the copy's context. Asked of known
        # ids only, a copy whose row was deleted at once (delivered_retention 0, the default)
        # was never checked for its marker.
        .when(delivered_markers == 0, F.lit("marker_mismatch"))
    )
    occurrence = F.when(F.col("kind") == "marker_mismatch", F.lit(RECORD_WITHOUT_MARKER)).when(
        F.col("kind").isNotNull(),
        F.concat_ws(":", F.col("partition").cast("string"), F.col("offset").cast("string")),
    )
    committed_in_ledger = F.col("state").isin(*COMMITTED_STATES)
    return (
        c.withColumn("canonical", canonical)
        .withColumn("claimed", claimed)
        .withColumn("copies", F.count(F.lit(1)).over(all_of_id))
        .withColumn("reason", orphan_reason)
        .withColumn("kind", kind)
        .withColumn("occurrence", occurrence)
        .withColumn(
            "commit_time",
            F.coalesce(F.when(committed_in_ledger, F.col("l_commit_time")), "marker_commit_ts"),
        )
        .withColumn(
            "commit_xid",
            F.when(committed_in_ledger, F.col("l_commit_xid")).otherwise(
                F.col("marker_commit_xid")
            ),
        )
        .withColumn("delivered_markers", delivered_markers)
        .withColumn("judged", _judged("ts", window, c))
    )


def copy_findings(classified: DataFrame) -> DataFrame:
    """The orphan, duplicate and record_without_marker findings of the judged copies."""
    found = classified.where(F.col("judged") & F.col("kind").isNotNull())
    return found.select(
        "kind",
        "topic",
        "outbox_id",
        "occurrence",
        F.coalesce("l_producer_group", "marker_producer_group", "producer_group").alias(
            "producer_group"
        ),
        F.coalesce("l_tx_id", "marker_tx_id", "tx_id").alias("tx_id"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("ts").alias("event_time"),
        F.to_json(
            F.struct(
                F.col("reason"),
                F.col("state").alias("ledger_state"),
                F.col("claimed.topic").alias("claimed_topic"),
                F.col("claimed.partition").alias("claimed_partition"),
                F.col("claimed.offset").alias("claimed_offset"),
                F.col("copies"),
                F.col("delivered_markers"),
            )
        ).alias("detail"),
    )


def missing_records(
    ledger: DataFrame,
    copy_rows: DataFrame,
    window: JudgeWindow,
    undelivered_before: datetime | None = None,
    waited_to: datetime | None = None,
) -> DataFrame:
    """Committed or delivered ledger rows, due, of which no copy is on their topic.

    A delivered row is due by its end (when the relay wrote its marker), a committed one by its
    commit time; with `window.include_stuck` also committed rows from before the window. A row
    still committed (the relay has not ended it) only if it committed by `undelivered_before`
    (None: as any other): until then the relay is behind, not wrong, and a later judgement
    reports it as stuck if it still waits. Its detail says how long it had waited
    (`waited_s`) to `waited_to`, the time its wait is counted to (None: the window's `as_of`);
    a delivered row has none.
    """
    seen = copy_rows.select(F.col("outbox_id").alias("id"), "topic")
    due_at = F.when(F.col("state") == "delivered", F.coalesce("ended_at", "commit_time")).otherwise(
        F.col("commit_time")
    )
    stuck = (F.col("state") == "committed") & (F.col("due_at") < F.lit(window.lo))
    due = (F.col("due_at") <= F.lit(window.hi)) & (
        (F.col("due_at") >= F.lit(window.lo)) | (F.lit(window.include_stuck) & stuck)
    )
    # How long a row the relay has not ended had waited when found: a relay stopped for days
    # from one minutes behind. (A flag for rows from before the window said little: with the
    # undelivered deadline longer than a window, a running job's were all from before it.)
    wait = F.lit(waited_to or window.as_of).cast("double") - F.col("commit_time").cast("double")
    waited_s = F.when(F.col("state") == "committed", F.round(wait, 3))
    if undelivered_before is not None:
        waited_enough = F.col("commit_time") <= F.lit(undelivered_before)
        due = due & ((F.col("state") != "committed") | waited_enough)
    rows = (
        ledger.where(F.col("state").isin(*COMMITTED_STATES))
        .withColumn("due_at", due_at)
        .where(due)
        .join(seen, ["id", "topic"], "left_anti")
    )
    return rows.select(
        F.lit("missing").alias("kind"),
        "topic",
        F.col("id").alias("outbox_id"),
        F.lit("").alias("occurrence"),
        "producer_group",
        "tx_id",
        "kafka_partition",
        "kafka_offset",
        F.col("due_at").alias("event_time"),
        F.to_json(
            F.struct(
                F.col("state").alias("ledger_state"),
                F.col("commit_time"),
                F.col("ended_at"),
                waited_s.alias("waited_s"),
            )
        ).alias("detail"),
    )


def markers_without_record(
    marker_rows: DataFrame, copy_rows: DataFrame, ledger: DataFrame, window: JudgeWindow
) -> DataFrame:
    """Judged `delivered` markers without a copy on their topic, where the ledger cannot say
    `missing` instead (no row any more, or a row that was never committed)."""
    seen = copy_rows.select("outbox_id", F.col("topic").alias("m_topic"))
    states = ledger.select(F.col("id").alias("outbox_id"), "state")
    rows = (
        marker_rows.where(
            (F.col("op") == Op.DELIVERED.value) & _judged("m_ts", window, marker_rows)
        )
        .join(seen, ["outbox_id", "m_topic"], "left_anti")
        .join(states, "outbox_id", "left")
        .where(F.col("state").isNull() | ~F.col("state").isin(*COMMITTED_STATES))
    )
    return rows.select(
        F.lit("marker_mismatch").alias("kind"),
        F.col("m_topic").alias("topic"),
        "outbox_id",
        F.lit(MARKER_WITHOUT_RECORD).alias("occurrence"),
        F.col("m_producer_group").alias("producer_group"),
        F.col("m_tx_id").alias("tx_id"),
        F.col("m_partition").alias("kafka_partition"),
        F.col("m_offset").alias("kafka_offset"),
        F.col("m_ts").alias("event_time"),
        F.to_json(F.struct(F.col("state").alias("ledger_state"), F.col("commit_ts"))).alias(
            "detail"
        ),
    )


def out_of_order(classified: DataFrame) -> DataFrame:
    """Judged canonical copies placed after a copy (same topic, partition, key) that committed
    later. Of a swapped pair only the earlier-committed record is reported."""
    order = F.struct(
        F.col("commit_time").alias("commit_time"),
        F.col("commit_xid").alias("xid"),
        F.col("outbox_id").alias("id"),
    )
    before = (
        Window.partitionBy("topic", "partition", "key")
        .orderBy("offset")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    rows = (
        classified.where(
            F.col("canonical") & F.col("key").isNotNull() & F.col("commit_time").isNotNull()
        )
        .withColumn("order", order)
        .withColumn("later", F.max("order").over(before))
        .where(F.col("judged") & (F.col("later") > F.col("order")))
    )
    return rows.select(
        F.lit("out_of_order").alias("kind"),
        "topic",
        "outbox_id",
        F.lit("").alias("occurrence"),
        F.coalesce("l_producer_group", "marker_producer_group", "producer_group").alias(
            "producer_group"
        ),
        F.coalesce("l_tx_id", "marker_tx_id", "tx_id").alias("tx_id"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("ts").alias("event_time"),
        F.to_json(
            F.struct(
                F.col("commit_time"),
                F.base64("key").alias("key"),
                F.col("later.id").alias("placed_after_id"),
                F.col("later.commit_time").alias("placed_after_commit_time"),
            )
        ).alias("detail"),
    )


def latency_bucket(latency_ms: Column) -> Column:
    """`latency_ms` rounded to LATENCY_DIGITS significant digits, as latency.bucket()."""
    quantum = F.pow(F.lit(10.0), F.floor(F.log10(F.abs(latency_ms))) - (LATENCY_DIGITS - 1))
    return F.when(latency_ms == 0, F.lit(0.0)).otherwise(F.round(latency_ms / quantum) * quantum)


def latency_histogram(
    classified: DataFrame, window: JudgeWindow, size: timedelta, counted: Column | None = None
) -> DataFrame:
    """Per summary window of Kafka time starting at `window.summaries_from` or later, and per
    latency bucket: the canonical copies before `window.hi` and their latency from commit to
    topic (ms). Copies at `hi` are the next judgement's (it counts from its `lo`, this `hi`).

    `counted`: which of them this judgement adds (the job's choice: those no judgement before
    added to the windows it carries); None: all.
    """
    latency = (F.unix_micros("ts") - F.unix_micros("commit_time")) / F.lit(1000.0)
    rows = classified.where(
        F.col("canonical")
        & F.col("commit_time").isNotNull()
        & (F.col("ts") >= F.lit(window.summaries_from))
        & (F.col("ts") < F.lit(window.hi))
    )
    if counted is not None:
        rows = rows.where(counted)
    return (
        rows.groupBy(
            F.window("ts", spark_interval(size)).alias("w"),
            latency_bucket(latency).alias("bucket_ms"),
        )
        .agg(F.count(F.lit(1)).alias("records"), F.max(latency).alias("max_ms"))
        .where(F.col("w.start") >= F.lit(window.summaries_from))  # whole windows only
        .select(
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "bucket_ms",
            "records",
            "max_ms",
        )
    )


def judge(
    obs: DataFrame,
    ledger: DataFrame,
    window: JudgeWindow,
    *,
    coverage_start: datetime | None,
    summary_window: timedelta,
    late: DataFrame | None = None,
    latency_counted: Column | None = None,
    watched_topic: Column | None = None,
    undelivered_before: datetime | None = None,
    waited_to: datetime | None = None,
) -> Judgement:
    """All findings and the latency histogram of one judgement (see the module docstring).

    `obs` holds each Kafka record once (the store writes each micro-batch to its own directory,
    overwritten on replay; an audit reads each offset once); those with a Kafka time in the
    window are judged. `late`: observations with a Kafka time before `obs`'s (copies that
    arrived lately, or the copies of rows a relay left committed); they count as present (a
    ledger row they answer is not missing), and their markers say where a judged copy's record
    landed. An observation of either with a true `late_judged` column is judged whatever its
    time, and is the context of the others (a copy it precedes is a duplicate, its marker says
    where its record landed): it arrived after the judgements of its time (the job's choice,
    see ReconcileJob.judge). A copy with a true `late_read` column is classified (its latency
    counted, see `latency_counted`), not judged: read first now, it is judged later.
    `latency_counted`: see latency_histogram. `watched_topic`: whether a ledger row's topic is
    one the job reads (`watched`): only those can be missing. The ledger holds others' rows too,
    looked up by the id of a copy found on a watched topic (another app's copy forwarding the
    headers): that copy is judged against them, and they were found missing.
    `undelivered_before`, `waited_to`: see missing_records.
    """
    copy_rows = copies(obs)
    marker_rows = markers(obs)
    present = copy_rows
    context_markers = marker_rows  # what says where a judged copy's record landed
    if late is not None:
        # Only the late copies read or judged now are classified: `late` can reach back far (a
        # relay that lags), and classifying all of it made a judgement several seconds slower;
        # its markers are only grouped by id. A flag column missing on one side is null there:
        # not judged.
        present = copy_rows.unionByName(copies(late), allowMissingColumns=True)
        # A late copy's marker can be older than the context (stamped as long ago as the copy)
        # and read by an earlier judgement: without it, the copy was taken for one without.
        context_markers = marker_rows.unionByName(markers(late), allowMissingColumns=True)
        if LATE_JUDGED in late.columns or LATE_READ in late.columns:
            now = late_now(late)
            copy_rows = copy_rows.unionByName(copies(now), allowMissingColumns=True)
            judged_late = now.where(_flag(now, LATE_JUDGED))
            marker_rows = marker_rows.unionByName(markers(judged_late), allowMissingColumns=True)
    classified = classify_copies(
        copy_rows, ledger, marker_facts(context_markers), window, coverage_start=coverage_start
    )
    findings = (
        copy_findings(classified)
        .unionByName(
            missing_records(
                ledger if watched_topic is None else ledger.where(watched_topic),
                present,
                window,
                undelivered_before,
                waited_to,
            )
        )
        .unionByName(markers_without_record(marker_rows, present, ledger, window))
        .unionByName(out_of_order(classified))
    )
    return Judgement(
        findings=findings,
        latency=latency_histogram(classified, window, summary_window, latency_counted),
        classified=classified,
    )
