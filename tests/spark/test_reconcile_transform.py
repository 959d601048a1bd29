"""The reconciliation's DataFrame transformations on a few in-memory rows (one JVM for all)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pytest

from relay.markers import (
    OUTBOX_ID_HEADER,
    OUTBOX_NAME_HEADER,
    OUTBOX_TX_ID_HEADER,
    MarkerBatcher,
    Op,
    OpMarker,
    marker_entry,
)
from spark.config import JudgeWindow
from spark.latency import bucket, merge_rows

if TYPE_CHECKING:
    from pathlib import Path

    from pyspark.sql import DataFrame, SparkSession

T = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
TOPIC = "orders"
MARKERS = "outbox.op-markers"
DEAD_LETTER = "outbox.dead-letter"
DEADLINE = timedelta(seconds=60)
HORIZON = timedelta(minutes=15)
STREAM_WINDOW = JudgeWindow.streaming(T + timedelta(minutes=10), DEADLINE, HORIZON)


def s(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


class Kafka:
    """Rows as Spark's Kafka source gives them, with per-topic offsets."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.marker_offset = 0

    def copy(
        self,
        outbox_id: int | None,
        offset: int,
        at: datetime,
        key: bytes | None = b"k",
        outbox: str | None = None,
    ) -> None:
        headers = (
            [(OUTBOX_ID_HEADER, str(outbox_id).encode()), (OUTBOX_TX_ID_HEADER, b"tx")]
            if outbox_id is not None
            else []
        )
        if outbox is not None:  # as relays write it since copies name their outbox
            headers.append((OUTBOX_NAME_HEADER, outbox.encode()))
        self.rows.append((key, b"value", TOPIC, 0, offset, at, 0, headers))

    def marker(
        self,
        outbox_id: int,
        at: datetime,
        *,
        offset: int | None,
        commit: datetime | None,
        op: Op = Op.DELIVERED,
        key: bytes | None = b"k",
        xid: int | None = None,
        outbox: str | None = None,
    ) -> None:
        """One marker alone in a message, as the relay writes it."""
        self.markers([(outbox_id, offset, commit, op, key)], at, xid=xid, outbox=outbox)

    def markers(
        self,
        entries: list[tuple[int, int | None, datetime | None, Op, bytes | None]],
        at: datetime,
        *,
        xid: int | None = None,
        outbox: str | None = None,
    ) -> None:
        """Several markers in one message (version 2): (id, offset, commit, op, key) each."""
        batcher = MarkerBatcher(shard=0, relay="relay-1", epoch=1, max_bytes=1 << 20, outbox=outbox)
        for outbox_id, offset, commit, op, key in entries:
            batcher.add(
                marker_entry(
                    op, id=outbox_id, tx_id="tx", producer_group="orders-service", topic=TOPIC,
                    key=key, partition=0 if offset is not None else None, offset=offset,
                    commit_ts=commit, reason=None, xid=xid,
                )
            )  # fmt: skip
        self.rows.append((batcher.key, batcher.take(), MARKERS, 0, self.marker_offset, at, 0, []))
        self.marker_offset += 1

    def marker_v1(self, outbox_id: int, at: datetime, *, offset: int, commit: datetime) -> None:
        """A marker as relays before version 2 wrote it: one per message."""
        k, v = OpMarker(
            op=Op.DELIVERED, id=outbox_id, tx_id="tx", producer_group="orders-service",
            topic=TOPIC, key=b"k", shard=0, partition=0, offset=offset, commit_ts=commit,
            relay="relay-0", epoch=1,
        ).encode()  # fmt: skip
        self.rows.append((k, v, MARKERS, 0, self.marker_offset, at, 0, []))
        self.marker_offset += 1

    def raw(self, topic: str, value: bytes, headers: list[tuple[str, bytes]], at: datetime) -> None:
        self.rows.append((None, value, topic, 0, 1000 + len(self.rows), at, 0, headers))

    def frame(self, spark: SparkSession) -> DataFrame:
        from spark.transform import KAFKA_SCHEMA

        return spark.createDataFrame(self.rows, KAFKA_SCHEMA)


def ledger_row(
    outbox_id: int,
    state: str,
    commit: datetime | None,
    ended: datetime | None = None,
    offset: int | None = None,
    key: bytes | None = b"k",
    xid: int | None = None,
) -> tuple[Any, ...]:
    return (
        outbox_id,
        "orders-service",
        "tx",
        TOPIC,
        key,
        state,
        commit,
        ended,
        0 if offset is not None else None,
        offset,
        xid,
    )


def scenario(spark: SparkSession) -> tuple[DataFrame, DataFrame]:
    """Each id one case; see the expected findings in test_judge_finds_each_kind_once."""
    from spark.transform import LEDGER_SCHEMA, observations

    kafka, ledger = Kafka(), []
    # 1 clean: ledger, marker and copy agree
    ledger.append(ledger_row(1, "delivered", s(0), s(1), offset=0, key=b"k1"))
    kafka.copy(1, 0, s(1), key=b"k1")
    kafka.marker(1, s(1), offset=0, commit=s(0), key=b"k1")
    # 2 missing: the ledger says delivered at offset 99, nothing is there
    ledger.append(ledger_row(2, "delivered", s(2), s(3), offset=99, key=b"k2"))
    # 3 duplicate: a second copy at offset 5, a minute later
    ledger.append(ledger_row(3, "delivered", s(3), s(4), offset=1, key=b"k3"))
    kafka.copy(3, 1, s(4), key=b"k3")
    kafka.marker(3, s(4), offset=1, commit=s(3), key=b"k3")
    kafka.copy(3, 5, s(60), key=b"k3")
    # 4 orphan: rolled back in the ledger, yet on the topic (its dead-letter copy is ignored)
    ledger.append(ledger_row(4, "rolled_back", None, key=b"k4"))
    kafka.copy(4, 2, s(5), key=b"k4")
    kafka.raw(DEAD_LETTER, b"x", [(OUTBOX_ID_HEADER, b"4")], s(5))
    # 5 marker_mismatch: on the topic and delivered in the ledger, no marker
    ledger.append(ledger_row(5, "delivered", s(5), s(6), offset=3, key=b"k5"))
    kafka.copy(5, 3, s(6), key=b"k5")
    # 6, 7 out_of_order: same key; 6 committed first but sits after 7
    ledger.append(ledger_row(6, "delivered", s(7), s(10), offset=6, key=b"pair"))
    ledger.append(ledger_row(7, "delivered", s(8), s(9), offset=4, key=b"pair"))
    kafka.copy(7, 4, s(9), key=b"pair")
    kafka.marker(7, s(9), offset=4, commit=s(8), key=b"pair")
    kafka.copy(6, 6, s(10), key=b"pair")
    kafka.marker(6, s(10), offset=6, commit=s(7), key=b"pair")
    # 8 marker_mismatch: a delivered marker, no copy, no ledger row any more
    kafka.marker(8, s(11), offset=50, commit=s(10), key=b"k8")
    # 9 orphan: an id the ledger does not know, after the coverage start
    kafka.copy(9, 7, s(12), key=b"k9")
    # 10 not due yet: committed 10 s before as_of
    ledger.append(ledger_row(10, "committed", STREAM_WINDOW.as_of - timedelta(seconds=10)))
    # 11 unknown from before the coverage start, without its marker: no orphan (the ledger may
    # have deleted its row), but a copy the relay wrote has a marker (all rows, once deleted)
    kafka.copy(11, 8, s(5), key=b"k11")
    # 12 stuck: still committed from long before the window
    ledger.append(ledger_row(12, "committed", s(-600), key=b"k12"))
    # 13 a delivered marker without copy while the ledger has the row: missing, not mismatch
    ledger.append(ledger_row(13, "delivered", s(13), s(14), offset=77, key=b"k13"))
    kafka.marker(13, s(14), offset=77, commit=s(13), key=b"k13")
    # 14 clean while the relay has not marked the row delivered yet
    ledger.append(ledger_row(14, "committed", s(14.5), key=b"k14"))
    kafka.copy(14, 9, s(15), key=b"k14")
    kafka.marker(14, s(15), offset=9, commit=s(14.5), key=b"k14")
    # noise: a record of another producer, a malformed marker
    kafka.raw(TOPIC, b"not ours", [], s(16))
    kafka.raw(MARKERS, b"{not json", [], s(16))

    obs = observations(kafka.frame(spark), marker_topic=MARKERS, ignored_topics=(DEAD_LETTER,))
    return obs, spark.createDataFrame(ledger, LEDGER_SCHEMA)


def test_observations_parse_copies_and_markers(spark: SparkSession) -> None:
    from spark.transform import MARKER, OBSERVATION_SCHEMA, RECORD

    obs, _ = scenario(spark)
    assert [f.name for f in obs.schema.fields] == [f.name for f in OBSERVATION_SCHEMA.fields]
    rows = {(r.source, r.outbox_id, r.offset): r for r in obs.collect()}
    # the dead-letter copy, the foreign record and the malformed marker are gone
    assert {r.topic for r in rows.values()} == {TOPIC, MARKERS}
    assert sum(1 for r in rows.values() if r.source == RECORD) == 10
    copy = rows[(RECORD, 1, 0)]
    assert (copy.tx_id, copy.key, copy.target_offset, copy.op) == ("tx", b"k1", 0, None)
    marker = next(r for r in rows.values() if r.source == MARKER and r.outbox_id == 7)
    assert (marker.op, marker.key, marker.target_topic, marker.target_offset) == (
        "delivered",
        b"pair",
        TOPIC,
        4,
    )
    assert marker.producer_group == "orders-service"
    assert marker.commit_ts is not None


def test_markers_of_records_on_topics_the_job_does_not_read_are_dropped(
    spark: SparkSession,
) -> None:
    """A job that reads some topics judged every marker: each record of another topic was a
    marker without its record (or, with an archive, missing). Topics by name, or as Kafka's
    subscribePattern matches them: the whole name."""
    from spark.transform import MARKER, observations

    kafka = Kafka()
    kafka.marker(1, s(1), offset=0, commit=s(0))
    kafka.copy(1, 0, s(1))
    frame = kafka.frame(spark)

    def seen(**watched: Any) -> list[str]:
        obs = observations(frame, marker_topic=MARKERS, **watched)
        return sorted(r.source for r in obs.collect())

    both = sorted([MARKER, "record"])
    assert seen() == both
    assert seen(topics=(TOPIC,)) == both
    assert seen(topic_pattern="ord.*") == both
    # a copy of a topic not watched is dropped too: Spark's source read topics the pattern
    # matched only part of, and their copies were judged, all without their markers
    assert seen(topics=("payments",)) == []
    assert seen(topic_pattern="ord") == []  # a prefix is no match, as in Kafka
    # a topic the pattern matches but that is ignored: its markers go with its copies (judged
    # alone, each was a marker without its record, and its ledger rows missing)
    assert seen(topic_pattern="ord.*", ignored_topics=(TOPIC,)) == []
    assert seen(topic_pattern=".*", ignored_topics=("payments",)) == both


def test_a_copy_s_outbox_headers_are_read_wherever_they_are_and_the_first_of_a_name_wins(
    spark: SparkSession,
) -> None:
    from spark.transform import observations

    kafka = Kafka()
    kafka.raw(
        TOPIC,
        b"a",
        [
            ("trace", b"t"),
            (OUTBOX_TX_ID_HEADER, b"tx-a"),
            (OUTBOX_ID_HEADER, b"31"),
            (OUTBOX_ID_HEADER, b"99"),
        ],
        s(1),
    )
    kafka.raw(TOPIC, b"b", [(OUTBOX_ID_HEADER, b"32"), (OUTBOX_TX_ID_HEADER, None)], s(2))
    kafka.raw(TOPIC, b"c", [(OUTBOX_ID_HEADER, b"not a number")], s(3))
    kafka.raw(TOPIC, b"d", [("trace", b"t")], s(4))
    kafka.raw(TOPIC, b"e", None, s(5))  # type: ignore[arg-type]  # Kafka: no headers at all
    obs = observations(kafka.frame(spark), marker_topic=MARKERS)
    got = sorted((r.outbox_id, r.tx_id, r.producer_group) for r in obs.collect())
    assert got == [(31, "tx-a", None), (32, None, None)]  # fmt: skip


def test_observations_read_each_marker_of_a_message_and_older_versions(
    spark: SparkSession,
) -> None:
    from spark.transform import MARKER, observations

    kafka = Kafka()
    kafka.markers([(21, 0, s(0), Op.DELIVERED, b"a"), (22, None, None, Op.ROLLED_BACK, None)], s(1))
    kafka.marker_v1(23, s(2), offset=7, commit=s(1))
    kafka.raw(MARKERS, json.dumps({"v": 3, "markers": [{"id": 24}]}).encode(), [], s(3))
    # not a relay's: entries without an op or a topic (the sink needs the topic) are dropped
    incomplete = [{"id": 25, "op": "delivered"}, {"id": 26, "topic": TOPIC}]
    kafka.raw(MARKERS, json.dumps({"v": 2, "markers": incomplete}).encode(), [], s(4))
    obs = observations(kafka.frame(spark), marker_topic=MARKERS)
    got = {
        r.outbox_id: (r.op, r.key, r.target_offset, r.commit_ts is not None, r.offset)
        for r in obs.where(obs.source == MARKER).collect()
    }
    assert got == {
        21: ("delivered", b"a", 0, True, 0),  # both from the message at offset 0
        22: ("rolled_back", None, None, False, 0),
        23: ("delivered", b"k", 7, True, 1),
    }  # a version this job does not know (24) is not guessed at, nor are 25 and 26


def findings_of(
    obs: DataFrame, ledger: DataFrame, window: JudgeWindow
) -> dict[tuple[str, int, str], dict[str, Any]]:
    from spark.transform import judge

    judgement = judge(
        obs, ledger, window, coverage_start=s(11), summary_window=timedelta(minutes=1)
    )
    return {(r.kind, r.outbox_id, r.occurrence): r.asDict() for r in judgement.findings.collect()}


def test_judge_finds_each_kind_once(spark: SparkSession) -> None:
    from spark.transform import judge

    obs, ledger = scenario(spark)
    judgement = judge(
        obs, ledger, STREAM_WINDOW, coverage_start=s(11), summary_window=timedelta(minutes=1)
    )
    found = {(r.kind, r.outbox_id, r.occurrence): r.asDict() for r in judgement.findings.collect()}
    assert sorted(found) == sorted(
        [
            ("missing", 2, ""),
            ("duplicate", 3, "0:5"),
            ("orphan", 4, "0:2"),
            ("marker_mismatch", 5, "record_without_marker"),
            ("out_of_order", 6, ""),
            ("marker_mismatch", 8, "marker_without_record"),
            ("orphan", 9, "0:7"),
            ("marker_mismatch", 11, "record_without_marker"),
            ("missing", 12, ""),
            ("missing", 13, ""),
        ]
    )
    missing = found[("missing", 2, "")]
    assert (missing["topic"], missing["kafka_offset"], missing["producer_group"]) == (
        TOPIC,
        99,
        "orders-service",
    )
    # how long the relay has left it, to the judgement; a delivered row did not wait for it
    waited = STREAM_WINDOW.as_of - s(-600)
    assert json.loads(found[("missing", 12, "")]["detail"])["waited_s"] == waited.total_seconds()
    assert "waited_s" not in json.loads(found[("missing", 13, "")]["detail"])
    duplicate = json.loads(found[("duplicate", 3, "0:5")]["detail"])
    assert (duplicate["claimed_offset"], duplicate["copies"]) == (1, 2)
    assert json.loads(found[("orphan", 4, "0:2")]["detail"])["reason"] == "ledger_rolled_back"
    assert json.loads(found[("orphan", 9, "0:7")]["detail"])["reason"] == "unknown_to_ledger"
    assert json.loads(found[("out_of_order", 6, "")]["detail"])["placed_after_id"] == 7
    assert found[("marker_mismatch", 8, "marker_without_record")]["kafka_offset"] == 50

    buckets = judgement.latency.selectExpr(
        "unix_micros(window_start) AS start_us", "bucket_ms", "records", "max_ms"
    ).collect()
    assert {b.start_us for b in buckets} == {int(T.timestamp()) * 1_000_000}
    rows = [(T, s(60), b.bucket_ms, b.records, b.max_ms) for b in buckets]
    (window,) = merge_rows({}, rows).values()
    # canonical copies with a known commit time delivered in [T, T+1m): ids 1, 3, 5, 6, 7, 14
    assert window.records == 6
    assert window.percentile(0.5) == 1000.0
    assert window.max_ms == 3000.0

    # An audit of a past window reports no stuck rows from before it, and nothing not yet due.
    audit = JudgeWindow.audit(s(0), s(30), now=s(60), deadline=timedelta(seconds=20))
    audited = findings_of(obs, ledger, audit)
    assert ("missing", 12, "") not in audited
    assert ("duplicate", 3, "0:5") not in audited  # its copy came at T+60, after the window
    assert ("missing", 2, "") in audited


def test_a_record_still_waiting_for_the_relay_is_missing_only_after_the_undelivered_deadline(
    spark: SparkSession,
) -> None:
    """A relay down for two minutes made every record committed meanwhile a finding one
    deadline (60 s) after its commit, though the relay was only behind: the lag alert's to
    report. A row the relay says it delivered is judged by the deadline as before."""
    from spark.transform import LEDGER_SCHEMA, missing_records

    as_of, lo = STREAM_WINDOW.as_of, STREAM_WINDOW.lo
    ledger = spark.createDataFrame(
        [
            ledger_row(1, "committed", as_of - timedelta(minutes=2)),  # in the window: behind
            ledger_row(2, "committed", as_of - timedelta(minutes=6)),  # waited long enough
            ledger_row(3, "committed", lo - timedelta(minutes=1)),  # stuck, before the window
            # delivered, its copy absent: missing a deadline after its end, as before
            ledger_row(4, "delivered", as_of - timedelta(minutes=3), as_of - timedelta(minutes=2)),
        ],
        LEDGER_SCHEMA,
    )
    no_copies = spark.createDataFrame([], "outbox_id long, topic string")

    def missing(waited: timedelta | None) -> list[int]:
        before = None if waited is None else as_of - waited
        found = missing_records(ledger, no_copies, STREAM_WINDOW, before)
        return sorted(r.outbox_id for r in found.collect())

    assert missing(None) == [1, 2, 3, 4]  # the deadline alone
    assert missing(timedelta(minutes=5)) == [2, 3, 4]
    assert missing(timedelta(minutes=20)) == [4]


def test_a_record_a_judgement_left_to_the_relay_is_reported_by_a_later_one_while_it_waits(
    spark: SparkSession,
) -> None:
    """A running job judges what became due since its last judgement: a row it left to the
    relay is before the next window, and must be found there, stuck, once it has waited."""
    from spark.transform import LEDGER_SCHEMA, missing_records

    waits = timedelta(minutes=5)
    first = JudgeWindow.following(
        T - DEADLINE, T + DEADLINE, DEADLINE, HORIZON, timedelta(minutes=1)
    )
    committed = T - timedelta(seconds=30)
    assert first.lo <= committed <= first.hi  # due in the first window
    ledger = spark.createDataFrame([ledger_row(1, "committed", committed)], LEDGER_SCHEMA)
    no_copies = spark.createDataFrame([], "outbox_id long, topic string")

    def missing(window: JudgeWindow) -> list[int]:
        found = missing_records(ledger, no_copies, window, window.as_of - waits)
        return [r.outbox_id for r in found.collect()]

    assert missing(first) == []  # the relay is behind
    later = first.hi
    for minutes in (2, 5):  # judgements every few minutes; waited long enough by the second
        window = JudgeWindow.following(
            later, T + timedelta(minutes=minutes), DEADLINE, HORIZON, timedelta(minutes=1)
        )
        assert committed < window.lo  # before the window: judged as stuck
        assert missing(window) == ([1] if minutes == 5 else [])
        later = window.hi


def test_a_record_of_a_topic_the_job_does_not_read_is_never_missing(spark: SparkSession) -> None:
    """A copy on a watched topic carrying the outbox headers of a record of another topic
    (an app forwarding them, as Kafka Streams does) made the job look that record up; with no
    copy on its own topic, which the job does not read, it was found missing."""
    from pyspark.sql import functions as F

    from spark.transform import LEDGER_SCHEMA, judge, observations, watched

    kafka = Kafka()
    kafka.copy(21, 0, s(2))  # on TOPIC, a copy of record 21 of "payments"
    obs = observations(kafka.frame(spark), marker_topic=MARKERS, ignored_topics=(DEAD_LETTER,))
    row = list(ledger_row(21, "delivered", s(0), s(1), offset=3))
    row[3] = "payments"
    ledger = spark.createDataFrame([tuple(row)], LEDGER_SCHEMA)

    def kinds(**watching: Any) -> set[tuple[str, str]]:
        judgement = judge(
            obs, ledger, STREAM_WINDOW, coverage_start=s(11),
            summary_window=timedelta(minutes=1), **watching,
        )  # fmt: skip
        return {(r.kind, r.topic) for r in judgement.findings.collect()}

    assert kinds() == {("missing", "payments"), ("orphan", TOPIC)}  # as the job judged it
    watching = watched(F.col("topic"), (TOPIC,), None)
    assert kinds(watched_topic=watching) == {("orphan", TOPIC)}  # on the wrong topic, still
    ignoring = watched(F.col("topic"), (), ".*", ("payments",))  # matched, but ignored
    assert kinds(watched_topic=ignoring) == {("orphan", TOPIC)}


def test_a_discarded_record_resolved_by_hand_and_delivered_is_no_orphan(
    spark: SparkSession,
) -> None:
    """Resolved by hand as the relay shipped its discard, its markers say discarded, then
    delivered: with its row deleted, its copy was an orphan "never committed"."""
    from spark.transform import LEDGER_SCHEMA, observations

    kafka = Kafka()
    kafka.marker(31, s(1), offset=None, commit=None, op=Op.DISCARDED)
    kafka.copy(31, 0, s(3))
    kafka.marker(31, s(3), offset=0, commit=s(2))
    obs = observations(kafka.frame(spark), marker_topic=MARKERS, ignored_topics=(DEAD_LETTER,))
    empty = spark.createDataFrame([], LEDGER_SCHEMA)
    assert findings_of(obs, empty, STREAM_WINDOW) == {}


def test_nothing_is_judged_before_its_deadline(spark: SparkSession) -> None:
    obs, ledger = scenario(spark)
    early = JudgeWindow.streaming(s(20), DEADLINE, HORIZON)  # judges up to T-40s only
    assert set(findings_of(obs, ledger, early)) == {("missing", 12, "")}


def test_a_late_arrival_counts_as_present_but_is_not_judged(spark: SparkSession) -> None:
    from spark.transform import LEDGER_SCHEMA, judge, observations

    # Record 1 ended (is due) inside the window; its copy and marker carry a Kafka time from
    # long before, so they come as late arrivals, outside the judged observations.
    kafka = Kafka()
    kafka.copy(1, offset=0, at=s(-600))
    kafka.marker(1, s(-600), offset=0, commit=s(-601))
    late = observations(kafka.frame(spark), marker_topic=MARKERS)
    ledger = spark.createDataFrame(
        [ledger_row(1, "delivered", s(-601), ended=s(30), offset=0)], LEDGER_SCHEMA
    )
    window = JudgeWindow.streaming(s(100), timedelta(seconds=20), timedelta(minutes=2))
    nothing = late.limit(0)

    def kinds(late_rows: DataFrame | None) -> list[str]:
        judgement = judge(
            nothing, ledger, window, coverage_start=None, summary_window=timedelta(minutes=1),
            late=late_rows,
        )  # fmt: skip
        return [r.kind for r in judgement.findings.collect()]

    assert kinds(None) == ["missing"]  # without them: the row is due and nothing is seen
    assert kinds(late) == []


def test_late_arrivals_no_judgement_read_are_judged(spark: SparkSession) -> None:
    """Observations stamped before the judged range that arrived since the last judgement (a
    Kafka transaction held open, a producer retrying) are judged like the window's, as flagged;
    those read before are context only (present; their markers say where a record landed).
    And a judged late copy is the context of a later one of its id."""
    from pyspark.sql import functions as F

    from spark.transform import LATE_JUDGED, LEDGER_SCHEMA, judge, observations

    kafka = Kafka()
    # 1: delivered long ago, with its marker, and copied again (a duplicate), all late
    kafka.copy(1, offset=0, at=s(-600))
    kafka.marker(1, s(-600), offset=0, commit=s(-601))
    kafka.copy(1, offset=1, at=s(-599))
    # 2: a rolled-back record's copy, late: an orphan
    kafka.copy(2, offset=2, at=s(-598))
    # 3: a delivered marker, late, of a record neither on its topic nor in the ledger
    kafka.marker(3, s(-597), offset=9, commit=s(-598))
    # 4: its first copy is late, another is in the window: the window's is the duplicate
    kafka.copy(4, offset=3, at=s(-596))
    kafka.marker(4, s(-596), offset=3, commit=s(-597))
    kafka.copy(4, offset=4, at=s(60))
    # 5: a rolled-back record's copy in the context before the judged range (from s(0))
    kafka.copy(5, offset=5, at=s(-10))
    rows = observations(kafka.frame(spark), marker_topic=MARKERS)
    window = JudgeWindow.streaming(s(100), timedelta(seconds=20), timedelta(minutes=2))
    assert (window.store_low, window.lo) == (s(-20), s(0))
    obs = rows.where(F.col("ts") >= F.lit(window.store_low))
    late = rows.where(F.col("ts") < F.lit(window.store_low))
    ledger = spark.createDataFrame(
        [
            ledger_row(1, "delivered", s(-601), ended=s(-600), offset=0),
            ledger_row(2, "rolled_back", None),
            ledger_row(5, "rolled_back", None),
        ],
        LEDGER_SCHEMA,
    )

    def found(obs_rows: DataFrame, late_rows: DataFrame) -> set[tuple[str, int, str]]:
        judgement = judge(
            obs_rows, ledger, window, coverage_start=None, summary_window=timedelta(minutes=1),
            late=late_rows,
        )  # fmt: skip
        return {(r.kind, r.outbox_id, r.occurrence) for r in judgement.findings.collect()}

    def flagged(frame: DataFrame, judged: bool) -> DataFrame:
        return frame.withColumn(LATE_JUDGED, F.lit(judged) & (F.col("ts") < F.lit(window.lo)))

    window_duplicate = ("duplicate", 4, "0:4")
    assert found(flagged(obs, True), flagged(late, True)) == {
        ("duplicate", 1, "0:1"),
        ("orphan", 2, "0:2"),
        ("marker_mismatch", 3, "marker_without_record"),
        ("orphan", 5, "0:5"),
        window_duplicate,
    }
    assert found(obs, flagged(late, True)) == {  # a flag on one side only
        ("duplicate", 1, "0:1"),
        ("orphan", 2, "0:2"),
        ("marker_mismatch", 3, "marker_without_record"),
        window_duplicate,
    }
    # Read before, the late rows are not judged again: they count as present, and their
    # markers say where their records landed, so the window's copy of 4 is still the duplicate
    # (not a copy without its marker: its original's marker is late, not missing).
    assert found(flagged(obs, False), flagged(late, False)) == {window_duplicate}
    assert found(obs, late) == {window_duplicate}  # an audit's context: never judged


def test_a_zombies_copy_judged_a_judgement_after_its_marker_is_the_duplicate(
    spark: SparkSession,
) -> None:
    """A zombie's late transaction, stamped long before the record's first delivery, read a
    micro-batch apart: its marker was judged by an earlier judgement and is context now, when
    its copy is judged. The marker that came first (the first delivery's, an earlier batch)
    still says where the record landed, though the zombie's is stamped before it: the copy is
    the duplicate. A late copy only read now (late_read) is classified, not judged."""
    from pyspark.sql import functions as F

    from spark.transform import (
        LATE_JUDGED,
        LATE_READ,
        LEDGER_SCHEMA,
        MARKER,
        RECORD,
        judge,
        observations,
    )

    kafka = Kafka()
    kafka.copy(1, offset=0, at=s(-15))  # the first delivery: batch 1
    kafka.marker(1, s(-15), offset=0, commit=s(-16))
    kafka.marker(1, s(-600), offset=1, commit=s(-601))  # the zombie's marker: batch 2
    kafka.copy(1, offset=1, at=s(-600))  # its copy: batch 3, judged now
    kafka.copy(7, offset=2, at=s(-590))  # a rolled-back record's copy: batch 4, read now
    window = JudgeWindow.streaming(s(100), timedelta(seconds=20), timedelta(minutes=2))
    source, offset = F.col("source"), F.col("offset")
    batch = (
        F.when((source == MARKER) & (offset == 1), 2)
        .when((source == RECORD) & (offset == 1), 3)
        .when((source == RECORD) & (offset == 2), 4)
        .otherwise(1)
    )
    rows = observations(kafka.frame(spark), marker_topic=MARKERS).withColumn(
        "batch", batch.cast("long")
    )
    ledger = spark.createDataFrame([ledger_row(7, "rolled_back", None)], LEDGER_SCHEMA)

    def judged(judged_now: int, read_now: int) -> tuple[set[tuple[str, int, str]], Any]:
        flagged = rows.withColumn(LATE_JUDGED, F.col("batch") == judged_now).withColumn(
            LATE_READ, F.col("batch") == read_now
        )
        judgement = judge(
            flagged.where(F.col("ts") >= F.lit(window.store_low)), ledger, window,
            coverage_start=None, summary_window=timedelta(minutes=1),
            late=flagged.where(F.col("ts") < F.lit(window.store_low)),
        )  # fmt: skip
        found = {(r.kind, r.outbox_id, r.occurrence) for r in judgement.findings.collect()}
        (read,) = judgement.classified.where(F.col("outbox_id") == 7).collect()
        return found, read

    found, read = judged(judged_now=3, read_now=4)
    assert found == {("duplicate", 1, "0:1")}
    assert not read.judged  # classified now (its latency counted now), judged later
    found, read = judged(judged_now=4, read_now=-1)  # the rolled-back copy's turn
    assert found == {("orphan", 7, "0:2")}
    assert read.judged


def test_markers_and_copies_of_another_outbox_sharing_the_topics_are_not_judged(
    spark: SparkSession,
) -> None:
    """Another outbox's markers (its own ids) made this one's copy of the same id a duplicate,
    and its other ids markers without their records. Its copies on a topic both outboxes
    write were duplicates of this one's ids, or records without markers (found by a review)."""
    from spark.transform import LEDGER_SCHEMA, observations

    kafka = Kafka()
    kafka.marker(5, s(30), offset=9, commit=s(29), outbox="billing/outbox")  # not ours
    kafka.marker(6, s(30), offset=10, commit=s(29), outbox="billing/outbox")
    kafka.copy(5, 9, s(30), outbox="billing/outbox")
    kafka.copy(6, 10, s(30), outbox="billing/outbox")
    kafka.copy(5, 0, s(31), outbox="orders/outbox")
    kafka.marker(5, s(31), offset=0, commit=s(30), outbox="orders/outbox")
    kafka.copy(7, 1, s(32))  # by a relay before copies named their outbox: judged
    ledger = spark.createDataFrame([], LEDGER_SCHEMA)

    def found(outbox: str | None) -> set[tuple[str, int, str]]:
        obs = observations(kafka.frame(spark), marker_topic=MARKERS, outbox=outbox)
        return set(findings_of(obs, ledger, STREAM_WINDOW))

    assert found("orders/outbox") == {("orphan", 7, "0:1")}
    assert found(None) == {  # every marker and copy taken as this outbox's
        ("duplicate", 5, "0:0"),
        ("orphan", 7, "0:1"),
    }


def test_markers_and_copies_written_before_a_rename_are_this_outboxs_when_named_former(
    spark: SparkSession,
) -> None:
    """After a rename of the database, the job took what the relay wrote under the old name for
    another outbox's: the records archived before the rename were reported missing."""
    from spark.transform import LEDGER_SCHEMA, observations

    kafka, ledger = Kafka(), []
    ledger.append(ledger_row(1, "delivered", s(0), s(1), offset=0))  # before the rename
    kafka.copy(1, 0, s(1), outbox="orders-old/outbox")
    kafka.marker(1, s(1), offset=0, commit=s(0), outbox="orders-old/outbox")
    ledger.append(ledger_row(2, "delivered", s(2), s(3), offset=1))  # after it
    kafka.copy(2, 1, s(3), outbox="orders/outbox")
    kafka.marker(2, s(3), offset=1, commit=s(2), outbox="orders/outbox")
    kafka.marker(3, s(4), offset=9, commit=s(3), outbox="billing/outbox")  # another's still
    frame, ledger_frame = kafka.frame(spark), spark.createDataFrame(ledger, LEDGER_SCHEMA)

    def found(former: tuple[str, ...]) -> set[tuple[str, int, str]]:
        obs = observations(
            frame, marker_topic=MARKERS, outbox="orders/outbox", former_outboxes=former
        )
        return set(findings_of(obs, ledger_frame, STREAM_WINDOW))

    assert found(()) == {("missing", 1, "")}
    assert found(("orders-old/outbox",)) == set()


def test_a_late_copy_stamped_before_the_one_judged_already_is_the_duplicate(
    spark: SparkSession,
) -> None:
    """A zombie's transaction that committed late, with its own marker, both stamped long
    before: they ranked first, the late copy became the canonical one, and the copy judged
    canonical before was not judged again; neither was reported."""
    from pyspark.sql import functions as F

    from spark.transform import LATE_JUDGED, LEDGER_SCHEMA, judge, observations

    kafka = Kafka()
    kafka.copy(7, offset=1, at=s(-10))  # judged by the last judgement, in this one's context
    kafka.marker(7, s(-10), offset=1, commit=s(-11))
    kafka.copy(7, offset=2, at=s(-200))  # arrived since, stamped long before
    kafka.marker(7, s(-200), offset=2, commit=s(-201))
    rows = observations(kafka.frame(spark), marker_topic=MARKERS)
    window = JudgeWindow.streaming(s(100), timedelta(seconds=20), timedelta(minutes=2))
    obs = rows.where(F.col("ts") >= F.lit(window.store_low)).withColumn(LATE_JUDGED, F.lit(False))
    late = rows.where(F.col("ts") < F.lit(window.store_low)).withColumn(LATE_JUDGED, F.lit(True))
    judgement = judge(
        obs, spark.createDataFrame([], LEDGER_SCHEMA), window, coverage_start=None,
        summary_window=timedelta(minutes=1), late=late,
    )  # fmt: skip
    found = {(r.kind, r.outbox_id, r.occurrence) for r in judgement.findings.collect()}
    assert found == {("duplicate", 7, "0:2")}


def test_equal_commit_times_are_ordered_by_xid_as_the_relay_orders_them(
    spark: SparkSession,
) -> None:
    """Two transactions committed in the same microsecond: the relay sends the smaller xid first,
    whatever the ids; the ledger's xid decides, or the markers' once the rows are gone."""
    from spark.transform import LEDGER_SCHEMA, observations

    def out_of_order(*, placed: tuple[int, int], in_ledger: bool) -> set[int]:
        xids = {1: 20, 2: 10}  # 2's transaction has the smaller xid: the relay sends 2 first
        kafka, ledger = Kafka(), []
        for offset, outbox_id in enumerate(placed):
            kafka.copy(outbox_id, offset, s(2 + offset), key=b"same")
            kafka.marker(outbox_id, s(2 + offset), offset=offset, commit=s(1), key=b"same",
                         xid=xids[outbox_id])  # fmt: skip
            if in_ledger:
                ledger.append(ledger_row(outbox_id, "delivered", s(1), s(2 + offset), offset=offset,
                                         key=b"same", xid=xids[outbox_id]))  # fmt: skip
        obs = observations(kafka.frame(spark), marker_topic=MARKERS)
        found = findings_of(obs, spark.createDataFrame(ledger, LEDGER_SCHEMA), STREAM_WINDOW)
        return {outbox_id for kind, outbox_id, _ in found if kind == "out_of_order"}

    for in_ledger in (True, False):
        assert out_of_order(placed=(2, 1), in_ledger=in_ledger) == set()  # the relay's order
        assert out_of_order(placed=(1, 2), in_ledger=in_ledger) == {2}


def test_the_latency_buckets_of_spark_and_of_the_driver_agree(spark: SparkSession) -> None:
    """The histogram is bucketed by Spark and merged by the driver: both must round alike."""
    from pyspark.sql import functions as F

    from spark.transform import latency_bucket

    values = [
        0.0,
        0.001,
        0.5,
        1.0,
        12.345,
        999.5,
        1000.0,
        1234.5,
        1235.0,
        99_950.0,
        3.6e6,
        -7.25,
        -1235.0,
    ]
    df = spark.createDataFrame([(v,) for v in values], "ms double")
    got = {r.ms: r.b for r in df.select("ms", latency_bucket(F.col("ms")).alias("b")).collect()}
    assert got == {v: bucket(v) for v in values}
    assert got[1234.5] == 1230.0  # three digits
    assert got[1235.0] == 1240.0  # half away from zero
    assert got[-1235.0] == -1240.0
    assert got[12.345] == pytest.approx(12.3)
    assert got[99_950.0] == 100_000.0


def test_only_the_counted_copies_are_added_to_the_histogram(spark: SparkSession) -> None:
    """A running job adds to the windows it carries only what no judgement added before."""
    from pyspark.sql import functions as F

    from spark.transform import LEDGER_SCHEMA, judge, observations

    kafka, ledger = Kafka(), []
    for outbox_id, at in ((1, s(5)), (2, s(20)), (3, s(40))):
        kafka.copy(outbox_id, outbox_id, at)
        kafka.marker(outbox_id, at, offset=outbox_id, commit=at - timedelta(seconds=1))
        ledger.append(ledger_row(outbox_id, "delivered", at - timedelta(seconds=1), at,
                                 offset=outbox_id))  # fmt: skip
    obs = observations(kafka.frame(spark), marker_topic=MARKERS)
    window = JudgeWindow(s(200), s(0), s(15), s(140), True, windows_from=T, latency_carried=True)

    def records(counted: Any) -> int:
        judgement = judge(obs, spark.createDataFrame(ledger, LEDGER_SCHEMA), window,
                          coverage_start=None, summary_window=timedelta(minutes=1),
                          latency_counted=counted)  # fmt: skip
        return sum(r.records for r in judgement.latency.collect())

    assert records(None) == 3
    assert records(F.col("ts") >= F.lit(window.lo)) == 2  # id 1 was counted before
    # a window that began before what a judgement sums up (a whole-horizon one's lo) is left
    # out, not summed from part of its copies; a copy at hi is the next judgement's
    window = JudgeWindow(s(200), s(0), s(10), s(40), True)
    assert records(None) == 0
    window = JudgeWindow(s(200), s(0), s(0), s(40), True)
    assert records(None) == 2  # ids 1 and 2; id 3, at hi (40 s), is not yet counted


def test_an_empty_store_is_read_in_the_jvm_without_python_workers(
    spark: SparkSession, tmp_path: Path
) -> None:
    """An idle job's store has no batch in a judgement's reach. Made by createDataFrame([]),
    that empty read was a Python RDD: each task of every stage reading it waited for a Python
    worker (a judgement of an idle job, the one that finds a dropped record, took twice as long)."""
    from spark.config import ReconcileSettings
    from spark.job import STORE_SCHEMA, ReconcileJob

    settings = ReconcileSettings(
        dsn="postgresql://u:secret@db:5432/app", bootstrap_servers="k:9092",
        topics=("orders",), checkpoint=str(tmp_path),
    )  # fmt: skip
    store = ReconcileJob(settings, spark)._read_store()
    assert store.schema == STORE_SCHEMA
    assert store.count() == 0
    lineage = str(store._jdf.queryExecution().toRdd().toDebugString())
    assert "PythonRDD" not in lineage, lineage


def test_a_late_flag_is_set_by_the_time_of_each_batch(spark: SparkSession) -> None:
    """The job's late flags (spark.job._stamped_before): batches of one time as one range, and
    each batch by its own time."""
    from pyspark.sql import functions as F

    from spark.job import _stamped_before

    stamped = [(1, -10), (1, 5), (2, -10), (2, 5), (3, 5), (3, 15), (4, -10)]
    rows = spark.createDataFrame(
        [(b, t, s(t)) for b, t in stamped], "batch long, at long, ts timestamp"
    ).withColumn("late", _stamped_before({1: s(0), 2: s(0), 3: s(10)}))
    flagged = {(r.batch, r.at): r.late for r in rows.collect()}
    assert flagged == {
        (1, -10): True, (1, 5): False, (2, -10): True, (2, 5): False,
        (3, 5): True, (3, 15): False, (4, -10): False,
    }  # fmt: skip
    assert rows.where(F.col("late")).count() == 3
