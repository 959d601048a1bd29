"""The reconciliation job against the real broker and Postgres: a clean run, then faults.

The real relay delivers the clean records. `RelayStandIn` injects the faults: it writes to Kafka
and Postgres directly, by the contract the relay keeps (relay/markers.py, outbox_record): records
with the outbox headers plus their op markers in ONE Kafka transaction, then the rows marked
delivered with commit_ts, ended_at and their position; or, for a fault, part of that, at a
chosen time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from confluent_kafka import KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import make_conninfo

import outbox
from relay.markers import OUTBOX_ID_HEADER, OUTBOX_TX_ID_HEADER, Op, marker_entry, marker_messages
from spark.findings import read_findings, read_windows
from tests.fixtures.http import free_port, get
from tests.fixtures.kafka import TIMEOUT_S

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark.config import ReconcileSettings
    from spark.job import ReconcileJob, RunReport

GROUP = "shop"
DEADLINE = "5s"
SUMMARY_WINDOW = "2s"


@dataclass(frozen=True)
class Row:
    id: int
    producer_group: str
    tx_id: str
    topic: str
    key: bytes | None
    value: bytes | None


class RelayStandIn:
    """What the relay does for committed records, by the contract, at a chosen time `at`: the
    faults are parts of it left out, or done twice."""

    def __init__(self, dsn: str, producer: Producer, marker_topic: str) -> None:
        self.dsn = dsn
        self.producer = producer
        self.marker_topic = marker_topic

    def deliver(
        self,
        rows: Sequence[Row],
        *,
        at: datetime,
        copies: bool = True,
        markers: bool = True,
        claimed_offset: int | None = None,
        ledger: bool = True,
    ) -> dict[int, tuple[int, int]]:
        """Records (in the order given) and markers in one Kafka transaction, then the ledger.

        Commit times follow the ids (the commit order); `copies=False` claims `claimed_offset`;
        `ledger=False`: a relay that died after the Kafka commit, before it ended the rows.
        """
        commit = {
            r.id: at - timedelta(seconds=1) + timedelta(milliseconds=i)
            for i, r in enumerate(sorted(rows, key=lambda r: r.id))
        }
        positions: dict[int, tuple[int, int]] = {}
        self.producer.begin_transaction()
        if copies:
            delivered = self._produce(rows, at)
            positions.update(delivered)
        else:
            claimed = 10**6 if claimed_offset is None else claimed_offset
            positions.update({r.id: (0, claimed) for r in rows})
        if markers:
            entries = [
                marker_entry(
                    Op.DELIVERED, id=r.id, tx_id=r.tx_id, producer_group=r.producer_group,
                    topic=r.topic, key=r.key, partition=positions[r.id][0],
                    offset=positions[r.id][1], commit_ts=commit[r.id], reason=None,
                )
                for r in rows
            ]  # fmt: skip
            for value in marker_messages(entries, shard=0, relay="stand-in", epoch=1):
                self.producer.produce(self.marker_topic, value, b"0", timestamp=_ms(at))
        self.producer.commit_transaction(TIMEOUT_S)
        if not ledger:
            return positions
        with psycopg.connect(self.dsn) as conn:
            for r in rows:
                conn.execute(
                    "UPDATE outbox.outbox_record SET state = 'delivered', commit_ts = %s,"
                    " ended_at = %s, kafka_partition = %s, kafka_offset = %s, state_changed_at = %s"
                    " WHERE id = %s AND state = 'committed'",
                    (commit[r.id], at + timedelta(milliseconds=10), *positions[r.id], at, r.id),
                )
        return positions

    def copy_again(self, rows: Sequence[Row], at: datetime) -> None:
        """Copies without markers or ledger changes, in a Kafka transaction of their own."""
        self.producer.begin_transaction()
        self._produce(rows, at)
        self.producer.commit_transaction(TIMEOUT_S)

    def _produce(self, rows: Sequence[Row], at: datetime) -> dict[int, tuple[int, int]]:
        positions: dict[int, tuple[int, int]] = {}
        errors: list[Any] = []

        def report(outbox_id: int) -> Callable[[Any, Message], None]:
            def on_delivery(err: Any, msg: Message) -> None:  # no headers in delivery reports
                if err is not None:
                    errors.append(err)
                else:
                    positions[outbox_id] = (msg.partition() or 0, msg.offset() or 0)

            return on_delivery

        for r in rows:
            self.producer.produce(
                r.topic,
                r.value,
                r.key,
                headers=[(OUTBOX_ID_HEADER, str(r.id).encode()), (OUTBOX_TX_ID_HEADER, r.tx_id)],
                timestamp=_ms(at),
                on_delivery=report(r.id),
            )
        self.producer.flush(TIMEOUT_S)
        if errors:
            raise KafkaException(errors[0])
        return positions


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def publish(dsn: str, records: Sequence[outbox.Record]) -> list[Row]:
    """One database transaction through the real library: committed ledger rows."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        written = outbox.Outbox(producer_group=GROUP).publish_many(conn, records)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id, producer_group, tx_id, topic, key, value FROM outbox.outbox_record"
            " WHERE id = ANY(%s) ORDER BY id",
            (list(written.ids),),
        ).fetchall()
    return [Row(*r) for r in rows]


def reconcile(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    from spark.job import main

    assert main([*argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return report


def write_aged(
    dsn: str, *, finding_id: int, detected: timedelta, window_at: datetime, updated: timedelta
) -> None:
    """A finding detected (and last found) and a summary window written `detected` / `updated`
    ago (in seconds, whatever the session's time zone)."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox.reconciliation_finding (kind, topic, outbox_id, event_time,"
            " detected_at, last_seen_at, detected_in)"
            " SELECT 'missing', 'orders', %s, now(), at, at, 'tick'"
            " FROM (SELECT now() - make_interval(secs => %s) AS at) AS aged",
            (finding_id, detected.total_seconds()),
        )
        conn.execute(
            "INSERT INTO outbox.reconciliation_window (window_start, window_end, records,"
            " updated_at) VALUES (%s, %s, 5, now() - make_interval(secs => %s))",
            (window_at, window_at + timedelta(minutes=1), updated.total_seconds()),
        )


def test_retention_deletes_what_was_written_before_it(pg_dsn: str) -> None:
    """By when a row was written: an audit of an old range writes old windows today."""
    from spark import sink

    long_ago = datetime.now(UTC) - timedelta(days=90)
    write_aged(pg_dsn, finding_id=1, detected=timedelta(days=31), window_at=long_ago,
               updated=timedelta(days=31))  # fmt: skip
    write_aged(pg_dsn, finding_id=2, detected=timedelta(days=29), window_at=long_ago
               + timedelta(minutes=1), updated=timedelta(0))  # fmt: skip
    with sink.connect(pg_dsn) as conn:
        assert sink.prune(conn, "outbox", timedelta(days=30)) == sink.Pruned(1, 1, complete=True)
        conn.commit()
    assert [f.outbox_id for f in read_findings(pg_dsn)] == [2]
    assert [w.window_start for w in read_windows(pg_dsn)] == [long_ago + timedelta(minutes=1)]


def found_again(outbox_id: int) -> tuple[Any, ...]:
    """A missing finding as a judgement writes it (transform.FINDING_COLUMNS), as write_aged's."""
    return ("missing", "orders", outbox_id, "", None, None, None, None, datetime.now(UTC), "{}")


def test_a_finding_found_again_outlives_the_retention_and_is_not_new(pg_dsn: str) -> None:
    """A record stuck for longer than the retention: its finding was deleted by when it was
    first found, and the next judgement wrote it again, counted as new."""
    from spark import sink

    long_ago = datetime.now(UTC) - timedelta(days=90)
    for n in (1, 2):
        write_aged(pg_dsn, finding_id=n, detected=timedelta(days=31), updated=timedelta(0),
                   window_at=long_ago + timedelta(minutes=n))  # fmt: skip
    first = {f.outbox_id: f for f in read_findings(pg_dsn)}
    with sink.connect(pg_dsn) as conn:
        written = sink.write_judgement(conn, "outbox", [found_again(1)], [], detected_in="tick")
        assert written == sink.Written(new=Counter())
        again = {f.outbox_id: f for f in read_findings(pg_dsn)}
        assert again[1].detected_at == first[1].detected_at  # when the trouble began
        assert again[1].last_seen_at > datetime.now(UTC) - timedelta(minutes=1)
        assert sink.prune(conn, "outbox", timedelta(days=30)).findings == 1
        conn.commit()
    assert [f.outbox_id for f in read_findings(pg_dsn)] == [1]  # 2 was not found again


def test_a_finding_found_again_within_the_hour_is_not_written_again(pg_dsn: str) -> None:
    """A backlog of stuck records is thousands of findings, found at every trigger."""
    from spark import sink

    with sink.connect(pg_dsn) as conn:
        sink.write_judgement(conn, "outbox", [found_again(1)], [], detected_in="tick")
        (seen,) = read_findings(pg_dsn)
        written = sink.write_judgement(conn, "outbox", [found_again(1)], [], detected_in="tick")
        assert written == sink.Written(new=Counter())
        assert read_findings(pg_dsn)[0].last_seen_at == seen.last_seen_at
        sink.write_judgement(
            conn, "outbox", [found_again(1)], [], detected_in="tick", seen_every=timedelta(0)
        )
    assert read_findings(pg_dsn)[0].last_seen_at > seen.last_seen_at


def days_across_a_dst_change(dsn: str) -> tuple[int, timedelta]:
    """The fewest whole days back from now across a DST change of the session's time zone, and
    how far a cut-off of that many days in its calendar lies from the same days in seconds
    (asked of Postgres: its reading of an ambiguous hour is not Python's)."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(
            "SELECT d, gap FROM (SELECT d, (now() - make_interval(days => d))"
            " - (now() - make_interval(secs => d * 86400.0)) AS gap"
            " FROM generate_series(1, 370) AS d) AS cut WHERE gap <> interval '0'"
            " ORDER BY d LIMIT 1"
        ).fetchone()
    assert found is not None, "no DST change in a year"
    return found[0], found[1]


def test_retention_counts_seconds_whatever_the_sessions_time_zone(pg_dsn: str) -> None:
    """The retention was an interval of days, which Postgres counts in the session's calendar:
    across a DST change a finding an hour too young was deleted, or one too old kept."""
    from spark import sink

    berlin = make_conninfo(pg_dsn, options="-c TimeZone=Europe/Berlin")
    days, gap = days_across_a_dst_change(berlin)
    # Between the two cut-offs: past the retention in seconds only if the calendar's is later.
    age = timedelta(days=days) - gap / 2
    write_aged(pg_dsn, finding_id=1, detected=age, updated=age,
               window_at=datetime.now(UTC) - timedelta(days=400))  # fmt: skip
    with sink.connect(berlin) as conn:
        conn.autocommit = True
        pruned = sink.prune(conn, "outbox", timedelta(days=days))
    older = age > timedelta(days=days)
    assert pruned == sink.Pruned(int(older), int(older), complete=True)
    assert len(read_findings(pg_dsn)) == int(not older)


def test_retention_deletes_in_batches_and_says_when_more_is_due(pg_dsn: str) -> None:
    """A table that grew for long is emptied a batch a transaction, up to a bound a call."""
    from spark import sink

    long_ago = datetime.now(UTC) - timedelta(days=90)
    for n in range(5):
        write_aged(pg_dsn, finding_id=n, detected=timedelta(days=31), updated=timedelta(days=31),
                   window_at=long_ago + timedelta(minutes=n))  # fmt: skip
    with sink.connect(pg_dsn) as conn:
        conn.autocommit = True  # as the job's: each batch commits on its own
        assert sink.prune(conn, "outbox", timedelta(days=30), batch=2, max_rows=4) == sink.Pruned(
            4, 4, complete=False
        )
        assert len(read_findings(pg_dsn)) == 1  # committed already, batch by batch
        assert sink.prune(conn, "outbox", timedelta(days=30), batch=2, max_rows=4) == sink.Pruned(
            1, 1, complete=True
        )
    assert read_findings(pg_dsn) == []
    assert read_windows(pg_dsn) == []


def test_a_failed_retention_pass_is_tried_again_later(
    pg_dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The findings are written by then: a failed delete must not stop the job."""
    from spark import sink
    from spark.config import ReconcileSettings
    from spark.job import ReconcileJob

    # each pass bounds its own waits (a session's lock_timeout would not hold): 1 s, not 120 s
    monkeypatch.setattr(sink, "LOCK_TIMEOUT_S", 1)
    settings = ReconcileSettings(dsn=pg_dsn, bootstrap_servers="k", topics=("t",), checkpoint="c")
    job = ReconcileJob(settings, spark=None)  # type: ignore[arg-type]  # not needed to prune
    with sink.connect(pg_dsn) as conn:
        conn.execute("LOCK TABLE outbox.reconciliation_finding")  # held: the delete times out
        with sink.connect(pg_dsn) as other:
            job._prune(other)
    assert "tried again later" in caplog.text
    assert not job._prune_due()  # after PRUNE_EVERY_S, not at once


def test_a_retention_pass_cut_at_its_bound_goes_on_at_the_next_judgement(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spark import sink
    from spark.config import ReconcileSettings
    from spark.job import ReconcileJob

    monkeypatch.setattr(sink, "PRUNE_BATCH", 1)
    monkeypatch.setattr(sink, "PRUNE_MAX_ROWS", 1)
    long_ago = datetime.now(UTC) - timedelta(days=90)
    for n in range(2):
        write_aged(pg_dsn, finding_id=n, detected=timedelta(days=31), updated=timedelta(days=31),
                   window_at=long_ago + timedelta(minutes=n))  # fmt: skip
    settings = ReconcileSettings(dsn=pg_dsn, bootstrap_servers="k", topics=("t",), checkpoint="c")
    job = ReconcileJob(settings, spark=None)  # type: ignore[arg-type]  # not needed to prune
    with sink.connect(pg_dsn) as conn:
        conn.autocommit = True
        job._prune(conn)
        assert len(read_findings(pg_dsn)) == 1
        assert job._prune_due()  # more is due: at once, not after PRUNE_EVERY_S
        job._prune(conn)
        assert read_findings(pg_dsn) == []
        job._prune(conn)  # nothing left: complete
    assert not job._prune_due()


def finding_keys(dsn: str) -> list[tuple[str, int, str]]:
    return sorted((f.kind, f.outbox_id, f.occurrence) for f in read_findings(dsn))


def test_clean_run_then_five_faults_each_reported_once(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    relay_factory: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    orders, payments = topic_factory(partitions=2), topic_factory(partitions=1)
    markers = topic_factory(partitions=2)
    relay = RelayStandIn(pg_dsn, transactional_producer, markers)  # injects the faults
    now = datetime.now(UTC)
    clean_at, fault_at = now - timedelta(seconds=60), now - timedelta(seconds=30)

    # A clean run: 3 transactions, 24 records, shared keys, two topics.
    for t in range(3):
        publish(
            pg_dsn,
            [
                outbox.Record(orders if i % 3 else payments, {"t": t, "i": i}, key=f"c{i % 5}")
                for i in range(8)
            ],
        )
    # Records of a topic the job does not read: their markers and ledger rows are not judged
    # (each was a marker without its record, or missing).
    publish(pg_dsn, [outbox.Record(topic_factory(), "not watched", key=f"w{i}") for i in range(2)])
    # The real relay delivers them (keeping the ledger), then they age past the deadline.
    real_relay = relay_factory(
        op_marker_topic=markers, op_marker_partitions=2, delivered_retention="PT1H"
    )
    delivered, until = 0, time.monotonic() + 60
    while delivered < 26:  # another transaction in the cluster may hold the horizon a moment
        assert time.monotonic() < until, f"the relay delivered {delivered} of 26"
        delivered += real_relay.run_once().delivered
    # Judged once past the deadline, and summarised once their summary window has closed too.
    window_s = int(SUMMARY_WINDOW.removesuffix("s"))
    closes = (int(time.time()) // window_s + 1) * window_s
    time.sleep(max(0.0, closes + int(DEADLINE.removesuffix("s")) + 1 - time.time()))
    base = [
        "--dsn", pg_dsn, "--bootstrap", kafka_bootstrap, "--topics", f"{orders},{payments}",
        "--marker-topic", markers, "--deadline", DEADLINE, "--summary-window", SUMMARY_WINDOW,
    ]  # fmt: skip
    stream = [*base, "--checkpoint", str(tmp_path / "checkpoint"), "--once"]
    clean = reconcile(capsys, stream)
    assert (clean["copies"], clean["markers"]) == (24, 24)
    assert clean["found"] == dict.fromkeys(clean["found"], 0)
    assert read_findings(pg_dsn) == []
    windows = read_windows(pg_dsn)
    assert sum(w.records for w in windows) == 24
    assert all(w.findings == dict.fromkeys(w.findings, 0) for w in windows)
    assert all(w.latency_p50_ms is not None and w.latency_p50_ms >= 0 for w in windows)

    # Five faults, by writing directly to Kafka and Postgres.
    (dropped,) = publish(pg_dsn, [outbox.Record(orders, "dropped", key="f1")])
    relay.deliver([dropped], at=fault_at, copies=False, markers=False)
    first_clean = relay_rows(pg_dsn, orders)[0]
    relay.copy_again([first_clean], at=fault_at)  # duplicate
    with psycopg.connect(pg_dsn) as conn:
        half = outbox.Outbox(producer_group=GROUP).prepare(conn, payments, "orphan", key="f3")
        conn.commit()
        outbox.Outbox(producer_group=GROUP).rollback(conn, half.tx_id)
        conn.commit()
    (orphan,) = [r for r in all_rows(pg_dsn) if r.id == half.ids[0]]
    relay.copy_again([orphan], at=fault_at)
    (unmarked,) = publish(pg_dsn, [outbox.Record(orders, "unmarked", key="f4")])
    relay.deliver([unmarked], at=fault_at, markers=False)
    (first,) = publish(pg_dsn, [outbox.Record(orders, "first", key="pair")])
    (second,) = publish(pg_dsn, [outbox.Record(orders, "second", key="pair")])
    relay.deliver([second, first], at=fault_at)  # the later commit goes out first

    expected = sorted(
        [
            ("duplicate", first_clean.id),
            ("marker_mismatch", unmarked.id),
            ("missing", dropped.id),
            ("orphan", orphan.id),
            ("out_of_order", first.id),
        ]
    )
    faults = reconcile(capsys, stream)
    assert faults["found"] == dict.fromkeys(faults["found"], 1)
    assert faults["new"] == faults["found"]
    assert sorted((f.kind, f.outbox_id) for f in read_findings(pg_dsn)) == expected
    before = {(f.kind, f.outbox_id): (f.id, f.detected_in) for f in read_findings(pg_dsn)}

    # A restart that replays the last micro-batch (its commit is lost) repeats nothing.
    commits = tmp_path / "checkpoint" / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):  # the commit and Hadoop's checksum of it
        (commits / name).unlink(missing_ok=True)
    again = reconcile(capsys, stream)
    assert again["found"] == faults["found"]  # judged again...
    assert again["new"] == dict.fromkeys(again["new"], 0)  # ...and nothing new
    assert {(f.kind, f.outbox_id): (f.id, f.detected_in) for f in read_findings(pg_dsn)} == before

    # An audit of the same time with a batch read finds the same five, none new.
    audit = reconcile(
        capsys,
        [*base, "--from", (clean_at - timedelta(seconds=5)).isoformat(),
         "--to", (fault_at + timedelta(seconds=5)).isoformat()],
    )  # fmt: skip
    assert audit["found"] == faults["found"]
    assert audit["new"] == dict.fromkeys(audit["new"], 0)
    assert len(read_findings(pg_dsn)) == 5


def all_rows(dsn: str) -> list[Row]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id, producer_group, tx_id, topic, key, value FROM outbox.outbox_record"
            " ORDER BY id"
        ).fetchall()
    return [Row(*r) for r in rows]


def relay_rows(dsn: str, topic: str) -> list[Row]:
    return [r for r in all_rows(dsn) if r.topic == topic]


def wait_for_first_judgement(job: ReconcileJob) -> None:
    """Until the query's first micro-batch (what the topics held) has been judged."""
    until = time.monotonic() + 90
    while job.last_report is None:
        assert time.monotonic() < until, "the job did not judge its first micro-batch"
        time.sleep(0.2)


def judged_past(job: ReconcileJob, t: datetime) -> None:
    """Until the running job has judged everything up to `t`; fails at once if it stopped."""
    until = time.monotonic() + 90
    while job.last_report is None or job.last_report.window.store_low <= t:
        assert job.running, "the reconciliation query stopped"
        assert time.monotonic() < until, f"the job did not judge past {t}"
        time.sleep(0.2)


def running_settings(
    dsn: str, bootstrap: str, topic: str, markers: str, tmp_path: Path, **more: Any
) -> ReconcileSettings:
    """A continuous job with a short deadline, trigger and horizon."""
    from spark.config import ReconcileSettings

    return ReconcileSettings(
        dsn=dsn,
        bootstrap_servers=bootstrap,
        topics=(topic,),
        marker_topic=markers,
        checkpoint=str(tmp_path / "checkpoint"),
        **{
            "deadline": timedelta(seconds=2),
            # the records a test never delivers (its controls) are missing by the deadline too
            "undelivered_deadline": more.get("deadline", timedelta(seconds=2)),
            "trigger": timedelta(seconds=1),
            # Far beyond a test's run: with 2 minutes, a test that ran longer on a busy machine
            # would lose its observations to the trim (as the kill-mid-batch test once did).
            "horizon": timedelta(minutes=10),
            **more,
        },
    )


def test_continuous_job_reports_a_dropped_record_without_traffic(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spark.job import ReconcileJob

    monkeypatch.setattr("spark.job.PRUNE_EVERY_S", 0)  # the retention at every judgement

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    reports: list[RunReport] = []
    job = ReconcileJob(settings, spark, on_report=reports.append)
    job.start()
    job.start()  # a second start does nothing
    try:
        wait_for_first_judgement(job)
        write_aged(pg_dsn, finding_id=1, detected=timedelta(days=31), window_at=datetime.now(UTC)
                   - timedelta(days=40), updated=timedelta(days=31))  # fmt: skip
        until = time.monotonic() + 60
        while job.last_report.seconds.keys() != {"idle_check"}:  # type: ignore[union-attr]
            assert time.monotonic() < until, "no idle tick went without a judgement"
            time.sleep(0.2)
        assert read_findings(pg_dsn) == []  # an idle job applies its retention too
        (dropped,) = publish(pg_dsn, [outbox.Record(orders, "lost", key="k")])
        with psycopg.connect(pg_dsn) as conn:  # the relay says delivered; Kafka has nothing
            conn.execute(
                "UPDATE outbox.outbox_record SET state = 'delivered', commit_ts = now(),"
                " ended_at = now(), kafka_partition = 0, kafka_offset = 0 WHERE id = %s",
                (dropped.id,),
            )
        deadline = time.monotonic() + 90
        while not read_findings(pg_dsn, kinds=["missing"]):  # no traffic: an idle tick finds it
            assert time.monotonic() < deadline, "the dropped record was not reported"
            time.sleep(0.5)
    finally:
        job.stop()
        job.stop()  # so does a second stop
    (finding,) = read_findings(pg_dsn)
    assert (finding.kind, finding.outbox_id, finding.detected_in) == ("missing", dropped.id, "tick")
    # Its time, as the report and the judgement-duration metric give it, is all of it: building
    # the plan (a second or so) and finding what to read were left out.
    (found_it,) = [r for r in reports if r.new.get("missing")]
    assert {"prepare", "store", "ledger", "plan", "judge", "sink"} <= found_it.seconds.keys()

    # A restart goes on from where the last run judged (kept under the checkpoint), not from the
    # whole horizon again; the finding is not repeated.
    again = ReconcileJob(settings, spark)
    again.start()
    try:
        wait_for_first_judgement(again)
    finally:
        again.stop()
    assert again.last_report.window.windows_from is not None
    assert [f.id for f in read_findings(pg_dsn)] == [finding.id]


def test_reading_findings_of_an_unmigrated_schema_says_what_to_do(pg_dsn: str) -> None:
    from spark import ReconcileConfigError

    with pytest.raises(ReconcileConfigError, match="outboxctl migrate"):
        read_findings(pg_dsn, schema="not_migrated")


def test_ledger_coverage_starts_at_the_oldest_ended_row_that_is_not_parked(pg_dsn: str) -> None:
    """A parked row stays past any retention: counting it would make copies of records trimmed
    since then look unknown to the ledger (false orphans)."""
    from spark import sink

    (parked, delivered) = publish(
        pg_dsn, [outbox.Record("orders", "parked"), outbox.Record("orders", "delivered")]
    )
    long_ago = datetime.now(UTC) - timedelta(days=30)
    lately = datetime.now(UTC) - timedelta(minutes=5)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'parked', reason = 'too large',"
            " ended_at = %s WHERE id = %s",
            (long_ago, parked.id),
        )
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'delivered', ended_at = %s WHERE id = %s",
            (lately, delivered.id),
        )
    with sink.connect(pg_dsn) as conn:
        assert sink.oldest_ended(conn, "outbox") == lately


def test_a_running_job_judges_what_is_new_and_summarises_every_window_once(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    relay_factory: Callable[..., Any],
    tmp_path: Path,
) -> None:
    from spark.job import ReconcileJob

    orders, markers = topic_factory(partitions=2), topic_factory(partitions=2)
    # summary windows longer than the deadline straddle the judgements' boundaries
    settings = running_settings(
        pg_dsn, kafka_bootstrap, orders, markers, tmp_path, summary_window=timedelta(seconds=5)
    )
    relay = relay_factory(
        op_marker_topic=markers, op_marker_partitions=2, delivered_retention="PT1H"
    )
    # written before the retention (default 30 days): the job's first judgement deletes them
    write_aged(pg_dsn, finding_id=1, detected=timedelta(days=31), window_at=datetime.now(UTC)
               - timedelta(days=40), updated=timedelta(days=31))  # fmt: skip
    job = ReconcileJob(settings, spark)
    job.start()
    try:
        wait_for_first_judgement(job)
        published: list[Row] = []
        for burst in range(6):  # traffic across several micro-batches and summary windows
            if burst == 3:  # a restart: the open summary windows are carried over it
                job.stop()
                job = ReconcileJob(settings, spark)
                job.start()
                wait_for_first_judgement(job)
                assert job.last_report.window.latency_carried  # type: ignore[union-attr]
            published += publish(
                pg_dsn, [outbox.Record(orders, f"{burst}-{i}", key=f"k{i}") for i in range(4)]
            )
            delivered, until = 0, time.monotonic() + 60
            while delivered < 4:
                assert time.monotonic() < until, f"the relay delivered {delivered} of 4"
                delivered += relay.run_once().delivered
            time.sleep(0.8)
        RelayStandIn(pg_dsn, transactional_producer, markers).copy_again(
            [published[0]], at=datetime.now(UTC)
        )  # a duplicate, long after its original
        last_sent = datetime.now(UTC)
        closes = datetime.fromtimestamp((int(last_sent.timestamp()) // 5 + 1) * 5, UTC)
        until = time.monotonic() + 90
        while job.last_report.window.hi < closes:  # type: ignore[union-attr]
            assert time.monotonic() < until, "the job did not judge past the last window"
            time.sleep(0.2)
        last = job.last_report
    finally:
        job.stop()
    assert last is not None
    assert last.window.store_low > last.window.as_of - settings.horizon  # its context only
    assert [(f.kind, f.outbox_id) for f in read_findings(pg_dsn)] == [
        ("duplicate", published[0].id)
    ]  # and not the aged one
    windows = read_windows(pg_dsn)
    assert sum(w.records for w in windows) == len(published) == 24  # each canonical copy once


def test_a_running_job_finds_a_copy_stamped_long_before_it_arrived(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """A producer that retried through an outage appends records with an old Kafka time; the
    ledger row is due only now. The running job's context is what arrived lately, not what is
    stamped lately, so the copy is found; and a second copy, as old, is judged: a duplicate,
    although its Kafka time is before any window the job still judges."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    job = ReconcileJob(settings, spark)
    job.start()
    try:
        wait_for_first_judgement(job)
        (late, lost) = publish(
            pg_dsn, [outbox.Record(orders, "late", key="k"), outbox.Record(orders, "lost")]
        )  # `lost` never goes out: the control, reported missing
        stand_in = RelayStandIn(pg_dsn, transactional_producer, markers)
        long_ago = datetime.now(UTC) - timedelta(seconds=60)
        stand_in.deliver([late], at=long_ago)
        stand_in.copy_again([late], at=long_ago)
        with psycopg.connect(pg_dsn) as conn:  # ended now: due in the job's next judgements
            conn.execute(
                "UPDATE outbox.outbox_record SET ended_at = now() WHERE id = %s", (late.id,)
            )
            (ended,) = conn.execute(
                "SELECT ended_at FROM outbox.outbox_record WHERE id = %s", (late.id,)
            ).fetchone()  # type: ignore[misc]
        # Past the record's end, and until the duplicate is judged: on a loaded machine the
        # second copy can come a micro-batch after the first, and is judged late a deadline and
        # a trigger after that batch (the full suite once stopped the job before then).
        until = time.monotonic() + 90
        while (
            job.last_report.window.hi <= ended + timedelta(seconds=1)  # type: ignore[union-attr]
            or ("duplicate", late.id) not in kinds_found(pg_dsn)
        ):
            assert time.monotonic() < until, f"found only {kinds_found(pg_dsn)}"
            time.sleep(0.2)
        last = job.last_report
    finally:
        job.stop()
    assert last is not None
    assert last.window.windows_from is not None  # a judgement of what is new, not the horizon
    assert kinds_found(pg_dsn) == [("duplicate", late.id), ("missing", lost.id)]


def kinds_found(dsn: str) -> list[tuple[str, int]]:
    return sorted((f.kind, f.outbox_id) for f in read_findings(dsn))


def planned_reading(checkpoint: Path, topic: str, since: int = -1) -> int:
    """Until Spark plans a micro-batch after `since` that reads `topic` (its offset log entry
    gives the topic an end offset above 0); that batch's id."""
    until = time.monotonic() + 90
    while True:
        for entry in sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda e: int(e.name)):
            if int(entry.name) <= since:
                continue
            for line in entry.read_text().splitlines()[2:]:  # a line per source
                ends = json.loads(line).get(topic, {})
                if any(offset > 0 for offset in ends.values()):
                    return int(entry.name)
        assert time.monotonic() < until, f"no micro-batch read {topic}"
        time.sleep(0.05)


@pytest.mark.parametrize("first", ["marker", "copy"])
def test_a_late_transactions_marker_and_copy_read_a_micro_batch_apart_are_not_findings(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
    first: str,
) -> None:
    """A Kafka transaction's commit shows in each partition on its own, so one micro-batch can
    read a late transaction's marker and the next its copy (or the other way round). Its rows
    were deleted at once (delivered_retention 0): the ledger cannot answer for them. The marker
    is not reported without its copy, nor the copy without its marker; a late marker whose copy
    never comes is (the control)."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(
        pg_dsn, kafka_bootstrap, orders, markers, tmp_path, deadline=timedelta(seconds=4)
    )
    job = ReconcileJob(settings, spark)
    job.start()
    try:
        wait_for_first_judgement(job)
        split, lost = publish(
            pg_dsn, [outbox.Record(orders, "split", key="k"), outbox.Record(orders, "lost")]
        )
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "DELETE FROM outbox.outbox_record WHERE id = ANY(%s)", ([split.id, lost.id],)
            )
        stand_in = RelayStandIn(pg_dsn, transactional_producer, markers)
        long_ago = datetime.now(UTC) - timedelta(seconds=60)

        def send_markers() -> None:  # the split's claims the first offset of `orders`, its copy's
            stand_in.deliver(
                [split, lost], at=long_ago, copies=False, claimed_offset=0, ledger=False
            )

        sends = [send_markers, lambda: stand_in.copy_again([split], at=long_ago)]
        topics = [markers, orders]
        if first == "copy":
            sends.reverse()
            topics.reverse()
        sends[0]()
        batch = planned_reading(tmp_path / "checkpoint", topics[0])
        sends[1]()  # within a deadline of the first batch's write
        batch = planned_reading(tmp_path / "checkpoint", topics[1], since=batch)
        until = time.monotonic() + 90
        while (job._unread_from or 0) <= batch:  # until both batches' late ones are judged
            assert job.running, "the reconciliation query stopped"
            assert time.monotonic() < until, "the late observations were not judged"
            time.sleep(0.1)
    finally:
        job.stop()
    found = [(f.kind, f.outbox_id, f.occurrence) for f in read_findings(pg_dsn)]
    assert found == [("marker_mismatch", lost.id, "marker_without_record")]


def test_the_batches_waiting_to_judge_their_late_observations_outlast_a_restart(
    spark: SparkSession, pg_dsn: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Kept with judged_to under the checkpoint: a restart judges a waiting batch's late
    observations by the lo of the judgement that read it, not by its own (those stamped in
    between were judged by a window already). A checkpoint of a version before them has none."""
    from spark.job import _JUDGED_TO, ReconcileJob

    settings = running_settings(pg_dsn, kafka_bootstrap, "orders", "markers", tmp_path)
    (tmp_path / "checkpoint").mkdir()  # made by the query's start
    judged_to = datetime(2026, 1, 1, 12, tzinfo=UTC)
    job = ReconcileJob(settings, spark)
    job._unread_from, job._late_below = 7, {7: judged_to - timedelta(seconds=30), 8: judged_to}
    job._save_judged_to(judged_to, None)
    _, _, unread_from, late_below = ReconcileJob(settings, spark)._load_judged_to()
    assert (unread_from, late_below) == (7, job._late_below)

    saved = json.loads((tmp_path / "checkpoint" / _JUDGED_TO).read_text())
    del saved["late_below"]
    job._write_checkpoint_file(_JUDGED_TO, json.dumps(saved))
    assert ReconcileJob(settings, spark)._load_judged_to()[2:] == (7, {})


def test_a_row_a_relay_ends_long_after_its_kafka_commit_is_not_missing(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """The relay died after its Kafka commit, before it ended the row: the ledger says committed
    until a relay recovers it, and then delivered, ended now. Both times the copy is older than
    a judgement's context, and is still found: in the store, and by an audit of the end."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    job = ReconcileJob(settings, spark)
    job.start()
    try:
        wait_for_first_judgement(job)
        (shipped, lost) = publish(
            pg_dsn, [outbox.Record(orders, "shipped", key="k"), outbox.Record(orders, "lost")]
        )
        sent = datetime.now(UTC)
        stand_in = RelayStandIn(pg_dsn, transactional_producer, markers)
        (position,) = stand_in.deliver([shipped], at=sent, ledger=False).values()
        judged_past(job, sent + timedelta(seconds=1))
        stuck = job.last_report
        # the relay recovers: it ends the row from its marker
        with psycopg.connect(pg_dsn) as conn:
            (ended,) = conn.execute(
                "UPDATE outbox.outbox_record SET state = 'delivered', ended_at = now(),"
                " commit_ts = pg_xact_commit_timestamp(committed_xid::xid),"
                " kafka_partition = %s, kafka_offset = %s WHERE id = %s RETURNING ended_at",
                (*position, shipped.id),
            ).fetchone()  # type: ignore[misc]
        judged_past(job, ended + timedelta(seconds=1))
        recovered = job.last_report
    finally:
        job.stop()
    for report in (stuck, recovered):
        assert report is not None
        assert report.window.windows_from is not None  # what is new, not the whole horizon
    # only the row that never went out is reported
    assert [(f.kind, f.outbox_id) for f in read_findings(pg_dsn)] == [("missing", lost.id)]

    around_end = {
        "audit_from": ended - timedelta(seconds=1),
        "audit_to": ended + timedelta(seconds=1),
    }
    audit = settings.model_copy(update=around_end)
    report = ReconcileJob(audit, spark).audit()
    # the ledger read: the row ended in the window (its copy long before), and `lost`, still
    # waiting for the relay (an audit does not judge rows stuck before its window)
    assert report.ledger_rows == 2
    assert report.found_total == 0  # the late-ended row's copy was found


def test_an_audit_counts_how_long_a_record_waits_for_the_relay_to_now(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """An audit's as_of is --to plus the deadline: counted to it, a record committed in the
    last minutes before --to and still waiting for the relay had never waited long enough,
    however long it had been stuck (a review found it)."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()

    def committed_ago(value: str, ago: timedelta) -> tuple[int, datetime]:
        """A record waiting for the relay, committed `ago`."""
        (row,) = publish(pg_dsn, [outbox.Record(orders, value)])
        at = datetime.now(UTC) - ago
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "UPDATE outbox.outbox_record SET commit_ts = %s WHERE id = %s", (at, row.id)
            )
        return row.id, at

    waiting, committed_at = committed_ago("never sent", timedelta(minutes=20))
    settings = running_settings(
        pg_dsn, kafka_bootstrap, orders, markers, tmp_path,
        undelivered_deadline=timedelta(minutes=10),
        audit_from=committed_at - timedelta(minutes=1),
        audit_to=committed_at + timedelta(seconds=10),
    )  # fmt: skip
    report = ReconcileJob(settings, spark).audit()
    assert report.found == {"missing": 1}
    (found,) = read_findings(pg_dsn)
    assert (found.kind, found.outbox_id) == ("missing", waiting)
    # its wait, counted as the audit counted it (to as_of it was 12 s)
    assert found.detail["waited_s"] >= timedelta(minutes=20).total_seconds()

    # one that has waited 3 minutes is the relay's still, in an audit up to now
    committed_ago("committed 3 minutes ago", timedelta(minutes=3))
    up_to_now = {"audit_to": datetime.now(UTC) - timedelta(seconds=5)}
    report = ReconcileJob(settings.model_copy(update=up_to_now), spark).audit()
    assert report.found == {"missing": 1}  # `waiting` again, not `recent`
    assert [f.outbox_id for f in read_findings(pg_dsn)] == [waiting]


def test_a_row_ended_longer_than_the_horizon_after_its_kafka_commit_is_not_missing(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """A relay down for longer than --horizon between its Kafka commit and the end of its
    rows: their copies are older than anything the store keeps, and were reported missing
    (an audit of the same input found them). They are read back from Kafka."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    (shipped,) = publish(pg_dsn, [outbox.Record(orders, "shipped", key="k")])
    sent = datetime.now(UTC) - settings.horizon - timedelta(minutes=5)
    stand_in = RelayStandIn(pg_dsn, transactional_producer, markers)
    (position,) = stand_in.deliver([shipped], at=sent, ledger=False).values()
    ended = datetime.now(UTC) - 3 * settings.deadline  # more than a deadline ago: due now
    with psycopg.connect(pg_dsn) as conn:  # the relay is back: it ends the row from its marker
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'delivered', ended_at = %s,"
            " commit_ts = %s, kafka_partition = %s, kafka_offset = %s WHERE id = %s",
            (ended, sent - timedelta(seconds=1), *position, shipped.id),
        )
    report = ReconcileJob(settings, spark).run_once()
    assert report.ledger_rows == 1
    assert report.found_total == 0, read_findings(pg_dsn)


def test_once_runs_further_apart_than_they_judge_say_the_range_left_unjudged(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each --once run judges its horizon less two deadlines back from its start, not on from
    the last run: a CronJob run late (or scheduled too seldom) left records never judged,
    unsaid."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    judged = settings.horizon - 2 * settings.deadline
    now = datetime.now(UTC)
    starts = [now - 2 * judged, now - judged - settings.deadline, now]
    for start, close_enough in zip(starts, (True, True, False), strict=True):
        caplog.clear()
        ReconcileJob(settings, spark, clock=lambda at=start: at).run_once()
        gaps = [r.message for r in caplog.records if "are not judged" in r.message]
        assert len(gaps) == (0 if close_enough else 1), gaps
    (gap,) = gaps
    last_end = now - judged - 2 * settings.deadline  # the second run's range's end
    assert f"from {last_end.isoformat()} to {(now - judged - settings.deadline).isoformat()}" in gap


def test_a_checkpoint_made_for_other_topics_is_refused(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """Spark's Kafka source reads a partition its checkpoint has no offset for from the start:
    a topic added to the job's topics was read whole, its whole retention in one micro-batch
    (a fresh checkpoint starts one horizon back). The same topics in another order are the
    same source."""
    from spark._errors import ReconcileConfigError
    from spark.job import ReconcileJob

    orders, payments, markers = topic_factory(), topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    both = settings.model_copy(update={"topics": (orders, payments)})
    # a first run that read nothing (its query failed to start, say) pins nothing
    ReconcileJob(settings, spark)._check_source()
    assert (tmp_path / "checkpoint" / "source").exists()
    ReconcileJob(both, spark).run_once()
    ReconcileJob(both.model_copy(update={"topics": (payments, orders)}), spark).run_once()
    offsets_before = sorted((tmp_path / "checkpoint" / "offsets").iterdir())
    for other in (
        settings,  # a topic left out: fewer offsets, but not the checkpoint's
        settings.model_copy(update={"topics": (), "topic_pattern": re.escape(orders)}),
        both.model_copy(update={"marker_topic": topic_factory()}),
    ):
        with pytest.raises(ReconcileConfigError, match="Give a new --checkpoint") as refused:
            ReconcileJob(other, spark).run_once()
        assert (
            f"holds the offsets of the topics {', '.join(sorted([orders, payments, markers]))}"
            in str(refused.value)
        )
        job = ReconcileJob(other, spark)
        with pytest.raises(ReconcileConfigError):
            job.start()  # a running job too
        assert not job.running
    assert sorted((tmp_path / "checkpoint" / "offsets").iterdir()) == offsets_before  # not read
    fresh = settings.model_copy(update={"checkpoint": str(tmp_path / "new")})
    ReconcileJob(fresh, spark).run_once()


def test_a_watched_topic_deleted_stops_neither_the_job_nor_its_restart(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    kafka_admin: AdminClient,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With Spark's default failOnDataLoss, deleting one topic of the pattern failed the query,
    and every restart from its checkpoint failed the same way: no topic was reconciled any
    more until the checkpoint was thrown away."""
    from spark.job import ReconcileJob

    kept, markers = topic_factory(), topic_factory()
    dropped = f"{kept}.dropped"  # not the factory's: the test deletes it
    kafka_admin.create_topics([NewTopic(dropped, 1, 1)])[dropped].result(TIMEOUT_S)
    pattern = f"{re.escape(kept)}(?:{re.escape('.dropped')})?"
    settings = running_settings(pg_dsn, kafka_bootstrap, kept, markers, tmp_path).model_copy(
        update={"topics": (), "topic_pattern": pattern}
    )
    stand_in = RelayStandIn(pg_dsn, transactional_producer, markers)
    job = ReconcileJob(settings, spark)
    job.start()
    try:
        wait_for_first_judgement(job)
        before = publish(pg_dsn, [outbox.Record(kept, "k1"), outbox.Record(dropped, "d1")])
        sent = datetime.now(UTC)
        stand_in.deliver(before, at=sent)
        judged_past(job, sent + timedelta(seconds=1))  # both copies read and judged
        kafka_admin.delete_topics([dropped])[dropped].result(TIMEOUT_S)
        (after, lost) = publish(pg_dsn, [outbox.Record(kept, "k2"), outbox.Record(kept, "lost")])
        sent = datetime.now(UTC)
        stand_in.deliver([after], at=sent)
        judged_past(job, sent + timedelta(seconds=1))
    finally:
        job.stop()
    gone = [r.getMessage() for r in caplog.records if "left the Kafka source" in r.getMessage()]
    assert len(gone) == 1, gone
    assert f"{dropped}[0]" in gone[0]
    assert [(f.kind, f.outbox_id) for f in read_findings(pg_dsn)] == [("missing", lost.id)]

    job = ReconcileJob(settings, spark)  # from the checkpoint, whose offsets name the topic
    job.start()
    try:
        (again,) = publish(pg_dsn, [outbox.Record(kept, "k3")])
        sent = datetime.now(UTC)
        stand_in.deliver([again], at=sent)
        judged_past(job, sent + timedelta(seconds=1))
    finally:
        job.stop()
    assert [(f.kind, f.outbox_id) for f in read_findings(pg_dsn)] == [("missing", lost.id)]


def test_bad_topic_input_is_said_in_a_line(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    """A pattern Java cannot compile failed deep in the query, naming the job's own wrapping of
    it; an audit of a topic that does not exist ended in a Py4JJavaError and its JVM stack."""
    from spark._errors import ReconcileConfigError, ReconcileQueryError
    from spark.job import ReconcileJob

    markers = topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, "x", markers, tmp_path)
    bad = settings.model_copy(update={"topics": (), "topic_pattern": "orders\\.("})
    said = re.escape("--topic-pattern 'orders\\.(' is not a regular expression: Unclosed group")
    with pytest.raises(ReconcileConfigError, match=said):
        ReconcileJob(bad, spark).run_once()
    now = datetime.now(UTC)
    missing = f"{markers}.none"
    audit = settings.model_copy(
        update={"topics": (missing,), "audit_from": now - timedelta(minutes=1), "audit_to": now}
    )
    with pytest.raises(ReconcileQueryError, match=f"the audit of {missing} failed: ") as raised:
        ReconcileJob(audit, spark).audit()
    assert len(str(raised.value).splitlines()) == 1
    # a --once run's judgement, its ledger read refused: it was the Py4JJavaError too
    refused = running_settings(
        pg_dsn, kafka_bootstrap, topic_factory(), markers, tmp_path / "once",
        jdbc_url="jdbc:postgresql://127.0.0.1:1/nowhere",
    )  # fmt: skip
    with pytest.raises(ReconcileQueryError, match="the judgement failed: ") as raised:
        ReconcileJob(refused, spark).run_once()
    assert len(str(raised.value).splitlines()) == 1


ROOT = Path(__file__).resolve().parents[2]


def _job_argv(
    dsn: str,
    bootstrap: str,
    topic: str,
    markers: str,
    checkpoint: Path | None,
    jars: list[str],
    *more: str,
) -> list[str]:
    """`python -m spark.job` as a real process, with a short deadline. A horizon far beyond a
    test's run: a store batch checked at the end is trimmed once its observations are older
    than the horizon, which 2m was on a busy machine. No checkpoint: an audit."""
    where = [] if checkpoint is None else ["--checkpoint", str(checkpoint)]
    return [
        sys.executable, "-m", "spark.job", "--dsn", dsn, "--bootstrap", bootstrap,
        "--topics", topic, "--marker-topic", markers, "--deadline", "2s", "--horizon", "10m",
        *where, "--master", "local[2]", "--jars", ",".join(jars), *more,
    ]  # fmt: skip


def _job_env(**more: str) -> dict[str, str]:
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **more}


def test_a_job_killed_in_a_micro_batch_judges_it_once_after_a_restart(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    spark_jars: list[str],
    tmp_path: Path,
) -> None:
    """A real job process, SIGKILLed after it stored a micro-batch and before it judged it:
    Spark did not commit the batch, so a restart replays it (the store batch is written again,
    not twice) and reports what it holds, once: in the findings and in the metrics it serves."""
    orders, markers = topic_factory(), topic_factory()
    relay = RelayStandIn(pg_dsn, transactional_producer, markers)
    sent = datetime.now(UTC)
    clean = publish(pg_dsn, [outbox.Record(orders, f"v{i}", key=f"k{i}") for i in range(5)])
    relay.deliver(clean, at=sent)
    (dropped,) = publish(pg_dsn, [outbox.Record(orders, "dropped", key="d")])
    relay.deliver([dropped], at=sent, copies=False)  # marked delivered, never on the topic
    checkpoint = tmp_path / "checkpoint"
    argv = _job_argv(
        pg_dsn, kafka_bootstrap, orders, markers, checkpoint, spark_jars,
        "--trigger", "1s", "--log-level", "INFO",
    )  # fmt: skip
    env = _job_env()
    log = tmp_path / "job.log"
    with log.open("ab") as out:
        killed = subprocess.run(
            argv,
            env={**env, "OUTBOX_RELAY_FAILPOINT": "reconcile_after_store_write"},
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=180, check=False,
        )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, log.read_text(errors="replace")
    assert list((checkpoint / "observations").glob("batch-*/_SUCCESS"))  # stored...
    assert not (checkpoint / "commits" / "0").exists()  # ...not committed
    assert read_findings(pg_dsn) == []  # ...not judged

    port = free_port()
    serving = [*argv, "--http-host", "127.0.0.1", "--http-port", str(port)]
    with log.open("ab") as out:
        job = subprocess.Popen(serving, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            until = time.monotonic() + 300  # a new JVM and Spark session on a busy machine
            while not read_findings(pg_dsn) or _missing_counted(port) < 1:
                assert job.poll() is None, log.read_text(errors="replace")
                assert time.monotonic() < until, "the restarted job reported nothing"
                time.sleep(0.5)
            assert get(port, "/healthz") == (200, b'{"reconcile": true}')
            assert get(port, "/readyz")[0] == 200
            time.sleep(3)  # a few more triggers and idle judgements: nothing may come twice
            assert _missing_counted(port) == 1
        finally:  # Ctrl-C then a SIGTERM at once (as `make run`'s stop does): a clean exit
            job.send_signal(signal.SIGINT)
            job.send_signal(signal.SIGTERM)
            assert job.wait(60) == 0, log.read_text(errors="replace")
    assert [(f.kind, f.outbox_id) for f in read_findings(pg_dsn)] == [("missing", dropped.id)]
    assert len(list((checkpoint / "observations").glob("batch-*"))) >= 1


def _sigterm_at_the_query(argv: list[str], log: Path) -> str:
    """Runs the job until it stops (SIGSTOP) at its query, or an audit's read (failpoint
    reconcile_before_query), then sends SIGTERM, pending until its SIGCONT: the signal comes as
    the query starts. Asserts the exit status 143; returns what the job said."""
    with log.open("ab") as out:
        job = subprocess.Popen(
            argv,
            env=_job_env(OUTBOX_RELAY_FAILPOINT="reconcile_before_query:stop"),
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            until = time.monotonic() + 180
            while Path(f"/proc/{job.pid}/stat").read_text().split(") ")[1][0] != "T":
                assert job.poll() is None, log.read_text(errors="replace")
                assert time.monotonic() < until, "the job never came to its query"
                time.sleep(0.2)
            job.send_signal(signal.SIGTERM)
            job.send_signal(signal.SIGCONT)
            assert job.wait(120) == 128 + signal.SIGTERM, log.read_text(errors="replace")
        finally:
            job.kill()
    return log.read_text(errors="replace")


def test_a_once_run_stopped_by_sigterm_while_reading_exits_judging_nothing(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    spark_jars: list[str],
    tmp_path: Path,
) -> None:
    """A scheduled run's SIGTERM (a node drained, the CronJob's deadline): as a container's
    PID 1, a run without a handler ignored it until the kill after the grace period. Stopped
    while its query reads, it judges nothing (a judgement would call missing what it did not
    reach), says so, and exits 143, leaving its micro-batch to the next run."""
    orders, markers = topic_factory(), topic_factory()
    relay = RelayStandIn(pg_dsn, transactional_producer, markers)
    sent = datetime.now(UTC) - timedelta(seconds=30)  # past the deadline at once
    relay.deliver(publish(pg_dsn, [outbox.Record(orders, "v", key="k")]), at=sent)
    (dropped,) = publish(pg_dsn, [outbox.Record(orders, "dropped", key="d")])
    relay.deliver([dropped], at=sent, copies=False)
    checkpoint = tmp_path / "checkpoint"
    argv = _job_argv(pg_dsn, kafka_bootstrap, orders, markers, checkpoint, spark_jars, "--once")
    said = _sigterm_at_the_query(argv, tmp_path / "job.log")
    assert "stopped while reading Kafka: nothing judged" in said
    assert read_findings(pg_dsn) == []
    assert not (checkpoint / "once_judged_to").exists()
    # no micro-batch committed: the next run reads it all (a restart's replay of an uncommitted
    # batch is test_a_job_killed_in_a_micro_batch_judges_it_once_after_a_restart's)
    assert not (checkpoint / "commits" / "0").exists()


def test_an_audit_stopped_by_sigterm_exits_saying_its_report_is_not_complete(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    spark_jars: list[str],
    tmp_path: Path,
) -> None:
    """As a container's PID 1, an audit (--from/--to) had no handler and ignored a SIGTERM
    until the kill after the grace period. Its Spark jobs are cancelled now, and it exits 143
    saying that its report is not complete."""
    orders, markers = topic_factory(), topic_factory()
    relay = RelayStandIn(pg_dsn, transactional_producer, markers)
    sent = datetime.now(UTC) - timedelta(seconds=30)
    (dropped,) = publish(pg_dsn, [outbox.Record(orders, "dropped", key="d")])
    relay.deliver([dropped], at=sent, copies=False)  # a finding, were the audit to judge
    window = ["--from", (sent - timedelta(minutes=1)).isoformat(), "--to", sent.isoformat()]
    argv = _job_argv(pg_dsn, kafka_bootstrap, orders, markers, None, spark_jars)
    said = _sigterm_at_the_query([*argv, *window], tmp_path / "job.log")
    assert "the audit was stopped before its end" in said
    assert read_findings(pg_dsn) == []


def _missing_counted(port: int) -> float:
    """The job's outbox_reconcile_findings_total{kind="missing"}; 0 until it serves it."""
    code, text = get(port, "/metrics")
    if code != 200:
        return 0
    return next(
        s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "outbox_reconcile_findings_total" and s.labels == {"kind": "missing"}
    )


def test_run_forever_stops_when_asked_while_starting_or_running(
    spark: SparkSession, pg_dsn: str, kafka_bootstrap: str, topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:  # fmt: skip
    """`until` is what the job's SIGTERM/SIGINT handler sets. A request made before the query
    started is kept (start() clears the job's own stop flag: a request kept there was lost),
    and one made while it runs stops it; either way the query is stopped."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)

    def run(job: ReconcileJob, until: threading.Event) -> threading.Thread:
        runner = threading.Thread(target=job.run_forever, kwargs={"until": until}, daemon=True)
        runner.start()
        return runner

    early = ReconcileJob(settings, spark)
    asked_early = threading.Event()
    asked_early.set()
    runner = run(early, asked_early)
    runner.join(90)
    assert not runner.is_alive(), "a stop asked before the query started was lost"
    assert not early.running

    job, asked = ReconcileJob(settings, spark), threading.Event()
    runner = run(job, asked)
    try:
        wait_for_first_judgement(job)
        assert runner.is_alive()
        assert job.running
        asked.set()
        runner.join(60)
        assert not runner.is_alive(), "run_forever did not see the stop asked"
        assert not job.running
        assert not [q for q in spark.streams.active if q.isActive]
    finally:
        job.stop()


def _compilations(spark: SparkSession) -> int:
    """Classes Spark has compiled from its generated code so far (cache misses), in this JVM."""
    jvm: Any = spark.sparkContext._jvm
    return int(
        jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount()
    )


def test_a_judgement_run_again_reuses_the_code_spark_generated_for_it(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """With Spark's default of 100 cached classes, one judgement's ~130 evicted each other, and
    every judgement compiled them all again (spark.job.CODEGEN_CACHE_ENTRIES)."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    rows = publish(pg_dsn, [outbox.Record(orders, {"i": i}, key=f"k{i}") for i in range(3)])
    RelayStandIn(pg_dsn, transactional_producer, markers).deliver(
        rows, at=datetime.now(UTC) - timedelta(seconds=10)
    )
    compiled = []
    for run in ("first", "again"):  # a fresh checkpoint: the same data, the same plans
        before = _compilations(spark)
        settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path / run)
        report = ReconcileJob(settings, spark).run_once()
        assert (report.copies, report.found_total) == (3, 0)
        compiled.append(_compilations(spark) - before)
    # What is left is code with this judgement's own times in it (Spark writes them in): ~20
    # classes, where a cache that evicted them compiled all ~130 again. Not relative to the
    # first run: in a session that ran other judgements before, their code is cached already.
    assert compiled[1] <= 40, compiled


def test_each_copy_and_marker_is_counted_judged_once_however_many_judgements_see_it(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """The judged counters (and rate() on them, the dashboard's "copies judged a second") took
    every copy a judgement looked at, its context of one deadline before too: each copy was
    counted by ~13 judgements with the defaults (found by a review of the job's metrics)."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    deadline = settings.deadline
    now = datetime.now(UTC)
    rows = publish(pg_dsn, [outbox.Record(orders, {"i": i}, key=f"k{i}") for i in range(3)])
    # Due in the first judgement (before now - deadline), and in the next one's context (within
    # a deadline before where the first ends).
    RelayStandIn(pg_dsn, transactional_producer, markers).deliver(
        rows, at=now - deadline - deadline / 2
    )
    job = ReconcileJob(settings, spark, clock=lambda: now)
    first = job.run_once()
    assert (first.copies, first.copies_judged, first.markers_judged) == (3, 3, 3)
    with job._lock:  # as the continuous query's micro-batches call it
        following = job.judge(now + deadline / 2, "tick")
    assert following.window.lo == first.window.hi  # the next stretch, nothing judged again
    assert (following.copies, following.markers) == (3, 3)  # seen again, as its context
    assert (following.copies_judged, following.markers_judged) == (0, 0)


def test_stop_while_a_micro_batch_waits_for_a_judgement_returns(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """stop() stops Spark's query, which waits for the running micro-batch; the batch waits for
    the judgement lock. Here the batch asks for the lock exactly while stop() stops the query:
    had stop() held the lock then (as it once did), both waited for ever."""
    from spark.job import ReconcileJob

    orders, markers = topic_factory(), topic_factory()
    job = ReconcileJob(running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path), spark)
    armed, in_batch, stopping_query = threading.Event(), threading.Event(), threading.Event()
    on_batch = job._on_batch

    def held_batch(batch: Any, batch_id: int) -> None:
        if armed.is_set():
            in_batch.set()
            stopping_query.wait(60)  # on to the lock only once stop() stops the query
        on_batch(batch, batch_id)

    job._on_batch = held_batch  # type: ignore[method-assign]
    job.start()
    stopper = threading.Thread(target=job.stop, daemon=True)
    try:
        wait_for_first_judgement(job)
        query = job._query
        assert query is not None
        stop_query = query.stop

        def stop() -> None:
            stopping_query.set()
            stop_query()

        query.stop = stop  # type: ignore[method-assign]
        armed.set()
        rows = publish(pg_dsn, [outbox.Record(orders, "x", key="k")])  # a micro-batch with data
        RelayStandIn(pg_dsn, transactional_producer, markers).deliver(rows, at=datetime.now(UTC))
        assert in_batch.wait(60), "no micro-batch came"
        stopper.start()
        stopper.join(90)
        assert not stopper.is_alive(), "stop() and the micro-batch wait for each other"
        assert stopping_query.is_set()
    finally:
        if not stopper.is_alive():
            job.stop()


def test_a_micro_batchs_kafka_read_runs_a_task_per_partition_and_stores_few_files(
    spark: SparkSession,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path: Path,
) -> None:
    """The store's write of a micro-batch ran under coalesce(2): its whole Kafka read in two
    tasks (on a cluster as on local[2], where one core read a partition alone at the end).
    Now each partition is a task of its own, and the store still gets few files."""
    from spark.job import STORE_FILES_PER_BATCH, ReconcileJob

    orders, markers = topic_factory(partitions=4), topic_factory()
    rows = publish(pg_dsn, [outbox.Record(orders, {"i": i}, key=f"k{i}") for i in range(40)])
    positions = RelayStandIn(pg_dsn, transactional_producer, markers).deliver(
        rows, at=datetime.now(UTC)
    )
    assert len({partition for partition, _ in positions.values()}) == 4
    settings = running_settings(pg_dsn, kafka_bootstrap, orders, markers, tmp_path)
    job = ReconcileJob(settings, spark)
    batch = (
        spark.read.format("kafka")
        .options(**settings.kafka_source_options())
        .option("startingOffsets", "earliest")
        .load()
    )
    job._run_as_of = datetime.now(UTC)  # stored, judged later: as an availableNow run's batches
    group = f"store-write-{os.getpid()}-{time.monotonic_ns()}"
    spark.sparkContext.setJobGroup(group, "a micro-batch's store write")
    try:
        job._on_batch(batch, 0)
    finally:
        spark.sparkContext._jsc.clearJobGroup()
    tracker = spark.sparkContext.statusTracker()

    def tasks_per_stage() -> list[int] | None:
        """None until Spark's status store (fed by its listener bus, a moment behind) has
        every job of the group done."""
        tasks = []
        for job_id in tracker.getJobIdsForGroup(group):
            info = tracker.getJobInfo(job_id)
            if info is None or info.status != "SUCCEEDED":
                return None
            stages = [tracker.getStageInfo(stage_id) for stage_id in info.stageIds]
            tasks += [stage.numTasks for stage in stages if stage is not None]
        return tasks or None

    deadline = time.monotonic() + 30
    while (tasks := tasks_per_stage()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tasks is not None, "the store write's jobs were not reported done in 30 s"
    assert max(tasks) >= 5, tasks  # the four partitions of the topic and the markers' one
    stored = Path(job._store(), "batch-000000000000")
    assert 0 < len(list(stored.glob("*.parquet"))) <= STORE_FILES_PER_BATCH
    assert spark.read.parquet(str(stored)).count() == 40 + 40  # the copies and their markers
