"""The reconciliation job: Kafka, the observation store, the ledger and the findings sink, wired.

Three ways to run it, all with the transformations of `spark/transform.py`:

  streaming   `--checkpoint DIR [--trigger 10s]`: a Structured Streaming query reads the delivered
              topics and the op-marker topic (read_committed, with headers); every micro-batch
              appends its observations to the store under the checkpoint and judges what became
              due since the last judgement, with one deadline of context around it (a new
              checkpoint's first judgement judges the whole horizon: JudgeWindow.following);
              between batches an idle tick judges after each trigger that found nothing new,
              so a dropped record is reported within deadline + two trigger intervals even
              when no traffic comes (as long as one judgement takes less than a trigger
              interval: bench/reconcile.py measures both); a tick whose window holds no
              observation and no due ledger row skips Spark (two cheap look-ups instead).
  once        `--checkpoint DIR --once`: the same query with Trigger.AvailableNow, then one
              judgement; the next run resumes from the checkpoint.
  audit       `--from T1 --to T2`: a batch read of Kafka for the window, no checkpoint.

Exactly once into the sink: a micro-batch writes its observations to `batch-<id>` (overwritten
when Spark replays the batch after a restart) and findings are merged on their natural key, so
neither a replay nor a repeated judgement writes a finding twice (`spark/sink.py`). State stays
bounded: observations older than the horizon are deleted, ledger reads are bounded by time
(`spark/queries.sql`); findings not found again and summary windows not written for longer
than --findings-retention are deleted.

On a cluster (the connector, its Kafka client and the JDBC driver as local jars; the driver's
Python needs this project's dependencies -- psycopg, pydantic -- e.g. `pip install
'kafka-outbox-sidecar[spark]'` on the submitting host in client mode; executors run only Spark's
built-in functions and need none of our Python code):

    mkdir -p dist && python -m zipfile -c dist/outbox_spark.zip spark outbox relay
    eval "$(scripts/services env)"    # or set OUTBOX_SPARK_JARS to your local jar paths
    spark-submit \\
        --master spark://master:7077 --deploy-mode client \\
        --jars "$OUTBOX_SPARK_JARS" \\
        --py-files dist/outbox_spark.zip \\
        --conf spark.sql.shuffle.partitions=8 \\
        spark/job.py \\
        --dsn "postgresql://reconciler@db:5432/app" --schema outbox \\
        --bootstrap kafka:9092 --topic-pattern 'orders\\..*' \\
        --marker-topic outbox.op-markers --deadline 60s --trigger 10s \\
        --checkpoint hdfs:///checkpoints/outbox-reconcile

`$OUTBOX_SPARK_JARS` is the comma-separated list printed by `scripts/services.py spark-jars`:
spark-sql-kafka-0-10_2.13, spark-token-provider-kafka-0-10_2.13, kafka-clients, commons-pool2 and
postgresql (the JDBC driver). With the pip-installed PySpark of this project's virtualenv the
same command is `PATH=.venv/bin:$PATH spark-submit --master 'local[2]' ...` (its launcher finds
Spark through `python3` on the PATH). Without spark-submit: `python -m spark.job ... --jars
"$OUTBOX_SPARK_JARS"` runs on local[*] (or --master).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import psycopg
from py4j.protocol import Py4JJavaError
from pydantic import ValidationError
from pyspark import SparkConf, SparkContext
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.errors.exceptions.captured import CapturedException
from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import LongType, StructField, StructType

from relay import _failpoints
from relay.markers import outbox_name
from relay.signals import StopOnSignals
from spark import _sql, sink, transform
from spark._errors import (
    ReconcileConfigError,
    ReconcileError,
    ReconcileQueryError,
    ReconcileStopped,
)
from spark.config import (
    FINDING_KINDS,
    JudgeWindow,
    ReconcileSettings,
    offset_log_time,
    parse_duration,
    parse_time,
    spark_interval,
    trigger_end,
)
from spark.kafka_properties import BOOTSTRAP
from spark.kafka_properties import load as load_kafka_properties
from spark.latency import OpenWindows, close, merge_rows
from spark.vanished import VanishedPartitions

# Named, not __name__: run as a script (`python -m spark.job`, `spark-submit spark/job.py`) that
# is __main__, outside the `spark` logger whose level --log-level sets.
logger = logging.getLogger("spark.job")

QUERY_NAME = "outbox_reconcile"
STORE_DIR = "observations"
# Files a micro-batch's observations are written to: few, for the judgements' reads of the store.
# A shuffle gets there (its rows are small, the records' values dropped), not coalesce(), which
# ran the whole Kafka read in that many tasks: two on a cluster, a partition left for one core.
STORE_FILES_PER_BATCH = 2
STORE_SCHEMA = StructType([*transform.OBSERVATION_SCHEMA.fields, StructField("batch", LongType())])
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EXIT_FINDINGS = 3  # with --fail-on-findings
# Spark compiles the code it generates once per distinct class and keeps the last 100 (its
# default). One judgement and its micro-batch generate ~130, which evicted one another before
# each came round again: every judgement compiled all of them anew (~1 s of driver time, and
# code that the JVM had to warm up again). 1000 holds many judgements' worth. A static
# setting: it counts only in a session this job creates (spark-submit's included); a session
# made before the job (a notebook's) needs it set where it is made.
CODEGEN_CACHE_ENTRIES = ("spark.sql.codegen.cache.maxEntries", "1000")
# PySpark's DataFrame debugging (on by default) sends the Python call site of every Column
# call (F.col's too) to the JVM: ~6 more round trips each, ~2,000 a judgement, which took half
# of the 2.3 s a judgement spent building its plan. Spark's errors still name the failing
# expression; only the line of ours that built it is left out. PySpark reads it once a process,
# at the first Column call: like the cache's size, it counts in a session this job creates.
DATAFRAME_DEBUGGING = ("spark.python.sql.dataFrameDebugging.enabled", "false")
# Files of the job's own under the checkpoint: where a running job judged to (and its open
# summary windows), and where the last --once run did.
_JUDGED_TO, _ONCE_JUDGED_TO = "judged_to", "once_judged_to"
_SOURCE = "source"  # what the checkpoint's offsets are of: see ReconcileJob._check_source
# The ledger window is read by this many JDBC connections at most (one per core of the job, no
# more than this): one task took most of a judgement's ledger step, the cores idle. Each runs the
# window's query for its share of ids, so more would only load the application's database.
LEDGER_READ_PARTITIONS = 4
PRUNE_EVERY_S = 600  # the retention is days: deleting more often than this finds nothing new


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _from_micros(us: int | None) -> datetime | None:
    return None if us is None else EPOCH + timedelta(microseconds=us)


def _millis(t: datetime) -> str:
    return str(int(t.timestamp() * 1000))


@dataclass(frozen=True)
class RunReport:
    """What one judgement saw and found (`format()` for people, `as_dict()` for --json)."""

    detected_in: str
    window: JudgeWindow
    copies: int
    markers: int
    ledger_rows: int
    found: dict[str, int]
    new: dict[str, int]
    windows: list[dict[str, Any]] = field(default_factory=list)
    coverage_start: datetime | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage
    # Of `copies` and `markers`, those whose Kafka time is in [lo, hi): each is judged by one
    # judgement of a running job, where the others see it again as context (metrics.py).
    copies_judged: int = 0
    markers_judged: int = 0

    @property
    def found_total(self) -> int:
        return sum(self.found.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "detected_in": self.detected_in,
            **self.window.as_dict(),
            "copies": self.copies,
            "markers": self.markers,
            "copies_judged": self.copies_judged,
            "markers_judged": self.markers_judged,
            "ledger_rows": self.ledger_rows,
            "found": {k: self.found.get(k, 0) for k in FINDING_KINDS},
            "new": {k: self.new.get(k, 0) for k in FINDING_KINDS},
            "coverage_start": self.coverage_start.isoformat() if self.coverage_start else None,
            "windows": [
                {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in w.items()}
                for w in self.windows
            ],
            "seconds": self.seconds,
        }

    def format(self) -> str:
        def t(value: datetime) -> str:
            return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")

        kinds = "  ".join(f"{k} {self.found.get(k, 0)}" for k in FINDING_KINDS)
        lines = [
            f"outbox reconcile ({self.detected_in}): as of {t(self.window.as_of)} UTC, "
            f"judged {t(self.window.lo)} .. {t(self.window.hi)}",
            f"  seen      {self.copies:,} copies on the topics, {self.markers:,} op markers, "
            f"{self.ledger_rows:,} ledger rows",
            f"  findings  {self.found_total} ({sum(self.new.values())} new)  {kinds}",
        ]
        if self.windows:
            records = sum(w["records"] for w in self.windows)
            worst = max(self.windows, key=lambda w: w["latency_p99_ms"] or 0.0)
            lines.append(
                f"  latency   {len(self.windows)} windows, {records:,} records; worst window "
                f"{t(worst['window_start'])}: p50 {worst['latency_p50_ms']:.1f} ms, "
                f"p95 {worst['latency_p95_ms']:.1f} ms, p99 {worst['latency_p99_ms']:.1f} ms, "
                f"max {worst['latency_max_ms']:.1f} ms"
            )
        return "\n".join(lines)


def build_session(settings: ReconcileSettings) -> tuple[SparkSession, bool]:
    """The active session if there is one (spark-submit, a notebook, tests), else a new one.

    Returns (session, owned): stop it only if owned. Outside spark-submit the master defaults to
    local[*]; spark-submit's own --master wins.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    if SparkContext._active_spark_context is not None:  # running, though not in this thread
        return SparkSession.builder.getOrCreate(), False
    builder = SparkSession.builder.appName("outbox-reconcile")
    master = settings.master
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit
        master = "local[*]"
    if master is not None:
        builder = builder.master(master)
    if settings.jars:
        builder = builder.config("spark.jars", ",".join(settings.jars))
    if settings.shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    given: set[str] = set()
    if submitted:
        # connected first: before that, SparkConf() is an empty one of Python's own, and the
        # --conf given to spark-submit (the JVM's system properties) were overridden unseen
        SparkContext._ensure_initialized()
        given = {key for key, _ in SparkConf().getAll()}
    for key, value in session_defaults(submitted=submitted, given=given):
        builder = builder.config(key, value)
    return builder.getOrCreate(), True


def session_defaults(*, submitted: bool, given: set[str]) -> list[tuple[str, str]]:
    """The settings a session this job creates gets: under spark-submit the JVM is up and holds
    the --conf given (`given`, their keys): a value given there wins."""
    defaults = [
        conf for conf in (CODEGEN_CACHE_ENTRIES, DATAFRAME_DEBUGGING) if conf[0] not in given
    ]
    if not submitted:  # `outboxctl reconcile` in a terminal: progress bars buried its report
        defaults.append(("spark.ui.showConsoleProgress", "false"))
    return defaults


class ReconcileJob:
    """One reconciliation job: `run_once()`, `audit()`, or `start()` / `stop()` / `run_forever()`.

    `clock` is injectable (tests); every time the job judges by comes from it.
    """

    def __init__(
        self,
        settings: ReconcileSettings,
        spark: SparkSession,
        clock: Callable[[], datetime] = _utcnow,
        on_report: Callable[[RunReport], None] | None = None,
    ) -> None:
        self.settings = settings
        self.spark = spark
        self._clock = clock
        self._on_report = on_report  # every judgement's report, idle ones too (the metrics)
        self._lock = threading.Lock()  # one judgement at a time: micro-batches and idle ticks
        self._outbox: str | None = None  # "<database>/<schema>", as the relay's markers name it
        self._query: StreamingQuery | None = None
        self._ticker: threading.Thread | None = None
        self._stopping = threading.Event()
        self._failure: BaseException | None = None
        self._last_judged = clock()
        self._last_as_of: datetime | None = None
        # Up to where a running job has judged: kept under the checkpoint, so that a restart
        # goes on from there instead of judging the whole horizon again.
        self._judged_to: datetime | None = None
        # The summary windows open at `_judged_to`, with the latencies counted so far (kept with
        # it): the next judgement adds to them instead of reading their copies again.
        self._open_windows: OpenWindows | None = None
        # The first store batch whose late observations no judgement has judged yet, and of
        # the batches from there that a judgement read, the time before which an observation
        # of theirs was stamped before any window judged it (the first reading judgement's lo).
        self._unread_from: int | None = None
        self._late_below: dict[int, datetime] = {}
        self._continuous = False
        self._batch_newest: dict[int, int] = {}  # store batch -> its newest observation (µs)
        self._written_at: dict[int, datetime] = {}  # store batch -> when it was written
        self._run_as_of: datetime | None = None  # availableNow: the run's start
        self._query_started: datetime | None = None  # continuous: the query's start
        self.last_report: RunReport | None = None
        self._pruned_at: float | None = None  # time.monotonic() of the last retention pass
        # how stale a finding found again may be left: well inside a short retention too
        retention = settings.findings_retention
        self._seen_every: timedelta | None = (  # None: this role may not move it on
            sink.SEEN_EVERY if retention is None else min(sink.SEEN_EVERY, retention / 2)
        )
        self._vanished = VanishedPartitions()

    # --- running ----------------------------------------------------------------------------

    def run_once(self) -> RunReport:
        """Read what Kafka holds now (Trigger.AvailableNow), then judge once."""
        if self.settings.audit:
            raise ReconcileConfigError("an audit (--from/--to) runs with audit()")
        self._check_source()
        self._say_a_checkpoint_not_shared()
        as_of = self._clock()  # availableNow reads up to the offsets of its start
        window = JudgeWindow.streaming(as_of, self.settings.deadline, self.settings.horizon)
        self._say_a_gap_since_the_last_run(window)
        self._run_as_of = as_of
        self._stopping.clear()
        query = None
        _failpoints.hit(_failpoints.RECONCILE_BEFORE_QUERY)
        try:
            query = self._start_query(available_now=True)
            with self._lock:
                self._query = query  # for stop(): a SIGTERM to a --once run stops it
            try:
                self._await(query)
            except ReconcileQueryError:
                if not self._stopping.is_set():
                    raise
                # stop() failed the micro-batch in progress (it runs again at the next start)
            if self._stopping.is_set():
                # Read up to somewhere short of as_of: a judgement would call missing what
                # the query did not reach.
                raise ReconcileStopped(
                    "stopped while reading Kafka: nothing judged; the next run reads on from "
                    "the checkpoint"
                )
            self._vanished.see_all(
                (s.startOffset, s.endOffset) for p in query.recentProgress for s in p.sources
            )
        finally:
            self._run_as_of = None
            with self._lock:
                self._query = None
            if query is not None and query.isActive:
                # interrupted (a Ctrl-C, a py4j error): left running, its later micro-batches
                # were judged as a continuous job's, on a session not the job's own
                query.stop()
        # said in a line, as an audit's is: a ledger read that fails (a login the JDBC driver
        # is refused, its read timeout) came out as a Py4JJavaError with the JVM's stack
        with self._lock, _query_failure("the judgement"):
            report = self.judge(as_of, "final")
        self._write_checkpoint_file(_ONCE_JUDGED_TO, window.hi.isoformat())
        return report

    def start(self) -> None:
        """Start the continuous query and the idle ticker; returns at once."""
        if self._query is not None:
            return
        self._check_source()
        self._say_a_checkpoint_not_shared()
        self._stopping.clear()
        self._failure = None
        self._last_judged = self._clock()
        self._continuous = True
        self._judged_to, self._open_windows, unread_from, late_below = self._load_judged_to()
        if unread_from is not None:  # a batch Spark replays was read (and counted) before
            self._unread_from = unread_from
            self._late_below = late_below
        self._query_started = self._clock()  # before any trigger of the query reads Kafka
        self._query = self._start_query(available_now=False)
        self._ticker = threading.Thread(target=self._tick_loop, name="reconcile-tick", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        """Stop the query and the ticker. A second stop does nothing."""
        self._stopping.set()
        with self._lock:  # let a judgement in progress finish rather than interrupt it
            query, self._query = self._query, None
        # Not under the lock: Spark's stop waits for a micro-batch that may be waiting for the
        # lock (it then sees _stopping and fails, uncommitted); holding it, both waited forever.
        if query is not None and query.isActive:
            query.stop()
        ticker, self._ticker = self._ticker, None
        if ticker is not None and ticker is not threading.current_thread():
            ticker.join(timeout=60)

    @property
    def judged_to(self) -> datetime | None:
        """Records of times before this are judged: by the last judgement, or before this
        run's first, by the checkpoint's (None: never judged, or not started)."""
        return self._judged_to

    @property
    def last_trigger_end(self) -> datetime | None:
        """When the continuous query's last trigger ended (one ends every trigger interval,
        with or without traffic); None before the first."""
        query = self._query
        progress = query.lastProgress if query is not None else None
        if progress is None:
            return None
        try:
            return trigger_end(progress.timestamp, progress.durationMs)
        except ValueError:
            return None

    @property
    def alive(self) -> bool:
        """For a liveness probe: nothing failed, and the query runs unless it is not started
        yet or being stopped. Asking the query is a call into the JVM: a JVM that does not
        answer leaves the probe without an answer."""
        if self._failure is not None:
            return False
        query = self._query
        return query is None or self._stopping.is_set() or query.isActive

    @property
    def running(self) -> bool:
        """The continuous query runs, and the idle judgement has not failed."""
        query = self._query
        return query is not None and query.isActive and self._failure is None

    def run_forever(self, until: threading.Event | None = None) -> None:
        """start(), then wait until the query ends, stop() is called or `until` is set; raise
        what failed. `until` is how a signal handler asks: setting it calls nothing in Spark,
        and start() does not clear it, so a request made while the job starts is kept."""
        self.start()
        query = self._query
        try:
            while (
                query is not None
                and not self._stopping.is_set()
                and not (until is not None and until.is_set())
            ):
                try:
                    if self._await(query, timeout_s=1):
                        break
                except ReconcileQueryError:
                    if not self._stopping.is_set():  # else: a batch refused to start, fine
                        raise
            if self._failure is not None:
                raise ReconcileQueryError("the idle judgement failed") from self._failure
        finally:
            self.stop()

    def audit(self) -> RunReport:
        """Judge the window --from .. --to with a batch read of Kafka (no checkpoint)."""
        preparing = time.perf_counter()
        start, end = self.settings.audit_from, self.settings.audit_to
        if start is None or end is None:
            raise ReconcileConfigError("an audit needs --from and --to")
        window = JudgeWindow.audit(start, end, self._clock(), self.settings.deadline)
        # from the oldest commit of a row due in the window too (a deadline of margin for the
        # clocks of relay and database): a row the relay ended late has its copy from back then
        oldest = self._oldest_due(window)
        since = (
            window.store_low
            if oldest is None
            else min(window.store_low, oldest - self.settings.deadline)
        )
        _failpoints.hit(_failpoints.RECONCILE_BEFORE_QUERY)
        with _connector_needed():
            kafka = self._audit_read(since)
        read = self._observations(kafka).where(F.col("ts") <= F.lit(window.as_of))
        read = read.withColumn("batch", F.lit(None).cast("long"))
        obs = read.where(F.col("ts") >= F.lit(window.store_low))
        late = read.where(F.col("ts") < F.lit(window.store_low))
        read_what = self.settings.topic_pattern or ", ".join(self.settings.topics)
        with self._lock, _query_failure(f"the audit of {read_what}"):
            prepared_in = time.perf_counter() - preparing
            return self._judge(obs, window, "audit", late=late, prepared_in=prepared_in)

    def _source_options(self) -> dict[str, str]:
        """Spark's Kafka source options, the topic pattern checked first."""
        if self.settings.topic_pattern is not None:
            _check_pattern(self.spark, self.settings.topic_pattern)
        _redact_secret_options(self.spark)
        return self.settings.kafka_source_options()

    def _audit_read(self, since: datetime, until: datetime | None = None) -> DataFrame:
        read = (
            self.spark.read.format("kafka")
            .options(**self._source_options())
            .option("startingTimestamp", _millis(since))
            .option("startingOffsetsByTimestampStrategy", "latest")
        )
        if until is None:
            # not endingTimestamp: Kafka finds times by its index, in which a transaction's
            # commit marker carries the broker's time; up to the end, then filtered, is exact
            return read.option("endingOffsets", "latest").load()
        return read.option("endingTimestamp", _millis(until)).load()

    def _beyond_the_store(
        self, late: DataFrame, oldest_due: datetime, as_of: datetime
    ) -> DataFrame:
        """`late` with what Kafka holds from before the store's reach that rows due now need:
        a relay that ended its rows more than --horizon after its Kafka commit (down that
        long in between) left their copies older than anything the store keeps, and those
        rows were reported missing. Read back from Kafka as an audit does (a deadline of
        margin for the clocks of relay and database), only while such rows are due."""
        kept_from = as_of - self.settings.horizon  # older observations are not stored
        since = oldest_due - self.settings.deadline
        if since >= kept_from:
            return late
        logger.info(
            "rows due now committed at %s, before what the store keeps (%s): reading their "
            "copies back from Kafka",
            oldest_due.isoformat(),
            kept_from.isoformat(),
        )
        with _connector_needed():
            # an upper bound with a deadline of margin (Kafka's time index is not exact), then
            # only what the store does not hold
            kafka = self._audit_read(since, until=kept_from + self.settings.deadline)
        back = self._observations(kafka).where(F.col("ts") < F.lit(kept_from))
        back = back.withColumn("batch", F.lit(None).cast("long"))
        return late.unionByName(back, allowMissingColumns=True)

    # --- the streaming query ----------------------------------------------------------------

    def _checkpoint(self) -> str:
        if self.settings.checkpoint is None:
            raise ReconcileConfigError("a streaming run needs --checkpoint")
        return self.settings.checkpoint.rstrip("/")

    def _store(self) -> str:
        return f"{self._checkpoint()}/{STORE_DIR}"

    def _start_query(self, *, available_now: bool) -> StreamingQuery:
        # a progress report for every trigger that finds nothing new (see _idle_as_of)
        self.spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "0")
        # A new checkpoint starts one horizon back; a checkpoint's own offsets win after that.
        start_ms = _millis(self._clock() - self.settings.horizon)
        with _connector_needed():
            stream = (
                self.spark.readStream.format("kafka")
                .options(**self._source_options())
                .option("startingTimestamp", start_ms)
                .option("startingOffsetsByTimestampStrategy", "latest")
                # a watched topic deleted must not stop the job for good (spark/vanished.py)
                .option("failOnDataLoss", "false")
                .load()
            )
        writer = (
            stream.writeStream.queryName(QUERY_NAME)
            .foreachBatch(self._on_batch)
            .option("checkpointLocation", self._checkpoint())
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=spark_interval(self.settings.trigger))
        return writer.start()

    def _await(self, query: StreamingQuery, timeout_s: int | None = None) -> bool:
        try:
            if timeout_s is None:
                query.awaitTermination()
                return True
            return bool(query.awaitTermination(timeout_s))
        except StreamingQueryException as exc:
            raise ReconcileQueryError(f"the reconciliation query failed: {exc}") from exc

    def _observations(self, kafka: DataFrame) -> DataFrame:
        return transform.observations(
            kafka,
            marker_topic=self.settings.marker_topic,
            ignored_topics=self.settings.not_deliveries,
            topics=self.settings.topics,
            topic_pattern=self.settings.topic_pattern,
            outbox=self._outbox_name(),
            former_outboxes=self.settings.former_outbox_names,
        )

    def _outbox_name(self) -> str:
        """This ledger's outbox as the relay names it in its markers (asked of the database
        once: a pooler's database alias is not the name)."""
        if self._outbox is None:
            with sink.connect(self.settings.dsn.get_secret_value(), write=False) as conn:
                row = conn.execute("SELECT current_database()").fetchone()
            self._outbox = outbox_name(row[0] if row else "", self.settings.schema_name)
        return self._outbox

    def _on_batch(self, batch: DataFrame, batch_id: int) -> None:
        """foreachBatch: store the batch's observations (replay-safe), then judge."""
        with self._lock:
            if self._stopping.is_set():  # fail the batch: it is not committed, so it runs again
                raise _Stopping("the reconciliation is stopping")
            as_of = self._run_as_of or self._batch_as_of(self._clock(), self._planned_at(batch_id))
            obs = self._observations(batch).where(
                F.col("ts") >= F.lit(as_of - self.settings.horizon)
            )
            newest = Observation(f"batch-{batch_id}")  # computed by the write itself
            (
                obs.withColumn("batch", F.lit(batch_id).cast("long"))
                .observe(newest, F.unix_micros(F.max("ts")).alias("newest"))
                .repartition(STORE_FILES_PER_BATCH)
                .write.mode("overwrite")
                .parquet(f"{self._store()}/batch-{batch_id:012d}")
            )
            self._written_at.pop(batch_id, None)  # written (again, if replayed) just now
            if self._unread_from is None:  # an earlier run judged the batches before its first
                self._unread_from = batch_id
            _failpoints.hit(_failpoints.RECONCILE_AFTER_STORE_WRITE)
            self._batch_newest[batch_id] = newest.get.get("newest") or 0  # 0: empty, trimmed
            if self._run_as_of is not None:  # availableNow: judged once, at the end
                return
            if self._last_as_of is not None and as_of <= self._last_as_of:
                return  # an idle tick already judged as far: nothing new is known
            self.judge(as_of, f"batch {batch_id}", current_batch=batch_id)

    def _batch_as_of(self, now: datetime, planned: datetime | None = None) -> datetime:
        """Up to when the running micro-batch has read Kafka completely.

        Not `now`: a trigger fixes the offsets it reads when it starts, and a slow micro-batch
        reaches foreachBatch seconds later; after a restart Spark replays the batch it had
        planned before, with the offsets of then. Records committed meanwhile are not in it and
        must not be judged missing yet. `planned`: when Spark planned it (its offset log entry).
        Without that, a lower bound: the trigger started after the previous one ended (its
        progress is reported once it is done), or after the query started.
        """
        if planned is not None:
            return min(planned, now)
        query = self._query
        progress = query.lastProgress if query is not None else None
        started = self._query_started or now
        if progress is None:
            return min(started, now)
        return min(max(started, trigger_end(progress.timestamp, progress.durationMs)), now)

    def _tick_loop(self) -> None:
        poll = min(1.0, self.settings.trigger.total_seconds() / 2)
        while not self._stopping.wait(poll):
            try:
                self._tick()
            except Exception as exc:
                logger.exception("idle judgement failed; stopping the reconciliation")
                self._failure = exc
                self._stopping.set()
                query = self._query
                if query is not None and query.isActive:
                    query.stop()

    def _tick(self) -> None:
        """Judge between micro-batches (no traffic): after each trigger that found nothing new,
        at most about once per trigger interval."""
        query = self._query
        progress = query.lastProgress if query is not None else None
        if progress is not None:
            self._vanished.see_all((s.startOffset, s.endOffset) for s in progress.sources)
        gap = self.settings.trigger / 2
        if self._clock() - self._last_judged < gap:
            return
        with self._lock:
            now = self._clock()
            as_of = self._idle_as_of(now)
            if now - self._last_judged < gap or self._stopping.is_set() or as_of is None:
                return  # a micro-batch judged meanwhile, or no trigger has ended yet
            if self._last_as_of is not None and as_of <= self._last_as_of:
                return  # no trigger since the last judgement: nothing new is known
            self.judge(as_of, "tick", skip_if_idle=True)

    def _idle_as_of(self, now: datetime) -> datetime | None:
        """Up to when Kafka has been read completely: the start of the last trigger that ended.

        A trigger reads what was committed when it started, and its progress is reported once
        its micro-batch (store write and judgement included) is done. The query reports every
        trigger that finds nothing new too (noDataProgressEventInterval is 0), so without traffic
        this is at most one interval old. Not "now minus an interval": a micro-batch can take
        longer than the interval, and what was committed meanwhile is not read yet.
        """
        query = self._query
        progress = query.lastProgress if query is not None else None
        if progress is None:
            return None
        try:
            as_of = min(parse_time(progress.timestamp), now)
        except ValueError:
            return None
        if progress.numInputRows > 0:  # it ran a batch: maybe one planned before a restart
            planned = self._planned_at(progress.batchId)
            if planned is not None:
                as_of = min(as_of, planned)
        return as_of

    def _planned_at(self, batch_id: int) -> datetime | None:
        """When Spark planned micro-batch `batch_id` (config.offset_log_time); None if unknown."""
        jvm: Any = self.spark._jvm
        try:
            path = jvm.org.apache.hadoop.fs.Path(f"{self._checkpoint()}/offsets/{batch_id}")
            fs = path.getFileSystem(self.spark._jsc.hadoopConfiguration())
            if not fs.exists(path):
                return None
            stream = fs.open(path)
            try:
                text = str(jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
            finally:
                stream.close()
        except Exception:  # py4j's errors: the lower bound of _batch_as_of serves then
            logger.debug("offset log entry of batch %s not readable", batch_id, exc_info=True)
            return None
        return offset_log_time(text)

    # --- judging ----------------------------------------------------------------------------

    def judge(
        self,
        as_of: datetime,
        detected_in: str,
        *,
        current_batch: int | None = None,
        skip_if_idle: bool = False,
    ) -> RunReport:
        """Judge what became due up to `as_of` from the observation store; trim the store.

        `skip_if_idle` (idle ticks): when the window can hold no finding and no summary window
        (see _idle), report it judged without running Spark. An empty judgement costs seconds
        of both cores; idle, one came every trigger interval.
        """
        settings = self.settings
        carried = self._open_windows
        window = JudgeWindow.following(
            self._judged_to,
            as_of,
            settings.deadline,
            settings.horizon,
            settings.summary_window,
            latency_from=None if carried is None else carried.counted_from,
        )
        self._last_as_of = as_of
        if self._judged_to is not None and self._judged_to < window.lo:
            # Observations older than the horizon are gone: that stretch is never judged.
            logger.warning(
                "records that became due from %s to %s are not judged: the job last judged up "
                "to %s, longer ago than --horizon (%s) allows; audit that range with --from/--to",
                self._judged_to.isoformat(),
                window.lo.isoformat(),
                self._judged_to.isoformat(),
                settings.horizon,
            )
        preparing = time.perf_counter()  # a tick found not idle: its check is preparation
        if skip_if_idle and window.windows_from is not None and self._idle(window):
            return self._judged_idle(window, detected_in, time.perf_counter() - preparing)
        oldest_due = self._oldest_due(window)
        batches = self._store_batches()  # the lock keeps writes out
        last_read = max(batches, default=None)
        # Observations stamped before the judged range, in a batch no judgement had read: they
        # arrived late (a producer retrying through an outage, a Kafka transaction held open),
        # and no window judged them. Read first now: counted into the summary windows still
        # open (LATE_READ). Judged a deadline (and a trigger) after their batch's write
        # (LATE_JUDGED, see late_due_batches). Not in a judgement of the whole horizon: there
        # what is before the range is what lacks its context (older ones are gone).
        judges_late = self._unread_from is not None and window.windows_from is not None
        unread_from = self._unread_from or 0
        late_due: dict[int, datetime] = {}
        late_below: dict[int, datetime] = {}  # read, their late observations not judged yet
        if judges_late:
            written = {batch_id: at for batch_id, (_path, at) in batches.items()}
            late_due = late_due_batches(
                written, unread_from, self._late_below, self._late_due_by(window), window.lo
            )
            late_below = {
                batch_id: self._late_below.get(batch_id, window.lo)
                for batch_id in batches
                if batch_id >= unread_from and batch_id not in late_due
            }
        first_read = {
            batch_id: window.lo
            for batch_id in (*late_due, *late_below)
            if batch_id not in self._late_below
        }
        if window.windows_from is None:  # the whole horizon
            store = self._read_store()
        else:
            # The store batches written since the context's start (a batch holds what was
            # appended before it was written; a trigger interval of margin for the clocks of
            # file system and job), or since the oldest commit of a row due now, if older: a
            # row a relay ended late (down between its Kafka commit and the end of its rows)
            # has its copy in a batch written back then. And what arrived with the first batch
            # judged late: see _counterparts_since.
            since = min(window.store_low, oldest_due or window.store_low)
            if late_due:
                since = min(since, self._counterparts_since(batches, min(late_due)))
            store = self._read_store(written_since=since - settings.trigger)
        if judges_late:
            store = store.withColumn(transform.LATE_JUDGED, _stamped_before(late_due))
            store = store.withColumn(transform.LATE_READ, _stamped_before(first_read))
        # The context by Kafka time, and the observations stamped before it: late arrivals and
        # the copies of rows ended late, which answer ledger rows due now.
        obs = store.where(F.col("ts") >= F.lit(window.store_low))
        late = store.where(F.col("ts") < F.lit(window.store_low))
        if oldest_due is not None:
            late = self._beyond_the_store(late, oldest_due, as_of)
        counted = None  # the copies the carried summary windows lack: new ones, late ones
        if window.latency_carried:
            counted = F.col("ts") >= F.lit(window.lo)
            if transform.LATE_READ in store.columns:
                counted = counted | F.coalesce(F.col(transform.LATE_READ), F.lit(False))
        next_unread = min(late_below, default=None if last_read is None else last_read + 1)
        # Kept by the trim: what this micro-batch wrote, what is still to be judged late, and
        # what will be read with it.
        keep = [b for b in (current_batch, next_unread) if b is not None]
        if next_unread in batches:
            reach = self._counterparts_since(batches, next_unread) - settings.trigger
            keep += [batch_id for batch_id, (_path, at) in batches.items() if at >= reach]
        keep_from = min(keep, default=None)
        report = self._judge(
            obs,
            window,
            detected_in,
            trim_before=keep_from,
            late=late,
            counted=counted,
            prepared_in=time.perf_counter() - preparing,
        )
        if next_unread is not None:
            self._unread_from = next_unread
            self._late_below = late_below
        self._judged_to = window.hi
        if self._continuous:  # a --once run judges its whole horizon every time
            self._save_judged_to(window.hi, self._open_windows)
        return report

    def _counterparts_since(self, batches: dict[int, tuple[str, datetime]], first: int) -> datetime:
        """Since when the store batches that may hold the counterparts of batch `first`'s late
        observations were written: the batch before it (a transaction's commit shows in each
        partition on its own, a moment apart, so its marker and copy can be read by two
        micro-batches in a row, however long these take) and those written within a deadline
        before it. Those after it are read anyway (they were written before the judgement)."""
        since = batches[first][1] - self.settings.deadline
        before = [batch_id for batch_id in batches if batch_id < first]
        return min(since, batches[max(before)][1]) if before else since

    def _late_due_by(self, window: JudgeWindow) -> datetime:
        """A store batch written by then has its late observations judged (late_due_batches):
        a deadline before `as_of`, less a trigger interval of margin for the clocks of file
        system and job."""
        return window.as_of - self.settings.deadline - self.settings.trigger

    def _idle(self, window: JudgeWindow) -> bool:
        """Nothing to judge: no observation since the window's context began (no copy or marker
        to judge, no summary window to close), none in a batch no judgement read (a late
        arrival, counted while its summary window is open), none in a batch whose late
        observations are due (late_due_batches), no carried summary window that closes, and no
        ledger row it may call missing (with include_stuck, that is no committed row at all)."""
        carried = self._open_windows
        if carried is not None and any(w.end <= window.hi for w in carried.windows.values()):
            return False
        batches = self._store_batches()
        unread_from = self._unread_from
        due: dict[int, datetime] = {}
        if unread_from is not None:
            written = {batch_id: at for batch_id, (_path, at) in batches.items()}
            due_by = self._late_due_by(window)
            due = late_due_batches(written, unread_from, self._late_below, due_by, window.lo)
        for batch_id, (_path, written_at) in batches.items():
            known = self._batch_newest.get(batch_id)
            unread = unread_from is not None and batch_id >= unread_from
            if unread and known != 0 and (batch_id in due or batch_id not in self._late_below):
                return False  # not empty (0), and read first now or due
            # an earlier run's batch: its write time bounds it, with the store's clock margin
            newest = written_at + self.settings.trigger if known is None else _from_micros(known)
            if newest is None or newest >= window.store_low:
                return False
        return self._oldest_due(window) is None

    def _judged_idle(self, window: JudgeWindow, detected_in: str, seconds: float) -> RunReport:
        """What a judgement of an idle window would have done: move on, find nothing."""
        self._judged_to = window.hi  # the carried windows lack nothing: nothing arrived
        if self._continuous:
            self._save_judged_to(window.hi, self._open_windows)
        self._last_judged = self._clock()
        if self._prune_due():  # a job idle for days still applies its retention
            with sink.connect(self.settings.dsn.get_secret_value()) as conn:
                conn.autocommit = True
                self._prune(conn)
        report = RunReport(
            detected_in=detected_in,
            window=window,
            copies=0,
            markers=0,
            ledger_rows=0,
            found={},
            new={},
            seconds={"idle_check": round(seconds, 3)},
        )
        logger.debug("reconciliation: idle, nothing to judge: %s", report.format())
        self._reported(report)
        return report

    def _reported(self, report: RunReport) -> None:
        self.last_report = report
        if self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:  # what watches the job must not stop it
                logger.exception("the report's listener failed")

    def _oldest_due(self, window: JudgeWindow) -> datetime | None:
        with sink.connect(self.settings.dsn.get_secret_value()) as conn:
            return sink.oldest_due(
                conn,
                self.settings.schema_name,
                window.lo,
                window.hi,
                window.include_stuck,
                self.settings.topics or None,  # named: only theirs (a pattern: every topic)
            )

    def _checkpoint_file(self, name: str) -> Any:
        jvm: Any = self.spark._jvm
        return jvm.org.apache.hadoop.fs.Path(f"{self._checkpoint()}/{name}")

    def _read_checkpoint_file(self, name: str) -> tuple[str, str] | None:
        """A small file of the job's own beside Spark's checkpoint (its path, its text), or
        None when there is none."""
        path = self._checkpoint_file(name)
        fs = path.getFileSystem(self.spark._jsc.hadoopConfiguration())
        if not fs.exists(path):
            return None
        jvm: Any = self.spark._jvm
        try:
            stream = fs.open(path)
            try:
                text = jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
            finally:
                stream.close()
        except Py4JJavaError as exc:  # unreadable (a checksum that does not match): as none
            logger.warning("ignored %s: it cannot be read (%s)", path.toString(), exc)
            return None
        return str(path.toString()), str(text).strip()

    def _write_checkpoint_file(self, name: str, text: str) -> None:
        """Written whole or not at all (Spark's own checkpoint files' way: a temporary file
        renamed), whatever the file system: overwritten in place, a kill mid-write left it
        unreadable, and the restart judged the whole horizon, late arrivals of unread batches
        never judged."""
        jvm: Any = self.spark._jvm
        path = self._checkpoint_file(name)
        files = jvm.org.apache.spark.sql.execution.streaming.CheckpointFileManager.create(
            path.getParent(), self.spark._jsc.hadoopConfiguration()
        )
        files.mkdirs(path.getParent())  # a fresh checkpoint's first file comes before Spark's
        out = files.createAtomic(path, True)
        try:
            out.writeBytes(text)
        except BaseException:
            out.cancel()
            raise
        out.close()

    def _say_a_checkpoint_not_shared(self) -> None:
        """Warn of a checkpoint on each machine's own disk on a cluster (spark.job's docs)."""
        context = self.spark.sparkContext
        default_fs = context._jsc.hadoopConfiguration().get("fs.defaultFS")
        master = context.master or "local"
        if local_checkpoint_on_a_cluster(master, self._checkpoint(), default_fs):
            logger.warning(
                "--checkpoint %s is on each machine's own disk (file:) and the master %s is "
                "not local: the executors write the observation store there and the driver "
                "reads it, so unless it is a volume mounted on every node, the judgements find "
                "an empty store and report every delivered record missing. Put it on a file "
                "system all share (hdfs://, s3a://, ...)",
                self._checkpoint(),
                master,
            )

    def _check_source(self) -> None:
        """Refuse a checkpoint made for other topics. Spark's Kafka source reads a partition its
        checkpoint has no offset for from its earliest one: a topic added to --topics (or
        matched by a new --topic-pattern, or a new --marker-topic) was read whole, all its
        retention in one micro-batch, while a fresh checkpoint starts one --horizon back.
        Written by the first run of a checkpoint (one of an older version: adopted as it is).
        A --topic-pattern's topic made later is read from its start all the same: the whole of
        a new topic's short life.
        """
        options = self.settings.kafka_source_options()
        subscribed = {
            k: (sorted(v.split(",")) if k == "subscribe" else v)
            for k, v in options.items()
            if k in ("subscribe", "subscribePattern")
        }
        found = self._read_checkpoint_file(_SOURCE)
        if found is None or not self._has_offsets():
            # a first run that read nothing (failed on a mistyped topic, say) pins nothing
            self._write_checkpoint_file(_SOURCE, json.dumps(subscribed))
            return
        path, text = found
        try:
            saved = json.loads(text)
        except ValueError:
            saved = None
        if saved == subscribed:
            return

        def said(source: Any) -> str:
            if not isinstance(source, dict):
                return repr(text[:200])
            if "subscribe" in source:
                return "the topics " + ", ".join(map(str, source["subscribe"]))
            return f"the topics matching {source.get('subscribePattern')!r}"

        raise ReconcileConfigError(
            f"the checkpoint {self._checkpoint()} holds the offsets of {said(saved)} ({path}), "
            f"and this run reads {said(subscribed)} (topics, pattern and op-marker topic): "
            "Spark would read a topic new to it from its start, all of its retention at once. "
            "Give a new --checkpoint: it starts one --horizon back, and findings written "
            "already are not written again"
        )

    def _has_offsets(self) -> bool:
        """Whether Spark has planned a micro-batch in the checkpoint (offsets/<n>)."""
        path = self._checkpoint_file("offsets")
        fs = path.getFileSystem(self.spark._jsc.hadoopConfiguration())
        if not fs.exists(path):
            return False
        return any(str(st.getPath().getName()).isdigit() for st in fs.listStatus(path))

    def _load_judged_to(
        self,
    ) -> tuple[datetime | None, OpenWindows | None, int | None, dict[int, datetime]]:
        """Where an earlier run judged to, the summary windows it left open, the first store
        batch whose late observations it did not judge and, of the batches from there it read,
        what was late in them (None, {}: a checkpoint of a version before them; the first
        judgement counts the open windows' copies again, and takes its own lo for late)."""
        found = self._read_checkpoint_file(_JUDGED_TO)
        if found is None:
            return None, None, None, {}
        path, text = found
        try:
            if not text.startswith("{"):  # written by a version without open windows
                return parse_time(text), None, None, {}
            saved = json.loads(text)
            open_windows = saved.get("open_windows")
            carried = None if open_windows is None else OpenWindows.from_json(open_windows)
            unread_from = saved.get("unread_from")
            late_below = saved.get("late_below") or {}
            return (
                parse_time(saved["judged_to"]),
                None if carried is None else self._carried(carried),
                None if unread_from is None else int(unread_from),
                {int(batch): parse_time(low) for batch, low in late_below.items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.warning("ignored %s: not a judged time (%r)", path, text[:200])
            return None, None, None, {}

    def _carried(self, windows: OpenWindows) -> OpenWindows | None:
        """The open windows a restart carries on, unless --summary-window changed: carried, the
        new windows' counts were added to the old ones of the same start, and windows of both
        sizes overlapped in the sink, their findings counted twice."""
        other = {w.end - w.start for w in windows.windows.values()} - {self.settings.summary_window}
        if not other:
            return windows
        logger.warning(
            "--summary-window is now %s, not the %s of the windows the last run left open: "
            "those are not summarised, and the job counts anew from its next judgement",
            self.settings.summary_window,
            ", ".join(sorted(map(str, other))),
        )
        return None

    def _save_judged_to(self, hi: datetime, open_windows: OpenWindows | None) -> None:
        saved = {
            "judged_to": hi.isoformat(),
            "open_windows": None if open_windows is None else open_windows.as_json(),
            "unread_from": self._unread_from,
            "late_below": {str(b): low.isoformat() for b, low in self._late_below.items()},
        }
        self._write_checkpoint_file(_JUDGED_TO, json.dumps(saved))

    def _say_a_gap_since_the_last_run(self, window: JudgeWindow) -> None:
        """A --once run judges its whole horizon, not on from the last run: runs further apart
        than the horizon less two deadlines leave records due between them never judged."""
        found = self._read_checkpoint_file(_ONCE_JUDGED_TO)
        if found is None:
            return
        path, text = found
        try:
            last = parse_time(text)
        except ValueError:
            logger.warning("ignored %s: not a judged time (%r)", path, text[:200])
            return
        if last < window.lo:
            logger.warning(
                "records that became due from %s to %s are not judged: the last --once run "
                "judged up to %s, and each run judges --horizon less two --deadline (%s) back "
                "from its start; run them closer together, and audit that range with "
                "--from/--to",
                last.isoformat(),
                window.lo.isoformat(),
                last.isoformat(),
                window.hi - window.lo,
            )

    def _store_batches(self) -> dict[int, tuple[str, datetime]]:
        """The store's batch directories: batch id -> (path, when it was written)."""
        jvm: Any = self.spark._jvm  # Hadoop's FileSystem: the store may be on HDFS, S3, ...
        root = jvm.org.apache.hadoop.fs.Path(self._store())
        fs = root.getFileSystem(self.spark._jsc.hadoopConfiguration())
        if not fs.exists(root):
            return {}
        found: dict[int, tuple[str, datetime]] = {}
        for status in fs.listStatus(root):
            name = status.getPath().getName()
            if status.isDirectory() and name.startswith("batch-") and name[6:].isdigit():
                batch_id = int(name[6:])
                written = self._written_at.get(batch_id)
                if written is None:
                    written = self._written_at[batch_id] = self._batch_written(fs, status)
                found[batch_id] = (status.getPath().toString(), written)
        return found

    def _batch_written(self, fs: Any, status: Any) -> datetime:
        """When a store batch was written: its _SUCCESS file's time, not the directory's (an
        object store such as S3 gives a directory no time of its own, 0); unknown: now, so that
        it is read and kept rather than skipped and deleted."""
        jvm: Any = self.spark._jvm
        success = jvm.org.apache.hadoop.fs.Path(status.getPath(), "_SUCCESS")
        millis = fs.getFileStatus(success).getModificationTime() if fs.exists(success) else 0
        millis = millis or status.getModificationTime()
        return EPOCH + timedelta(milliseconds=millis) if millis > 0 else self._clock()

    def _delete(self, path: str) -> None:
        jvm: Any = self.spark._jvm
        p = jvm.org.apache.hadoop.fs.Path(path)
        p.getFileSystem(self.spark._jsc.hadoopConfiguration()).delete(p, True)

    def _read_store(self, written_since: datetime | None = None) -> DataFrame:
        paths = [
            path
            for path, written in self._store_batches().values()
            if written_since is None or written >= written_since
        ]
        if not paths:
            return _empty(self.spark, STORE_SCHEMA)
        return self.spark.read.schema(STORE_SCHEMA).parquet(*paths)

    def _read_ledger(
        self,
        window: JudgeWindow,
        obs: DataFrame,
        conn: psycopg.Connection[Any],
        cached: list[DataFrame],
    ) -> tuple[DataFrame, bool]:
        """The ledger rows of the window (JDBC) plus those of other ids seen on Kafka (psycopg).

        Returns (ledger, complete): not complete when more ids were seen than max_lookup_ids;
        then no id may be called unknown. The window is read once (persisted, added to
        `cached`): the ids looked up and the judgement see the same rows.
        """
        s = self.settings
        url, props = s.jdbc()
        query = _sql.text(
            "ledger_window",
            self.settings.schema_name,
            ended_from=window.store_low,
            ended_until=window.as_of + self.settings.horizon,
        )
        parts = min(self.spark.sparkContext.defaultParallelism, LEDGER_READ_PARTITIONS)
        window_rows = (
            self.spark.read.jdbc(
                url,
                f"({query}) AS ledger_window",
                predicates=[f"id % {parts} = {n}" for n in range(parts)],
                properties={**props, "fetchsize": "10000"},
            )
            .select([F.col(f.name).cast(f.dataType) for f in transform.LEDGER_SCHEMA.fields])
            # records of the topics it reads only: the others' were all called missing (and
            # the judgement leaves them out of the missing ones: see transform.judge)
            .where(transform.watched(F.col("topic"), s.topics, s.topic_pattern, s.not_deliveries))
        ).persist()
        cached.append(window_rows)
        others = (
            obs.select("outbox_id")
            .distinct()
            .join(window_rows.select(F.col("id").alias("outbox_id")), "outbox_id", "left_anti")
        )
        limit = self.settings.max_lookup_ids
        ids = [row.outbox_id for row in others.limit(limit + 1).collect()]
        complete = len(ids) <= limit
        if not complete:
            logger.warning(
                "more than %d ids seen on Kafka are not in the ledger window: looked up %d, "
                "unknown ids are not judged this time",
                limit,
                limit,
            )
        rows = sink.ledger_rows_by_ids(conn, self.settings.schema_name, ids[:limit])
        if not rows:
            return window_rows, complete
        looked_up = self.spark.createDataFrame(rows, transform.LEDGER_SCHEMA)
        ledger = window_rows.unionByName(looked_up).dropDuplicates(["id"]).persist()
        cached.append(ledger)
        return ledger, complete

    def _seen_refused(self, why: str) -> None:
        """Said once: the findings are written, and retention deletes them by first detection."""
        self._seen_every = None
        logger.warning(
            "findings found again keep the time they were first found (%s): --findings-retention "
            "then deletes a finding of a record still stuck, and the next judgement writes it as "
            "new; grant this role UPDATE (last_seen_at) on reconciliation_finding (`outboxctl "
            "grants`)",
            why,
        )

    def _prune_due(self) -> bool:
        return self.settings.findings_retention is not None and (
            self._pruned_at is None or time.monotonic() - self._pruned_at >= PRUNE_EVERY_S
        )

    def _prune(self, conn: psycopg.Connection[Any]) -> None:
        """Apply --findings-retention: at the first judgement, then every PRUNE_EVERY_S.

        A role granted before the retention existed may not delete: that is said once, and the
        job goes on without it (its findings matter more than their retention). Any other
        failure (a lock or statement timeout, a lost connection) is tried again later: it must
        not stop a job whose findings are written already, at every restart.
        """
        retention = self.settings.findings_retention
        if retention is None or not self._prune_due():
            return
        self._pruned_at = time.monotonic()
        try:
            pruned = sink.prune(conn, self.settings.schema_name, retention)
        except psycopg.errors.InsufficientPrivilege as exc:
            logger.warning(
                "findings are kept for ever: this role may not delete them (%s); grant it "
                "DELETE on reconciliation_finding and reconciliation_window (`outboxctl "
                "grants`), or pass --findings-retention none",
                exc.diag.message_primary,
            )
            self._pruned_at = float("inf")  # not again in this run
            return
        except psycopg.Error as exc:
            logger.warning("findings retention: deleting failed, tried again later: %s", exc)
            return
        if not pruned.complete:  # a table that grew for long: more at the next judgement
            self._pruned_at = None
        if pruned.findings or pruned.windows:
            logger.info(
                "deleted %d findings and %d summary windows written more than %s ago "
                "(--findings-retention)%s",
                pruned.findings,
                pruned.windows,
                retention,
                "" if pruned.complete else "; more at the next judgement",
            )

    def _coverage(self, conn: psycopg.Connection[Any]) -> datetime | None:
        """Since when the ledger still has every row (see transform.classify_copies)."""
        deadline = self.settings.deadline
        if self.settings.ledger_retention is not None:
            if self.settings.ledger_retention <= timedelta(0):
                return None
            return self._clock() - self.settings.ledger_retention + deadline
        oldest = sink.oldest_ended(conn, self.settings.schema_name)
        return None if oldest is None else oldest + deadline

    def _judge(
        self,
        obs: DataFrame,
        window: JudgeWindow,
        detected_in: str,
        *,
        trim_before: int | None = None,
        late: DataFrame | None = None,
        counted: Column | None = None,
        prepared_in: float | None = None,
    ) -> RunReport:
        """`prepared_in`: the seconds the caller took to find what to read (the report's
        "prepare"): the report's times and the duration metric, their sum, count it too."""
        settings = self.settings
        started = self._clock()
        timings: dict[str, float] = {}
        if prepared_in is not None:
            timings["prepare"] = round(prepared_in, 3)
        clock = _Stopwatch(timings)
        obs = obs.persist()
        cached: list[DataFrame] = [obs]
        try:
            in_window = (F.col("ts") >= F.lit(window.lo)) & (F.col("ts") < F.lit(window.hi))
            with clock("store"):  # one pass: the counts for the report and the trim
                batches = (
                    obs.groupBy("batch", "source")
                    .agg(
                        F.count(F.lit(1)).alias("n"),
                        F.count(F.when(in_window, True)).alias("judged"),
                        F.unix_micros(F.max("ts")).alias("newest"),
                    )
                    .collect()
                )
            seen: Counter[str] = Counter()
            judged: Counter[str] = Counter()
            newest: dict[int, int] = {}
            for row in batches:
                seen[row["source"]] += row["n"]
                judged[row["source"]] += row["judged"]
                if row["batch"] is not None:
                    newest[row["batch"]] = max(newest.get(row["batch"], 0), row["newest"] or 0)
            with sink.connect(settings.dsn.get_secret_value()) as conn:
                conn.autocommit = True
                with clock("ledger"):
                    classified = obs
                    if late is not None and transform.LATE_JUDGED in late.columns:
                        classified = obs.unionByName(transform.late_now(late))
                    ledger, complete = self._read_ledger(window, classified, conn, cached)
                    ledger_rows = ledger.count()
                    coverage = self._coverage(conn) if complete else None
                waited_to = self._waited_to(window, started)
                with clock("plan"):  # building the plan: a second or so of the driver's
                    judgement = transform.judge(
                        obs,
                        ledger,
                        window,
                        coverage_start=coverage,
                        summary_window=settings.summary_window,
                        late=late,
                        latency_counted=counted,
                        watched_topic=transform.watched(
                            F.col("topic"),
                            settings.topics,
                            settings.topic_pattern,
                            settings.not_deliveries,
                        ),
                        undelivered_before=waited_to - settings.undelivered_after,
                        waited_to=waited_to,
                    )
                    cached.append(judgement.classified.persist())
                with clock("judge"):
                    histogram = _latency_rows(judgement.latency)
                    findings = _finding_rows(judgement.findings)
                carried = self._open_windows if window.latency_carried else None
                merged = merge_rows({} if carried is None else carried.windows, histogram)
                closed, still_open = close(merged, window.hi, window.summaries_from)
                windows = [w.summary() for w in closed]
                with clock("sink"):
                    written = sink.write_judgement(
                        conn,
                        settings.schema_name,
                        findings,
                        windows,
                        detected_in=detected_in,
                        seen_every=self._seen_every,
                    )
                    new = written.new
                    if written.seen_refused is not None:
                        self._seen_refused(written.seen_refused)
                    self._prune(conn)
            self._open_windows = still_open
            if settings.checkpoint is not None and not settings.audit:
                with clock("trim"):
                    self._trim(newest, window, trim_before)
        finally:
            for df in cached:
                df.unpersist()
        self._last_judged = started  # the idle ticker counts from the start of a judgement
        report = RunReport(
            detected_in=detected_in,
            window=window,
            copies=seen[transform.RECORD],
            markers=seen[transform.MARKER],
            copies_judged=judged[transform.RECORD],
            markers_judged=judged[transform.MARKER],
            ledger_rows=ledger_rows,
            found=dict(Counter(row[0] for row in findings)),
            new=dict(new),
            windows=windows,
            coverage_start=coverage,
            seconds=timings,
        )
        if report.found_total:
            logger.warning("reconciliation: %s", report.format())
        else:
            logger.info("reconciliation: %s", report.format())
        self._reported(report)
        return report

    def _waited_to(self, window: JudgeWindow, now: datetime) -> datetime:
        """What the wait of rows still waiting for the relay counts to: those that committed
        --undelivered-deadline before it have waited long enough to be missing. A running job
        counts to `as_of` (how far it read Kafka: a copy not read yet may answer a row the relay
        ends now); an audit to now, since the ledger says how it is now: its `as_of` is --to
        plus the deadline, and the rows committed in the last minutes before --to were never
        reported, however long they had been stuck."""
        return now if self.settings.audit else window.as_of

    def _trim(self, newest: dict[int, int], window: JudgeWindow, current: int | None) -> None:
        """Delete the store's batches whose newest observation is older than the horizon.

        A judgement reads only its context, so the newest observation of each batch is known
        from its write, or from a judgement of the whole horizon (a batch with nothing in the
        horizon is older than it). For a batch of an earlier run, its write time bounds it:
        it holds only what was appended before.
        """
        self._batch_newest.update(newest)
        whole_horizon = window.windows_from is None
        low = window.as_of - self.settings.horizon
        for batch_id, (path, written) in self._store_batches().items():
            if current is not None and batch_id >= current:
                continue
            known = self._batch_newest.get(batch_id)
            if known is None and not whole_horizon:
                stamp: datetime | None = written
            else:
                stamp = _from_micros(known)
            if stamp is None or stamp < low:
                self._delete(path)
                self._batch_newest.pop(batch_id, None)
                self._written_at.pop(batch_id, None)


@contextmanager
def _connector_needed() -> Iterator[None]:
    try:
        yield
    except AnalysisException as exc:
        if "data source: kafka" not in str(exc).lower():
            raise
        raise ReconcileConfigError(
            "Spark's Kafka connector is not on the classpath: pass --jars (or set "
            "OUTBOX_SPARK_JARS) with the jars `scripts/services.py spark-jars` lists"
        ) from exc


def _check_pattern(spark: SparkSession, pattern: str) -> None:
    """Compiled as Kafka's source compiles it (Java's regex, which Python's re is not): a bad
    one failed deep in the query, with the job's own wrapping of it in the message."""
    try:
        spark.sparkContext._jvm.java.util.regex.Pattern.compile(pattern)  # type: ignore[union-attr]
    except _JVM_ERRORS as exc:
        raise ReconcileConfigError(
            f"--topic-pattern '{pattern}' is not a regular expression: {_java_message(exc)}"
        ) from None


# PySpark turns the JVM's exceptions it knows into its own (CapturedException), the others come
# as py4j's, with the JVM's stack in the message.
_JVM_ERRORS = (Py4JJavaError, CapturedException)


# Option names whose values Spark must not show. Its own redaction (spark.redaction.regex)
# hides a value that looks like a password, but a source's option list in a plan showed an
# inline PEM private key (ssl.keystore.key) in clear. (A stream DataFrame's explain(True)
# also prints the V1 fallback's options unredacted, a Spark matter: the job never prints one.)
SECRET_OPTIONS = r"(?i)jaas|keystore\.key|password|secret|token"  # noqa: S105 (names, no secret)


def _redact_secret_options(spark: SparkSession) -> None:
    """Adds SECRET_OPTIONS to the session's option redaction (URLs by default), kept."""
    name = "spark.sql.redaction.options.regex"
    current = spark.conf.get(name, "(?i)url") or "(?i)url"
    if SECRET_OPTIONS not in current:
        spark.conf.set(name, f"{current}|{SECRET_OPTIONS}")


def _java_message(exc: Py4JJavaError | CapturedException) -> str:
    """The Java exception's own line, not its stack (hundreds of lines)."""
    if isinstance(exc, Py4JJavaError):
        return str(exc.java_exception.toString()).splitlines()[0]
    return (str(exc).splitlines() or [type(exc).__name__])[0]


@contextmanager
def _query_failure(what: str) -> Iterator[None]:
    """A batch query's failure (a topic that does not exist, an unreachable broker) said in a
    line, as a streaming query's is: it came out as a Py4JJavaError with the JVM's stack."""
    try:
        yield
    except _JVM_ERRORS as exc:
        raise ReconcileQueryError(f"{what} failed: {_java_message(exc)}") from exc


class _Stopping(Exception):
    """Raised in a micro-batch that starts while the job stops, so that Spark replays it."""


class _Stopwatch:
    """`with clock("stage"):` adds the stage's wall time to a dict (the report's `seconds`)."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.into[stage] = round(self.into.get(stage, 0.0) + time.perf_counter() - started, 3)


def late_due_batches(
    written: Mapping[int, datetime],
    unread_from: int,
    late_below: Mapping[int, datetime],
    due_by: datetime,
    low: datetime,
) -> dict[int, datetime]:
    """The store batches whose late observations are judged now, each with the time before
    which an observation of its is late: the `lo` of the judgement that read it first
    (`late_below`), or `low` for one read first now.

    A batch's late observations wait until `due_by` passes its write (`written`), as on-time
    ones wait a deadline from their Kafka time: a Kafka transaction's commit shows in each
    partition on its own, so one micro-batch can read a late transaction's marker and the
    next its copy. Judged at once, the marker was reported without its copy. Only the first
    batches from `unread_from` on, in order: one written out of order waits for those before.
    """
    due: dict[int, datetime] = {}
    for batch_id in sorted(b for b in written if b >= unread_from):
        if written[batch_id] > due_by:
            break
        due[batch_id] = late_below.get(batch_id, low)
    return due


def _stamped_before(lows: Mapping[int, datetime]) -> Column:
    """True for an observation of a batch in `lows` stamped before that batch's time;
    consecutive batches of one time (all of them after a restart) as one range."""
    runs: list[tuple[int, int, datetime]] = []
    for batch_id, low in sorted(lows.items()):
        if runs and runs[-1][2] == low and runs[-1][1] == batch_id - 1:
            runs[-1] = (runs[-1][0], batch_id, low)
        else:
            runs.append((batch_id, batch_id, low))
    flagged: Column = F.lit(False)
    for first, last, low in runs:
        flagged = flagged | (F.col("batch").between(first, last) & (F.col("ts") < F.lit(low)))
    return flagged


def _empty(spark: SparkSession, schema: StructType) -> DataFrame:
    """An empty DataFrame made in the JVM. createDataFrame([]) is a Python RDD: each task of
    every stage that read it waited for a Python worker (an idle job's judgement, 7-8 s with
    it on two cores, takes 4 s)."""
    return spark.range(0).select([F.lit(None).cast(f.dataType).alias(f.name) for f in schema])


def _finding_rows(findings: DataFrame) -> list[tuple[Any, ...]]:
    """Findings collected to the driver (they are anomalies: few), as sink rows."""
    out = findings.select(
        *[c for c in transform.FINDING_COLUMNS if c != "event_time"],
        F.unix_micros("event_time").alias("event_time_us"),
    )
    return [
        tuple(
            _from_micros(row["event_time_us"]) if c == "event_time" else row[c]
            for c in transform.FINDING_COLUMNS
        )
        for row in out.collect()
    ]


def _latency_rows(histogram: DataFrame) -> list[tuple[datetime, datetime, float, int, float]]:
    """A judgement's latency histogram (transform.LATENCY_SCHEMA) collected to the driver: per
    summary window at most 900 buckets for each tenfold of latency (latency.LATENCY_DIGITS)."""
    out = histogram.select(
        F.unix_micros("window_start").alias("start_us"),
        F.unix_micros("window_end").alias("end_us"),
        "bucket_ms",
        "records",
        "max_ms",
    )
    return [
        (EPOCH + timedelta(microseconds=r.start_us), EPOCH + timedelta(microseconds=r.end_us),
         r.bucket_ms, r.records, r.max_ms)
        for r in out.collect()
    ]  # fmt: skip


# --- command line ----------------------------------------------------------------------------


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number (0-65535): {text!r}")
    return port


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _retention(text: str) -> timedelta | None:
    if text.strip().lower() == "none":
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or none") from None


def _time(text: str) -> datetime:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from exc


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spark.job",
        description="Reconcile the outbox ledger, the op markers and the delivered topics.",
    )
    db = p.add_argument_group("ledger and findings (Postgres)")
    db.add_argument(
        "--dsn",
        help="libpq connection string (default: $OUTBOX_DATABASE_URL, else the sidecar's)",
    )
    db.add_argument(
        "--schema", help="schema of the outbox tables (default: the sidecar's, else outbox)"
    )
    db.add_argument("--jdbc-url", help="JDBC URL for Spark's reads (default: from --dsn)")
    db.add_argument(
        "--jdbc-read-timeout",
        type=_duration,
        default="5m",
        help="give up a ledger read that receives nothing this long, failing the micro-batch: "
        "a database gone silent held it for ever (5m)",
    )
    db.add_argument(
        "--findings-retention",
        type=_retention,
        default="30d",
        help="delete findings not found again, and summary windows not written, for longer "
        "than this; 'none' keeps them (30d)",
    )
    k = p.add_argument_group("Kafka")
    k.add_argument(
        "--bootstrap", help="Kafka bootstrap servers (default: the --kafka-config file's)"
    )
    topics = k.add_mutually_exclusive_group(required=True)
    topics.add_argument("--topics", help="delivered topics, comma-separated")
    topics.add_argument("--topic-pattern", help="delivered topics, a Java regex")
    k.add_argument("--marker-topic", default="outbox.op-markers", help="the op-marker topic")
    k.add_argument(
        "--dead-letter-topic",
        default="outbox.dead-letter",
        help="the relay's dead-letter topic, never judged as deliveries",
    )
    k.add_argument(
        "--ignore-topic",
        action="append",
        default=[],
        help="a further topic whose records are not deliveries (repeatable)",
    )
    k.add_argument(
        "--former-outbox-name",
        action="append",
        default=[],
        metavar="DATABASE/SCHEMA",
        help="a name this outbox had before its database or schema was renamed: its markers "
        "and copies are this outbox's too (repeatable)",
    )
    k.add_argument(
        "--kafka-option",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="a Kafka consumer property, e.g. security.protocol=SASL_SSL (repeatable; over "
        "the --kafka-config file's)",
    )
    k.add_argument(
        "--kafka-config",
        metavar="FILE",
        help="a Kafka client properties file, as Kafka's tools take (--consumer.config): "
        "secrets such as sasl.jaas.config stay off the command line",
    )
    j = p.add_argument_group("judging")
    j.add_argument("--deadline", type=_duration, default="60s", help="time to appear (60s)")
    j.add_argument(
        "--undelivered-deadline",
        type=_duration,
        help="time a record may wait for the relay (committed, not ended by it) before it is "
        "reported missing: a relay behind is the lag alert's (10m, or the deadline if longer)",
    )
    j.add_argument("--horizon", type=_duration, default="15m", help="state kept (15m)")
    j.add_argument(
        "--ledger-retention",
        type=_duration,
        help="the relay's delivered_retention (default: derived from the ledger)",
    )
    j.add_argument("--summary-window", type=_duration, default="1m", help="latency window (1m)")
    r = p.add_argument_group("running")
    r.add_argument("--checkpoint", help="checkpoint location (streaming and --once)")
    r.add_argument("--trigger", type=_duration, default="10s", help="micro-batch interval (10s)")
    r.add_argument("--once", action="store_true", help="read what is there (availableNow), stop")
    r.add_argument("--from", dest="audit_from", type=_time, help="audit window start (ISO 8601)")
    r.add_argument("--to", dest="audit_to", type=_time, help="audit window end (ISO 8601)")
    r.add_argument("--master", help="Spark master (default: local[*] outside spark-submit)")
    r.add_argument(
        "--jars",
        default=os.environ.get("OUTBOX_SPARK_JARS", ""),
        help="local jar paths, comma-separated (default: $OUTBOX_SPARK_JARS)",
    )
    r.add_argument("--shuffle-partitions", type=int, help="spark.sql.shuffle.partitions")
    r.add_argument(
        "--http-port",
        type=_port,
        help="serve /healthz, /readyz and /metrics (Prometheus) on this port (streaming only)",
    )
    r.add_argument(
        "--http-host",
        default="0.0.0.0",  # noqa: S104 - the probes come from the kubelet, outside the pod
        help="the address --http-port listens on (0.0.0.0)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="the report as one JSON line")
    out.add_argument(
        "--fail-on-findings",
        action="store_true",
        help=f"exit with status {EXIT_FINDINGS} when the run found anything (--once, audits)",
    )
    out.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,  # as OUTBOX_LOG_LEVEL takes it: "info" is INFO
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (WARNING)",
    )
    return p


def settings_from_args(args: argparse.Namespace) -> ReconcileSettings:
    """The settings of parsed arguments; raises ReconcileConfigError when they cannot work."""
    # As every `outboxctl` command finds them: in the sidecar's container as it is, too.
    dsn, schema = args.dsn or os.environ.get("OUTBOX_DATABASE_URL"), args.schema
    if not dsn or schema is None:
        try:  # not in the zip spark-submit ships (spark, outbox, relay: relay.config needs checker)
            from relay.cli_database import database_settings
        except ImportError as exc:  # not `outbox` unsaid: that may be another outbox
            database, why = None, f"the sidecar's package is not whole here: {exc}"
        else:
            database, why = database_settings()
        if database is None:
            missing = "--schema" if dsn else "--dsn and --schema"
            raise ReconcileConfigError(
                f"the sidecar's database settings cannot be read ({why}): pass {missing}"
            )
        dsn = dsn or (database.dsn.get_secret_value() if database.dsn is not None else None)
        schema = database.schema_name if schema is None else schema
    if not dsn:
        raise ReconcileConfigError(
            "no database: pass --dsn, set OUTBOX_DATABASE_URL, or give the sidecar's setting "
            "(OUTBOX_DATABASE__DSN)"
        )
    # the file, then --kafka-option over it, as Kafka's tools do with --consumer-property
    kafka_options = load_kafka_properties(args.kafka_config) if args.kafka_config else {}
    kafka_options.update(args.kafka_option)
    bootstrap = args.bootstrap or kafka_options.get(BOOTSTRAP)
    kafka_options.pop(BOOTSTRAP, None)
    if not bootstrap:
        raise ReconcileConfigError(
            "no Kafka bootstrap servers: pass --bootstrap (or bootstrap.servers in --kafka-config)"
        )
    values: dict[str, Any] = {
        "dsn": dsn,
        "schema_name": schema,
        "jdbc_url": args.jdbc_url,
        "jdbc_read_timeout": _as_delta(args.jdbc_read_timeout),
        "bootstrap_servers": bootstrap,
        "kafka_options": kafka_options,
        "topics": tuple(t.strip() for t in args.topics.split(",") if t.strip())
        if args.topics
        else (),
        "topic_pattern": args.topic_pattern,
        "marker_topic": args.marker_topic,
        "dead_letter_topic": args.dead_letter_topic,
        "ignored_topics": tuple(args.ignore_topic),
        "former_outbox_names": tuple(args.former_outbox_name),
        "deadline": _as_delta(args.deadline),
        "undelivered_deadline": args.undelivered_deadline,
        "horizon": _as_delta(args.horizon),
        "ledger_retention": args.ledger_retention,
        "findings_retention": args.findings_retention,  # argparse converts its default too
        "summary_window": _as_delta(args.summary_window),
        "trigger": _as_delta(args.trigger),
        "checkpoint": args.checkpoint,
        "once": args.once,
        "audit_from": args.audit_from,
        "audit_to": args.audit_to,
        "master": args.master,
        "jars": tuple(j for j in args.jars.split(",") if j),
        "shuffle_partitions": args.shuffle_partitions,
    }
    try:
        settings = ReconcileSettings(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{_flag_of(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ReconcileConfigError(problems) from None
    _refuse_flags_that_do_nothing(args, settings)
    if settings.audit_from is not None and settings.audit_to is not None:
        # A window not due yet is said now, not after Spark started (ReconcileJob.audit).
        JudgeWindow.audit(settings.audit_from, settings.audit_to, _utcnow(), settings.deadline)
    # What the JDBC driver cannot take (a Unix socket's DSN, a service without its file) is
    # said now, not at the first ledger read, after Kafka was read and the Spark session built.
    settings.jdbc()
    return settings


# Settings whose flag is not `--` and the name with dashes (errors name what was typed).
_FLAGS = {
    "schema_name": "--schema",
    "bootstrap_servers": "--bootstrap",
    "kafka_options": "--kafka-config/--kafka-option",
    "ignored_topics": "--ignore-topic",
    "former_outbox_names": "--former-outbox-name",
    "audit_from": "--from",
    "audit_to": "--to",
}


def _flag_of(loc: tuple[int | str, ...]) -> str:
    if not loc:
        return "arguments"  # a check of several together: its message names them
    name = str(loc[0])
    return _FLAGS.get(name, f"--{name.replace('_', '-')}")


def _refuse_flags_that_do_nothing(args: argparse.Namespace, settings: ReconcileSettings) -> None:
    """Given, and then ignored in silence: said instead."""
    if settings.audit and args.once:
        raise ReconcileConfigError("--once goes without --from/--to: an audit runs once anyway")
    if settings.audit and settings.checkpoint is not None:
        raise ReconcileConfigError(
            "--checkpoint goes without --from/--to: an audit reads its window from Kafka in one "
            "batch and keeps nothing (it neither resumes from a checkpoint nor moves one on)"
        )
    if not settings.audit and not settings.once:
        given = {"--json": args.json, "--fail-on-findings": args.fail_on_findings}
        ignored = [flag for flag, on in given.items() if on]
        if ignored:
            raise ReconcileConfigError(
                f"{' and '.join(ignored)} go with --once or --from/--to: a streaming job ends "
                "with no report (its findings are in the database, its figures in /metrics)"
            )
    both = set(settings.topics) & set(settings.not_deliveries)
    if both:
        raise ReconcileConfigError(
            f"{', '.join(sorted(both))}: named in --topics and as not a delivery "
            "(--ignore-topic, --dead-letter-topic): nothing on it would be judged"
        )


def _as_delta(value: timedelta | str) -> timedelta:
    return value if isinstance(value, timedelta) else parse_duration(value)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m spark.job` and `outboxctl reconcile`: run, print the report, return the status.

    0: done (nothing found, or --fail-on-findings not given); 3: --fail-on-findings and the run
    found something; 2: bad arguments. Errors raise ReconcileError (an OutboxError) or psycopg's.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:  # the process's own entry point has not configured it
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("spark").setLevel(args.log_level)
    try:
        settings = settings_from_args(args)
    except ReconcileConfigError as exc:
        parser.error(str(exc))
    if args.http_port is not None and (settings.once or settings.audit):
        parser.error(
            "--http-port serves a streaming job's probes and metrics: "
            "not with --once or --from/--to"
        )
    with ExitStack() as cleanup:  # the session stopped, then the probes
        made: list[ReconcileJob] = []  # the probes answer from before the job exists
        on_report = None
        if args.http_port is not None:
            from relay.http import ProbeServerUnavailable
            from spark.metrics import ReconcileMetrics, start_probes

            metrics = ReconcileMetrics(settings)
            on_report = metrics.observe
            try:
                probes = start_probes(
                    args.http_host, args.http_port, metrics, lambda: made[0] if made else None
                )
            except ProbeServerUnavailable as exc:
                raise ReconcileConfigError(str(exc)) from None
            cleanup.callback(probes.stop)
        # Before the session: Spark's start and a first read of the whole horizon came first.
        sink.check_database(settings.dsn.get_secret_value(), settings.schema_name)
        spark, owned = build_session(settings)
        if owned:
            cleanup.callback(spark.stop)
        job = ReconcileJob(settings, spark, on_report=on_report)
        made.append(job)
        if settings.audit:
            # As a --once run's: as a container's PID 1, an audit ignored a SIGTERM. Its Spark
            # jobs are cancelled; findings it wrote meanwhile stay (each is written once).
            stop = threading.Event()
            signals = StopOnSignals(stop, "stopping the audit")
            with signals.installed(), _repeating_on(stop, _cancel_jobs(spark), "audit-stop"):
                try:
                    report = job.audit()
                except Exception:
                    if not stop.is_set():
                        raise
                    print(
                        "spark.job: the audit was stopped before its end: its report is not "
                        "complete; run it again",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 128 + (signals.received or signal.SIGTERM)
        elif settings.once:
            # A container's PID 1 ignores a SIGTERM it has no handler for: the pod waited out
            # its grace period, then was killed. Stopped while reading, the run judges nothing.
            stop = threading.Event()
            signals = StopOnSignals(stop, "stopping the reconciliation")
            with signals.installed(), _repeating_on(stop, job.stop, "reconcile-stop"):
                try:
                    report = job.run_once()
                except ReconcileStopped as exc:
                    print(f"spark.job: {exc}", file=sys.stderr, flush=True)
                    return 128 + (signals.received or signal.SIGTERM)
        else:
            # The handler runs in the middle of the py4j call it interrupts: it only notes the
            # signal (a call into Spark from there broke that one), a thread of its own sets
            # `stop`, and run_forever sees it within a second.
            stop = threading.Event()
            with StopOnSignals(stop, "stopping the reconciliation").installed():
                job.run_forever(until=stop)
            return 0
        print(json.dumps(report.as_dict()) if args.json else report.format(), flush=True)
        return EXIT_FINDINGS if args.fail_on_findings and report.found_total else 0


def local_checkpoint_on_a_cluster(master: str, checkpoint: str, default_fs: str | None) -> bool:
    """Is the checkpoint on each machine's own disk (`file:`, given so or by a path without a
    scheme on a default file system that is), with executors on other machines than the
    driver's (any master but local[...])? The observation store under it is written by the
    executors and read by the driver."""
    if master == "local" or master.startswith("local["):
        return False
    scheme = urlparse(checkpoint).scheme or urlparse(default_fs or "file:///").scheme or "file"
    return scheme.lower() == "file"


def _cancel_jobs(spark: SparkSession) -> Callable[[], None]:
    """Cancels Spark's jobs; repeated, those started after a cancel too (they run on, else)."""

    failed: list[Exception] = []

    def cancel() -> None:
        if failed:
            return
        try:
            spark.sparkContext.cancelAllJobs()
        except Exception as exc:  # the JVM gone, say: nothing left to cancel
            failed.append(exc)
            logger.warning("could not cancel the audit's Spark jobs: %s", exc)

    return cancel


@contextmanager
def _repeating_on(stop: threading.Event, act: Callable[[], None], name: str) -> Iterator[None]:
    """Calls `act` once `stop` is set, and again every 0.2 s while the block runs: what the
    block starts after the first call (a query, a Spark job) is stopped too."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if stop.is_set():
                act()

    watcher = threading.Thread(target=watch, name=name, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ReconcileError, psycopg.Error) as exc:
        print(f"spark.job: {exc}", file=sys.stderr)
        sys.exit(1)
