"""Reconciliation throughput on local[2], against the relay's rate, and the detection delay.

One run, one scratch database, one broker, N records of 1 KiB on a 3-partition topic:
  baseline   a raw confluent-kafka transactional produce of the N records with their outbox
             headers and their N op markers, 500 records per transaction, no Postgres (it also
             writes the data the reconciliation reads).
  relay      the relay's own rate: `relay_drain()`, a real relay process draining N records.
  reconcile  the job with Trigger.AvailableNow on local[2] (shuffle partitions 2) over those N
             records, their markers and their N ledger rows: records reconciled per second,
             cold (the first query in the JVM) and warm (same data, a fresh checkpoint each
             time; after a warm-up run, the median of WARM_RUNS, the JIT warming up over the
             first few queries).
  marginal   the same warm run over 4N more records (a scratch database and topics of their
             own): what each further record costs, (4N - N) / (T(4N) - T(N)), each time the
             best of WARM_RUNS. A judgement also has a fixed cost (~3-4 s here: Spark jobs,
             the store and the ledger's reads), which a running job pays once per judgement,
             and its micro-batches grow with the traffic: this is the rate above which it
             falls behind for good, the fixed cost adding latency below it. An upper bound for
             a running job: each judgement classifies a deadline of context again (see
             streaming). Figures for the record, not the goal's ratio.
  detection  the continuous job (trigger T, deadline D), no traffic: a record is dropped at t0
             (ledger: delivered, nothing on Kafka); the delay until its `missing` finding is in
             the sink (median and max of --drops). Goal: D + 2T, which holds while one
             judgement (reported: judge_seconds_median) takes less than a trigger interval.
  idle       the same continuous job once nothing is due: the CPU it keeps busy (driver and JVM,
             in cores) over IDLE_SECONDS, ticks and empty micro-batches included.
  streaming  the continuous job (trigger T) while --stream-records more records and their
             markers stream in, written as a relay writes them (a transaction of 500 at a time:
             ledger rows committed, records and markers on Kafka, rows marked delivered):
             records reconciled per second of the job's busy time (micro-batches, their store
             writes and judgements, and the idle ticks' judgements) until a judgement has
             covered the last record.
             A running job judges only what became due since its last judgement, so this is its
             capacity to keep up with traffic, the figure to hold against the relay's rate.
Final line: JSON.

    .venv/bin/python -m bench.reconcile [--records 50000] [--deadline 5s] [--trigger 5s] [--drops 3]
                                        [--stream-records 200000]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench import _cpu
from bench._services import (
    delete_topics,
    scratch_database,
    service_env,
    sweep_leftover_topics,
)
from relay.markers import OUTBOX_ID_HEADER, OUTBOX_TX_ID_HEADER, Op, marker_entry, marker_messages

if TYPE_CHECKING:
    from bench.relay import Drain
    from spark.config import ReconcileSettings

VALUE = os.urandom(512).hex().encode()  # 1 KiB
PER_TX = 500
KEYS = 1000


def relay_drain(dsn: str, bootstrap: str, records: int) -> Drain:
    """The relay's own throughput (records/s) and CPU in this same run, on the same broker.

    bench/relay.py's drain: `records` committed rows in a scratch database of their own (this
    run's `dsn` holds the reconciliation's ledger), a real `outboxctl relay` process.
    """
    from bench.relay import delete_made_topics, drain

    # the earlier drains' topics first: left on the broker, they slowed each drain after them
    delete_made_topics(bootstrap)
    with scratch_database() as relay_dsn:
        return drain(relay_dsn, bootstrap, records)


def create_topics(bootstrap: str, *names_partitions: tuple[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = [NewTopic(n, num_partitions=p, replication_factor=1) for n, p in names_partitions]
    for future in admin.create_topics(new).values():
        future.result(30)


def fill_ledger(
    conn: psycopg.Connection[Any], topic: str, count: int, first: int = 0
) -> list[tuple[int, str, bytes, datetime]]:
    """`count` committed rows, commit time in id order; (id, tx_id, key, commit_ts). `first`:
    the number of the first (its transaction and key follow from it)."""
    rows = conn.execute(
        """
        INSERT INTO outbox.outbox_record (producer_group, tx_id, topic, key, value, key_hash,
                                          state, committed_xid, commit_ts)
        SELECT 'bench', 'tx-' || (g / %(per_tx)s), %(topic)s,
               convert_to((g %% %(keys)s)::text, 'UTF8'), %(value)s,
               hashtextextended((g %% %(keys)s)::text, 0), 'committed', pg_current_xact_id(),
               clock_timestamp()
        FROM generate_series(%(first)s::bigint, %(first)s::bigint + %(n)s - 1) AS g
        RETURNING id, tx_id, key, commit_ts
        """,
        {"per_tx": PER_TX, "topic": topic, "keys": KEYS, "value": VALUE, "n": count,
         "first": first},
    ).fetchall()  # fmt: skip
    return sorted(rows)


def transactional_producer(bootstrap: str) -> Producer:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"bench-reconcile-{uuid.uuid4().hex}",
            "linger.ms": 2,
        }
    )
    producer.init_transactions(30)
    return producer


def produce(
    producer: Producer, topic: str, markers: str, rows: list[tuple[int, str, bytes, datetime]]
) -> tuple[float, dict[int, tuple[int, int]]]:
    """The stand-in baseline: records + op markers in Kafka transactions; (seconds, positions)."""
    positions: dict[int, tuple[int, int]] = {}

    def report(outbox_id: int) -> Any:
        def on_delivery(err: Any, msg: Message) -> None:
            if err is None:
                positions[outbox_id] = (msg.partition() or 0, msg.offset() or 0)

        return on_delivery

    started = time.perf_counter()
    for start in range(0, len(rows), PER_TX):
        chunk = rows[start : start + PER_TX]
        producer.begin_transaction()
        for outbox_id, tx_id, key, _ in chunk:
            producer.produce(
                topic,
                VALUE,
                key,
                headers=[(OUTBOX_ID_HEADER, str(outbox_id).encode()), (OUTBOX_TX_ID_HEADER, tx_id)],
                on_delivery=report(outbox_id),
            )
        producer.flush(60)  # the relay writes a marker once it knows where its record landed
        entries = [
            marker_entry(
                Op.DELIVERED, id=outbox_id, tx_id=tx_id, producer_group="bench", topic=topic,
                key=key, partition=positions[outbox_id][0], offset=positions[outbox_id][1],
                commit_ts=commit_ts, reason=None,
            )
            for outbox_id, tx_id, key, commit_ts in chunk
        ]  # fmt: skip
        for value in marker_messages(entries, shard=0, relay="bench", epoch=1):
            producer.produce(markers, value, b"0")
        producer.commit_transaction(60)
    return time.perf_counter() - started, positions


def mark_delivered(conn: psycopg.Connection[Any], positions: dict[int, tuple[int, int]]) -> None:
    with conn.transaction():
        conn.execute("CREATE TEMPORARY TABLE pos (id bigint, p integer, o bigint) ON COMMIT DROP")
        with conn.cursor().copy("COPY pos (id, p, o) FROM STDIN") as copy:
            for outbox_id, (p, o) in positions.items():
                copy.write_row((outbox_id, p, o))
        conn.execute(
            "UPDATE outbox.outbox_record r SET state = 'delivered', ended_at = clock_timestamp(),"
            " kafka_partition = pos.p, kafka_offset = pos.o FROM pos WHERE r.id = pos.id"
        )


def deliver_like_the_relay(
    dsn: str, bootstrap: str, topic: str, markers: str, count: int, first: int
) -> float:
    """`count` records as a relay delivers them, a transaction of PER_TX at a time: committed
    in the ledger, then on Kafka with their markers, then marked delivered; returns seconds.
    The ledger never holds many committed rows that are not on Kafka yet (which a running
    job would judge missing, and spend a judgement on)."""
    producer = transactional_producer(bootstrap)
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(first, first + count, PER_TX):
            rows = fill_ledger(conn, topic, min(PER_TX, first + count - start), start)
            mark_delivered(conn, produce(producer, topic, markers, rows)[1])
    return time.perf_counter() - started


def drop_one(dsn: str, topic: str) -> int:
    """A record the relay says it delivered (now) that never reached Kafka."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "INSERT INTO outbox.outbox_record (producer_group, tx_id, topic, key, key_hash, state,"
            " committed_xid, commit_ts, ended_at, kafka_partition, kafka_offset)"
            " VALUES ('bench', 'dropped', %s, 'x', 0, 'delivered', pg_current_xact_id(), now(),"
            " now(), 0, 1000000000) RETURNING id",
            (topic,),
        ).fetchone()
    assert row is not None
    return int(row[0])


IDLE_SECONDS = 20.0
WARM_RUNS = 3  # warm runs of a size (see main)
RECENT_PROGRESS_KEPT = 100  # spark.sql.streaming.numRecentProgressUpdates, Spark's default


def cpu_seconds() -> float:
    """CPU time of this process and its descendants (the Spark JVM, its Python workers)."""
    parts = _cpu.sample().by_part
    return parts.get("bench", 0.0) + parts.get("children", 0.0)


def idle_cpu_cores(settle: float) -> float:
    """Cores a running job keeps busy once nothing is due (measured after `settle` seconds)."""
    time.sleep(settle)
    cpu, wall = cpu_seconds(), time.monotonic()
    time.sleep(IDLE_SECONDS)
    return (cpu_seconds() - cpu) / (time.monotonic() - wall)


def streaming_capacity(
    make_job: Callable[[Callable[[Any], None]], Any],
    dsn: str,
    bootstrap: str,
    topic: str,
    markers: str,
    count: int,
    first: int,
) -> dict[str, Any]:
    """The continuous job while `count` records (and their markers) stream in as fast as the
    stand-in delivers them (deliver_like_the_relay): records reconciled per second of the
    job's busy time, until a judgement has covered the last of them: every micro-batch after
    the first one (store write and the judgements they run), with or without input, and the
    judgements of idle ticks between them. A micro-batch that waited for a tick's judgement
    counts that wait twice (the rate errs low). Counted over the micro-batches with input
    alone, it left out the last deadline's judgements, which ticks make."""
    from spark.config import parse_time

    reports: list[Any] = []  # appended on the job's threads; read here once it is caught up
    job = make_job(reports.append)
    job.start()
    # By trigger (its start time), not by batch id: a trigger that finds nothing reports the
    # id of the batch to come, which the next one with data reports again. recentProgress keeps
    # only the last RECENT_PROGRESS_KEPT.
    progress: dict[str, Any] = {}

    def collect() -> None:
        recent = job._query.recentProgress
        if len(recent) >= RECENT_PROGRESS_KEPT and progress and recent[0].timestamp not in progress:
            raise RuntimeError("micro-batches went unseen between two reads of recentProgress")
        for p in recent:
            progress.setdefault(p.timestamp, p)

    try:
        # the first micro-batch (what the topics held before), judged and reported
        while job.last_report is None or job._query.lastProgress is None:
            time.sleep(0.2)
        collect()
        before, reported_before = set(progress), len(reports)
        cpu_before = _cpu.sample(children="spark")
        produce_s = deliver_like_the_relay(dsn, bootstrap, topic, markers, count, first)
        produced = datetime.now(UTC)
        started = time.monotonic()
        while True:  # until a judgement covers what was produced, and its micro-batch ended
            collect()
            last = job._query.lastProgress
            covered = any(r.window.hi >= produced for r in reports[reported_before:])
            if covered and last.numInputRows == 0 and parse_time(last.timestamp) > produced:
                break
            if time.monotonic() - started > 600:
                raise TimeoutError("the running job did not catch up in 600 s")
            time.sleep(0.5)
        cpu = _cpu.per_record(cpu_before, _cpu.sample(children="spark"), count)
        judged = reports[reported_before:]
    finally:
        job.stop()
    batches = [p for t, p in sorted(progress.items()) if t not in before]
    with_input = [p for p in batches if p.numInputRows > 0]
    batch_s = sum(p.durationMs["triggerExecution"] / 1000 for p in batches)
    tick_s = sum(sum(r.seconds.values()) for r in judged if r.detected_in == "tick")
    last_report = judged[-1] if judged else None
    # Every streamed record is in these micro-batches (they came after `before`); the rows they
    # read are the records and a few marker messages (many markers each), so count the records.
    durations = [p.durationMs["triggerExecution"] / 1000 for p in with_input]
    busy_s = batch_s + tick_s
    return {
        "records": count,
        "produced_per_s": round(count / produce_s),
        "batches": len(with_input),
        "batches_without_input": len(batches) - len(with_input),
        "tick_judgements": sum(1 for r in judged if r.detected_in == "tick"),
        "busy_seconds": round(busy_s, 2),
        "records_per_s": round(count / busy_s) if busy_s else 0,
        "batch_seconds_median": round(statistics.median(durations), 2) if durations else 0.0,
        "last_judgement_copies": last_report.copies if last_report else None,
        # where a judgement spends its time (prepare, store read, ledger, plan, judge, sink, trim)
        "last_judgement_seconds": last_report.seconds if last_report else None,
        # the stand-in producer included (bench: its Python and the driver's; spark: the JVM and
        # its Python workers)
        "cpu_us_per_record": cpu,
    }


def warm_run(spark: Any, settings: ReconcileSettings, records: int) -> float:
    """Seconds of one --once run over `records` clean records (the JVM warm)."""
    from spark.job import ReconcileJob

    started = time.perf_counter()
    report = ReconcileJob(settings, spark).run_once()
    took = time.perf_counter() - started
    if (report.copies, report.found_total) != (records, 0):
        raise RuntimeError(f"the clean data was not judged clean:\n{report.format()}")
    return took


def marginal_rate(
    spark: Any,
    settings: Callable[..., ReconcileSettings],
    tmp: str,
    bootstrap: str,
    small: int,
    large: int,
    small_s: float,
) -> dict[str, Any]:
    """Records per second of the warm run's cost per further record, between `small` records
    (`small_s`, measured by the caller) and `large` ones, written to a scratch database and
    topics of their own (the first run's ledger rows would be read by its judgement too)."""
    tag = uuid.uuid4().hex[:8]
    topic, markers = f"bench.reconcile.{tag}", f"bench.reconcile.markers.{tag}"
    create_topics(bootstrap, (topic, 3), (markers, 2))
    try:
        with scratch_database() as dsn:
            with psycopg.connect(dsn, autocommit=True) as conn:
                rows = fill_ledger(conn, topic, large)
                mark_delivered(
                    conn, produce(transactional_producer(bootstrap), topic, markers, rows)[1]
                )
            configs = [
                settings(f"{tmp}/marginal{i}", dsn, topic, markers) for i in range(WARM_RUNS)
            ]
            time.sleep(configs[0].deadline.total_seconds() + 0.5)  # every record is due
            large_s = min(warm_run(spark, config, large) for config in configs)
    finally:
        delete_topics(bootstrap, [topic, markers])
    rate = round((large - small) / (large_s - small_s)) if large_s > small_s else None
    return {
        "records_per_s": rate,
        "records": [small, large],
        "seconds": [round(small_s, 2), round(large_s, 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--deadline", default="5s")
    parser.add_argument("--trigger", default="5s", help="at least one judgement's duration")
    parser.add_argument("--drops", type=int, default=3, help="dropped records, one at a time")
    parser.add_argument(
        "--stream-records", type=int, default=200_000, help="records streamed to a running job"
    )
    parser.add_argument(
        "--marginal-factor",
        type=int,
        default=4,
        help="the marginal rate's larger run: this many times --records (1 or less: not measured)",
    )
    args = parser.parse_args()
    _cpu.warn_if_busy()

    from spark.config import ReconcileSettings, parse_duration
    from spark.findings import read_findings
    from spark.job import ReconcileJob, build_session

    env = service_env()
    bootstrap = env["OUTBOX_TEST_KAFKA_BOOTSTRAP"]
    sweep_leftover_topics(bootstrap)
    jars = tuple(j for j in env["OUTBOX_SPARK_JARS"].split(",") if j)
    tag = uuid.uuid4().hex[:8]
    topic, markers = f"bench.reconcile.{tag}", f"bench.reconcile.markers.{tag}"
    deadline, trigger = parse_duration(args.deadline), parse_duration(args.trigger)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    create_topics(bootstrap, (topic, 3), (markers, 2))
    tmp = tempfile.TemporaryDirectory(prefix="bench-reconcile-")
    try:
        with scratch_database() as dsn:
            n = args.records
            with psycopg.connect(dsn, autocommit=True) as conn:
                rows = fill_ledger(conn, topic, n)
                produce_s, positions = produce(
                    transactional_producer(bootstrap), topic, markers, rows
                )
                mark_delivered(conn, positions)
            baseline = n / produce_s
            print(
                f"baseline (stand-in for the relay: raw Kafka transactional produce of {n:,} "
                f"records + markers): {baseline:,.0f} records/s",
                flush=True,
            )
            # the median of three: one drain's rate swung with the broker's noise, and with it
            # both ratios against the goal
            from bench.relay import delete_made_topics

            # the drains' topics: on an exception too, and gone before the Spark timings
            atexit.register(delete_made_topics, bootstrap)
            relay_runs = sorted(
                (relay_drain(dsn, bootstrap, n) for _ in range(3)), key=lambda d: d.steady_rate
            )
            delete_made_topics(bootstrap)
            relay_run = relay_runs[1]
            # what it keeps up once going: the higher, stricter of its two rates to keep up with
            relay = relay_run.steady_rate

            def settings(
                checkpoint: str, dsn: str = dsn, topic: str = topic, markers: str = markers
            ) -> ReconcileSettings:
                return ReconcileSettings(
                    dsn=dsn, bootstrap_servers=bootstrap, topics=(topic,), marker_topic=markers,
                    deadline=deadline, trigger=trigger, checkpoint=checkpoint, master="local[2]",
                    jars=jars, shuffle_partitions=2,
                )  # fmt: skip

            spark, _ = build_session(settings(f"{tmp.name}/cold"))
            spark.sparkContext.setLogLevel("ERROR")
            time.sleep(deadline.total_seconds() + 0.5)  # every record is due
            runs: dict[str, float] = {}
            cpu: dict[str, dict[str, float]] = {}
            # cold: the JVM's first query; then a warm-up not counted, and WARM_RUNS warm ones.
            # The JVM's second query still ran code the JIT had not compiled (the third and
            # fourth ran 20-25 % faster), which a running job has long since; the median, as
            # the relay's rate is the median of its drains.
            warm: list[tuple[float, dict[str, float]]] = []
            for i, name in enumerate(["cold", "warm-up", *["warm"] * WARM_RUNS]):
                before = _cpu.sample(children="spark")
                started = time.perf_counter()
                report = ReconcileJob(settings(f"{tmp.name}/{name}{i}"), spark).run_once()
                took = time.perf_counter() - started
                used = _cpu.per_record(before, _cpu.sample(children="spark"), n)
                print(
                    f"reconcile {name}: {n / took:,.0f} records/s ({took:.1f} s; "
                    f"{report.copies:,} copies, {report.found_total} findings); CPU µs/record "
                    f"{used}",
                    flush=True,
                )
                if (report.copies, report.found_total) != (n, 0):
                    raise RuntimeError(f"the clean data was not judged clean:\n{report.format()}")
                if name == "cold":
                    runs["cold"], cpu["cold"] = took, used
                elif name == "warm":
                    warm.append((took, used))
            runs["warm"], cpu["warm"] = sorted(warm, key=lambda run: run[0])[len(warm) // 2]
            print(
                f"reconcile warm, median of {WARM_RUNS}: {n / runs['warm']:,.0f} records/s "
                f"({runs['warm']:.1f} s)",
                flush=True,
            )
            marginal = None
            if args.marginal_factor > 1:
                small_s = min(took for took, _ in warm)  # as the larger runs': the best
                marginal = marginal_rate(
                    spark, settings, tmp.name, bootstrap, n, args.marginal_factor * n, small_s
                )
                print(
                    f"reconcile marginal: {marginal['records_per_s']} records/s (each further "
                    f"record; {marginal['records']} records in {marginal['seconds']} s)",
                    flush=True,
                )

            # Detection delay: the continuous job, no traffic, dropped records one at a time.
            finding: list[float] = []  # the time of each judgement that found a drop

            def on_report(report: Any) -> None:
                if report.new.get("missing"):
                    finding.append(sum(report.seconds.values()))

            job = ReconcileJob(settings(f"{tmp.name}/stream"), spark, on_report=on_report)
            job.start()
            delays: list[float] = []
            judge_s: list[float] = []
            try:
                while job.last_report is None:  # the first micro-batch (the N records) is in
                    time.sleep(0.2)
                for _ in range(args.drops):
                    dropped = drop_one(dsn, topic)
                    t0 = time.monotonic()
                    while not any(
                        f.outbox_id == dropped for f in read_findings(dsn, kinds=["missing"])
                    ):
                        if time.monotonic() - t0 > 120:
                            raise TimeoutError("a dropped record was not reported in 120 s")
                        time.sleep(0.1)
                    delays.append(time.monotonic() - t0)
                    reported = time.monotonic() + 30  # a judgement reports after its write
                    while not finding and time.monotonic() < reported:
                        time.sleep(0.05)
                    while finding:  # popped: the job's thread may append meanwhile
                        judge_s.append(finding.pop(0))
                    print(f"detection delay: {delays[-1]:.1f} s", flush=True)
                # the drops fall out of the window after a deadline and two triggers
                idle = idle_cpu_cores(3 * (deadline + trigger).total_seconds())
                print(f"idle: {idle:.2f} cores busy", flush=True)
            finally:
                job.stop()
            goal = deadline.total_seconds() + 2 * trigger.total_seconds()
            steady = streaming_capacity(
                lambda on_report: ReconcileJob(
                    settings(f"{tmp.name}/steady"), spark, on_report=on_report
                ),
                dsn, bootstrap, topic, markers, args.stream_records, first=n,
            )  # fmt: skip
            print(
                f"streaming: {steady['records_per_s']:,.0f} records/s over "
                f"{steady['batches']} micro-batches of median {steady['batch_seconds_median']} s",
                flush=True,
            )
            spark.stop()
    finally:
        tmp.cleanup()
        delete_topics(bootstrap, [topic, markers])

    result = {
        "benchmark": "reconcile",
        "records": n,
        "spark_master": "local[2]",
        "reconcile_records_per_s": {k: round(n / v) for k, v in runs.items()},
        "reconcile_warm_is": f"median of {WARM_RUNS} runs after a warm-up run (earlier versions: "
        "the JVM's second run)",
        # CPU per record by part (bench: the driver's Python; spark: its JVM and Python workers)
        "reconcile_cpu_us_per_record": cpu,
        "baseline_kafka_produce_records_per_s": round(baseline),
        "baseline_is": "stand-in for the relay: raw transactional produce of records + op "
        "markers, 500 per transaction, no Postgres",
        "relay_records_per_s": relay,
        "relay_cpu_us_per_record": relay_run.cpu,
        "ratio_reconcile_warm_vs_baseline": round(n / runs["warm"] / baseline, 3),
        "ratio_reconcile_warm_vs_relay": round(n / runs["warm"] / relay, 3) if relay else None,
        # what each further record costs a judgement: the rate a running job falls behind above
        # (an upper bound: see the docstring); not the goal's ratio
        "reconcile_marginal": marginal,
        "ratio_reconcile_marginal_vs_relay": (
            round(marginal["records_per_s"] / relay, 3)
            if marginal and marginal["records_per_s"] and relay
            else None
        ),
        "detection_delay_s": {
            "median": round(statistics.median(delays), 2),
            "max": round(max(delays), 2),
        },
        "detection_goal_s": goal,
        "judge_seconds_median": round(statistics.median(judge_s), 2) if judge_s else None,
        "idle_cpu_cores": round(idle, 3),
        "streaming": steady,
        "ratio_streaming_vs_relay": round(steady["records_per_s"] / relay, 3) if relay else None,
        "deadline_s": deadline.total_seconds(),
        "trigger_s": trigger.total_seconds(),
        "at": datetime.now(UTC).isoformat(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
