"""Relay throughput against its two halves, latency, memory, and backlog sensitivity.

Side by side in one run, on the same Postgres and broker, with 1 KiB records:
  B1  a raw confluent-kafka transactional produce loop, transactions of the relay's batch size
  B1' B1 with the Kafka work of the relay's protocol: its headers, delivery reports awaited,
      op markers (a measure: the issue's ratio is to B1)
  B2  a raw psycopg claim-and-delete loop (FOR UPDATE SKIP LOCKED), no Kafka
  relay  `outboxctl relay` as a child process draining a backlog of the same size
Figures: relay / min(B1, B2) (goal >= 0.6, stretch 0.8); commit-to-visible latency p50/p99 for a
read_committed consumer at half the relay's measured rate (or --latency-rate), transactions of
10 records, from the commit time Postgres recorded (goals <= 25 ms / <= 150 ms; reported with
the rate the writer really reached); the relay's peak RSS (goal < 200 MB); the drop in
throughput from a small to a large backlog (goal <= 20%); the drain with two shards whose
transactions span both (a measure, no goal). B1, B1', B2 and the relay take turns, their order
turned each repeat; each figure is the median of the repeats, and each repeat's own ratio is
listed too. Final line: JSON.

    .venv/bin/python -m bench.relay [--records 20000] [--small 10000] [--large 1000000]
                                    [--latency-seconds 15] [--latency-rate R] [--repeat 3]
                                    [--batch-size N]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import multiprocessing
import os
import queue
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench import _cpu
from bench._services import (
    ROOT,
    delete_topics,
    scratch_database,
    service_env,
    sweep_leftover_topics,
)
from outbox import Outbox, OutboxConfig, Record, State, _core
from relay.config import RelaySettings
from relay.markers import (
    OUTBOX_ID_HEADER,
    OUTBOX_NAME_HEADER,
    OUTBOX_PRODUCER_GROUP_HEADER,
    OUTBOX_TX_ID_HEADER,
    Op,
    decode_markers,
    marker_entry,
    marker_messages,
)
from relay.sharding import shard_of

VALUE = os.urandom(512).hex().encode()  # 1 KiB
BATCH: int = RelaySettings.model_fields["batch_size"].default  # --batch-size, by default
PER_TX = 10  # records per outbox transaction in the backlogs and the latency load
# Topics this run made or had the relay make: deleted at the end (left behind, thousands of
# partitions gathered on a developer's broker and slowed its restarts).
made_topics: list[str] = []


def create_topic(bootstrap: str, partitions: int = 3) -> str:
    name = f"bench.relay.{uuid.uuid4().hex[:8]}"
    made_topics.append(name)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[
        name
    ].result(30)
    return name


def fill_outbox(dsn: str, topic: str, count: int, per_tx: int = PER_TX) -> None:
    """A backlog of committed records in transactions of `per_tx`, keys over 100 values.

    Pipelined statements, a Sync after each: each INSERT is a transaction of its own (without
    the Sync a pipeline is one implicit transaction), sent without waiting for the previous one.
    """
    with psycopg.connect(dsn, autocommit=True) as conn, conn.pipeline() as pipeline:
        for start in range(0, count, per_tx):
            conn.execute(
                """
                INSERT INTO outbox.outbox_record
                    (producer_group, tx_id, topic, key, value, key_hash, state, committed_xid)
                SELECT 'bench', 'fill-' || %(start)s, %(topic)s,
                       convert_to(((%(start)s + g) %% 100)::text, 'UTF8'), %(value)s,
                       -- as publish() hashes a key: its bytes' hex
                       hashtextextended(encode(convert_to(((%(start)s + g) %% 100)::text,
                                                          'UTF8'), 'hex'), 0), 'committed',
                       pg_current_xact_id()
                FROM generate_series(0, %(n)s - 1) AS g
                """,
                {"start": start, "topic": topic, "value": VALUE, "n": min(per_tx, count - start)},
            )
            pipeline.sync()


@dataclass(frozen=True)
class Timed:
    rate: float  # records/s
    cpu: dict[str, float]  # µs of CPU per record by part (bench/_cpu.py)


def b1_kafka(bootstrap: str, count: int, batch: int = BATCH) -> Timed:
    topic = create_topic(bootstrap)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"bench-{uuid.uuid4().hex}",
            "linger.ms": 2,
        }
    )
    producer.init_transactions(30)
    # One transaction untimed: the topic's metadata and leaders, the coordinator's first
    # AddPartitions; the relay's drain has its shards and producer before its go too.
    producer.begin_transaction()
    producer.produce(topic, value=VALUE, key=b"warm-up")
    producer.commit_transaction(60)
    before = _cpu.sample()
    started = time.perf_counter()
    for start in range(0, count, batch):
        producer.begin_transaction()
        for i in range(start, min(count, start + batch)):
            producer.produce(topic, value=VALUE, key=str(i % 100).encode())
        producer.commit_transaction(60)
    rate = count / (time.perf_counter() - started)
    return Timed(rate, _cpu.per_record(before, _cpu.sample(), count))


def b1_protocol(bootstrap: str, count: int, batch: int = BATCH) -> Timed:
    """B1 with the Kafka work the relay's protocol asks for, and no relay: its four headers on
    each record, the delivery reports awaited, and an op marker of each record in marker
    messages on a topic of their own, in the same transaction; the relay's partitioner. Not a
    ceiling the issue names (its ratio is to B1): it tells the protocol's cost from the relay's."""
    topic, markers = create_topic(bootstrap), create_topic(bootstrap, partitions=1)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"bench-{uuid.uuid4().hex}",
            "linger.ms": 2,
            "partitioner": "murmur2_random",
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()  # untimed, as B1's: both topics' metadata and partitions
    producer.produce(topic, value=VALUE, key=b"warm-up")
    producer.produce(markers, value=b"{}", key=b"0")
    producer.commit_transaction(60)
    landed: dict[int, tuple[int, int]] = {}

    def report(outbox_id: int) -> Callable[[Any, Any], None]:
        def on_delivery(err: Any, msg: Any) -> None:
            if err is None:
                landed[outbox_id] = (msg.partition(), msg.offset())

        return on_delivery

    outbox, commit_ts = "bench/outbox", datetime.now(UTC)
    before = _cpu.sample()
    started = time.perf_counter()
    for start in range(0, count, batch):
        producer.begin_transaction()
        ids = range(start, min(count, start + batch))
        for i in ids:
            tx_id = f"fill-{i // PER_TX}".encode()
            producer.produce(
                topic,
                value=VALUE,
                key=str(i % 100).encode(),
                headers=[
                    (OUTBOX_ID_HEADER, str(i).encode()),
                    (OUTBOX_TX_ID_HEADER, tx_id),
                    (OUTBOX_PRODUCER_GROUP_HEADER, b"bench"),
                    (OUTBOX_NAME_HEADER, outbox),
                ],
                on_delivery=report(i),
            )
        producer.flush(60)  # a marker says where its record landed
        unreported = [i for i in ids if i not in landed]
        if unreported:
            raise RuntimeError(f"B1': records {unreported[:5]}... not delivered")
        entries = [
            marker_entry(
                Op.DELIVERED, id=i, tx_id=f"fill-{i // PER_TX}", producer_group="bench",
                topic=topic, key=str(i % 100).encode(), partition=landed[i][0],
                offset=landed[i][1], commit_ts=commit_ts, reason=None,
            )
            for i in ids
        ]  # fmt: skip
        for message in marker_messages(entries, shard=0, relay="bench", epoch=1, outbox=outbox):
            producer.produce(markers, value=message, key=b"0")
        producer.commit_transaction(60)
        landed.clear()
    rate = count / (time.perf_counter() - started)
    return Timed(rate, _cpu.per_record(before, _cpu.sample(), count))


def b2_postgres(dsn: str, count: int, batch: int = BATCH) -> Timed:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE b2 (id bigserial PRIMARY KEY, key text, value bytea)")
        conn.execute(
            "INSERT INTO b2 (key, value) SELECT (g %% 100)::text, %s FROM generate_series(1, %s) g",
            (VALUE, count),
        )
        conn.commit()
        settle(dsn, "b2")
        before = _cpu.sample()
        started = time.perf_counter()
        done = 0
        while done < count:
            with conn.transaction():
                rows = conn.execute(
                    "DELETE FROM b2 WHERE id IN (SELECT id FROM b2 ORDER BY id LIMIT %s "
                    "FOR UPDATE SKIP LOCKED) RETURNING id, key, value",
                    (batch,),
                ).fetchall()
            done += len(rows)
        rate = count / (time.perf_counter() - started)
        return Timed(rate, _cpu.per_record(before, _cpu.sample(), count))


def delete_made_topics(bootstrap: str) -> None:
    delete_topics(bootstrap, made_topics)
    made_topics.clear()


def relay_env(dsn: str, bootstrap: str, batch: int = BATCH, **relay: Any) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    made_topics.extend((f"bench.markers.{tag}", f"bench.dlt.{tag}"))
    return {
        **os.environ,
        "OUTBOX_DATABASE__DSN": dsn,
        "OUTBOX_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_RELAY": json.dumps(
            {
                "op_marker_topic": f"bench.markers.{tag}",
                "dead_letter_topic": f"bench.dlt.{tag}",
                "transactional_id_prefix": f"bench-relay-{tag}",
                "batch_size": batch,
                **relay,
            }
        ),
        "OUTBOX_HTTP__ENABLED": "false",
        "OUTBOX_CHECKER__ENABLED": "false",
        "OUTBOX_LOG_FORMAT": "text",
        "OUTBOX_LOG_LEVEL": "WARNING",
    }


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def undelivered(conn: psycopg.Connection[Any]) -> bool:
    """Is anything left? (An index probe: counting a large backlog would load the database.)"""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM outbox.outbox_record WHERE state = 'committed')"
    ).fetchone()
    return bool(row and row[0])


def gone(conn: psycopg.Connection[Any], row_id: int) -> bool:
    row = conn.execute(
        "SELECT NOT EXISTS (SELECT FROM outbox.outbox_record WHERE id = %s)", (row_id,)
    )
    return bool(row.fetchone()[0])  # type: ignore[index]


def marker_times(bootstrap: str, topic: str, count: int) -> list[int]:
    """Create timestamps (ms) of the first `count` committed op markers, in log order (the
    markers of one message share its time)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    times: list[int] = []
    deadline = time.monotonic() + 300
    try:
        while len(times) < count and time.monotonic() < deadline:
            for msg in consumer.consume(10_000, 0.2):  # a batch rarely fills: don't wait 1 s
                if msg.error() is None:
                    markers = decode_markers(msg.value() or b"")
                    times.extend([msg.timestamp()[1]] * len(markers))
    finally:
        consumer.close()
    if len(times) < count:
        raise RuntimeError(f"only {len(times)} of {count} op markers arrived")
    return times


@dataclass(frozen=True)
class Drain:
    rate: float  # records/s from the relay's go (see drain()): stamping and first batch in
    steady_rate: float  # records/s after the first batch
    first_batch_s: float  # the go to the first batch's last marker
    peak_rss_mb: float
    cpu: dict[str, float]  # µs per record by part, from the go (bench/_cpu.py)


def settle(dsn: str, table: str) -> None:
    """What a bulk fill leaves for later (a checkpoint's writes, hint bits, the statistics an
    autovacuum would gather), done before the timing: else it fell inside a large backlog's
    drain and not a small one's, and inflated the drop between them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM (ANALYZE) {table}")
        conn.execute("CHECKPOINT")


def drain(dsn: str, bootstrap: str, count: int, shards: int = 1, batch: int = BATCH) -> Drain:
    """A relay process draining a backlog of `count` committed records, timed from its go.

    The relay starts on an empty outbox and takes its shards, is stopped (SIGSTOP) while the
    backlog is filled and settled, and goes on (SIGCONT): `rate` runs from there to its last op
    marker (the markers carry the times the relay produced them), so it counts the stamping of
    the backlog's commit times and the first batch, as B1 and B2 count their first round, and
    leaves out the process's start-up; it ends when the last row is gone (its Kafka commit
    and its end included). `steady_rate` is what went out after the first batch, marker to
    marker.
    The relay runs with its defaults (ended rows are deleted) and owns every shard, with a
    lease long enough for the fill (a lease that lapsed while it was stopped was taken again,
    a recovery inside the timing). CPU is counted from the go until nothing is left.
    """
    topic = create_topic(bootstrap)
    env = relay_env(dsn, bootstrap, batch, shards=shards, lease_duration="PT1H")
    # Polled on one connection: a backend for each poll would cost Postgres CPU of its own.
    with psycopg.connect(dsn, autocommit=True) as conn:
        proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "relay"], env=env, cwd=ROOT)
        try:

            def wait(until: Callable[[], bool], poll: float) -> None:
                deadline = time.monotonic() + 600
                while not until():
                    if proc.poll() is not None:
                        raise RuntimeError(f"the relay exited with {proc.returncode}")
                    if time.monotonic() > deadline:
                        raise RuntimeError("the relay did not get there in 600 s")
                    time.sleep(poll)

            markers = json.loads(env["OUTBOX_RELAY"])["op_marker_topic"]
            wait(lambda: recovered_shards(conn, markers) == shards, 0.05)
            proc.send_signal(signal.SIGSTOP)
            try:
                fill_outbox(dsn, topic, count)
                settle(dsn, "outbox.outbox_record")
                last = conn.execute("SELECT max(id) FROM outbox.outbox_record").fetchone()
                last_id = last[0] if last else 0
            finally:
                before = _cpu.sample(children="relay")
                started = time.time()
                proc.send_signal(signal.SIGCONT)
            # The last row first, by its key (the relay sends in commit order, and the fill
            # committed it last): probed by its state, a million rows' backlog was scanned
            # (in parallel) every 0.1 s beside the relay it measures. Its end is when it is
            # gone: the last marker's time leaves out the last commit and end (an index probe
            # every 10 ms is what that costs). Then nothing else left.
            wait(lambda: gone(conn, last_id), 0.01)
            ended = time.time()
            wait(lambda: not undelivered(conn), 0.1)
            cpu = _cpu.per_record(before, _cpu.sample(children="relay"), count)
            rss = peak_rss_mb(proc.pid)
        finally:
            proc.send_signal(signal.SIGCONT)  # a stopped process does not end on SIGTERM
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    times = sorted(
        marker_times(bootstrap, json.loads(env["OUTBOX_RELAY"])["op_marker_topic"], count)
    )
    first_batch = min(batch, count) - 1
    span = (times[-1] - times[first_batch]) / 1000
    took = max(times[-1] / 1000, ended) - started
    if span <= 0 or took <= 0:
        raise RuntimeError(f"a drain of {count} records timed at {took:.3f} s: too few to time")
    return Drain(
        rate=count / took,
        steady_rate=(count - first_batch - 1) / span,
        first_batch_s=times[first_batch] / 1000 - started,
        peak_rss_mb=rss,
        cpu=cpu,
    )


def recovered_shards(conn: psycopg.Connection[Any], marker_topic: str) -> int:
    """The shards held whose recovery is done: it records the marker topic it read. Stopped
    while it held them but was still in its recovery's init_transactions, the relay timed that
    out at its go (the fill outlasts the timeout), and recovered again inside the timing."""
    row = conn.execute(
        "SELECT count(*) FROM outbox.shard_lease"
        " WHERE owner IS NOT NULL AND lease_until > now() AND marker_topic = %s",
        (marker_topic,),
    ).fetchone()
    return int(row[0]) if row else 0


def _arrivals(
    bootstrap: str, topic: str, ready: Any, stop: Any, expected: Any, out: Any, warmups: int = 1
) -> None:
    """The consumer, in a process of its own: in the publisher's process it waited for the GIL
    behind the publishing loop, and that wait was counted as latency. Sends {value prefix:
    arrival time} once it has seen `expected` records (set when known) or is stopped; sets
    `ready` once it has seen `warmups` warm-up records."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
        }
    )
    partitions = consumer.list_topics(topic, 30).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    arrived: dict[bytes, float] = {}
    warmed = 0
    while not stop.is_set() and not 0 < expected.value <= len(arrived):
        msg = consumer.poll(0.1)
        if msg is not None and msg.error() is None:
            at = time.time()
            prefix = (msg.value() or b"").split(b":", 1)[0]
            if prefix == b"warmup":
                warmed += 1
                if warmed >= warmups:
                    ready.set()
            else:
                arrived[prefix] = at
    consumer.close()
    out.put(arrived)


def _transactions(topic: str, rate: float, seconds: float, per_tx: int) -> list[Any]:
    """The latency load's INSERTs, made before the clock starts: the outbox helper's own
    statement (with its NOTIFY), prefixes `n.i` in the values."""
    cfg = OutboxConfig()
    made = []
    for n in range(round(rate * seconds / per_tx)):
        records = [
            Record(topic, f"{n}.{i}:".encode() + VALUE[:1000], str((n + i) % 100))
            for i in range(per_tx)
        ]
        made.append(
            next(_core.insert(cfg, records, state=State.COMMITTED, tx_id=None, producer_group=None))
        )
    return made


def _write_paced(dsn: str, statements: list[Any], interval: float) -> tuple[list[float], float]:
    """Each statement in a transaction of its own, one every `interval` seconds, pipelined on
    one connection (a Python process waiting for each commit wrote a third of the rate, and
    four of them took the CPU the relay needed). Returns each transaction's commit time, as
    Postgres recorded it (track_commit_timestamp), and the seconds the writing took."""
    xids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.pipeline():
            started = next_at = time.monotonic()
            for query, params in statements:
                conn.execute("BEGIN")
                conn.execute(query, params)
                xids.append(conn.execute("SELECT pg_current_xact_id()::text"))
                conn.execute("COMMIT")  # no Sync here: psycopg's waits for the results
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        took = time.monotonic() - started
        rows = conn.execute(
            "SELECT extract(epoch FROM pg_xact_commit_timestamp(x::xid8::xid))::float8"
            " FROM unnest(%s::text[]) WITH ORDINALITY AS t(x, n) ORDER BY n",
            ([c.fetchone()[0] for c in xids],),
        ).fetchall()
    return [r[0] for r in rows], took


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float
    records: int
    achieved_per_s: float  # what was really written: below `rate` if the writer fell behind
    peak_rss_mb: float = 0.0  # the relays' largest


def warmup_keys(dsn: str, shards: int) -> list[str]:
    """A key of each shard, as publish() hashes a text key (its UTF-8 bytes' hex)."""
    with psycopg.connect(dsn) as conn:
        hashed = conn.execute(
            "SELECT k, hashtextextended(encode(convert_to(k, 'UTF8'), 'hex'), 0)"
            " FROM unnest(%s::text[]) AS k",
            ([f"warmup-{i}" for i in range(64 * shards)],),
        ).fetchall()
    first: dict[int, str] = {}
    for key, key_hash in hashed:
        first.setdefault(shard_of(key_hash, shards), key)
    if len(first) < shards:
        raise RuntimeError(f"no warm-up key found for each of {shards} shards")
    return [first[s] for s in sorted(first)]


def await_spread(
    conn: psycopg.Connection[Any], shards: int, relays: int, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Until every shard is held and spread evenly over the relays (they take shards from each
    other at their heartbeats): a shard moving during the timed load counted its new owner's
    recovery."""
    deadline = time.monotonic() + 120
    most = -(-shards // min(relays, shards))  # shards a relay holds at most once spread
    while True:
        counts = [
            n
            for (n,) in conn.execute(
                "SELECT count(*) FROM outbox.shard_lease"
                " WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner"
            ).fetchall()
        ]
        if sum(counts) == shards and max(counts) <= most:
            return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a relay exited before the latency load")
        if time.monotonic() > deadline:
            raise RuntimeError(f"shards held by relay after 120 s: {counts}, {shards} shards")
        time.sleep(0.2)


def latency(
    dsn: str,
    bootstrap: str,
    rate: float,
    seconds: float,
    per_tx: int = PER_TX,
    batch: int = BATCH,
    shards: int = 1,
    relays: int = 1,
) -> Latency:
    """Commit-to-visible, for transactions of `per_tx` records written at `rate` records/s, with
    `relays` relay processes sharing `shards` shards.

    From the commit time Postgres recorded to the poll of a read_committed consumer (a process
    of its own: in the writer's process it waited for the GIL, and that wait counted as
    latency), on this machine's clock. The timed load starts once the shards are spread over
    the relays and a warm-up record of each shard has arrived: each shard is recovered, its
    producer made, and the consumer reads.
    """
    topic = create_topic(bootstrap)
    statements = _transactions(topic, rate, seconds, per_tx)
    keys = warmup_keys(dsn, shards)
    env = relay_env(dsn, bootstrap, batch, shards=shards)
    procs = [
        subprocess.Popen([sys.executable, "-m", "relay.cli", "relay"], env=env, cwd=ROOT)
        for _ in range(relays)
    ]
    spawn = multiprocessing.get_context("spawn")
    ready, stop, arrivals = spawn.Event(), spawn.Event(), spawn.Queue()
    expected = spawn.Value("q", 0)
    reader = spawn.Process(
        target=_arrivals, args=(bootstrap, topic, ready, stop, expected, arrivals, len(keys))
    )
    reader.start()
    arrived: dict[bytes, float] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            await_spread(conn, shards, relays, procs)
            for key in keys:  # a transaction each: one spanning shards goes from one of them
                with conn.transaction():
                    Outbox().publish(conn, topic, b"warmup:", key=key)
        if not ready.wait(120):
            raise RuntimeError("the warm-up records did not all arrive in 120 s")
        committed, took = _write_paced(dsn, statements, per_tx / rate)
        expected.value = len(statements) * per_tx
        with contextlib.suppress(queue.Empty):  # a relay far behind: counted short below
            arrived = arrivals.get(timeout=120)
    finally:
        stop.set()
        if not arrived and reader.is_alive():
            with contextlib.suppress(queue.Empty):
                arrived = arrivals.get(timeout=60)
        reader.join(60)
        rss = max((peak_rss_mb(proc.pid) for proc in procs if proc.poll() is None), default=0.0)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    seen = sorted(
        (at - committed[int(prefix.split(b".")[0])]) * 1000 for prefix, at in arrived.items()
    )
    if len(seen) < len(statements) * per_tx:
        raise RuntimeError(
            f"only {len(seen)} of {len(statements) * per_tx} records arrived in 120 s"
        )
    return Latency(
        p50_ms=statistics.median(seen),
        p99_ms=seen[max(0, math.ceil(len(seen) * 0.99) - 1)],  # nearest rank
        records=len(seen),
        achieved_per_s=len(statements) * per_tx / took,
        peak_rss_mb=rss,
    )


def median_cpu(runs: list[dict[str, float]]) -> dict[str, float]:
    parts = sorted({part for run in runs for part in run})
    return {p: round(statistics.median(run.get(p, 0.0) for run in runs), 1) for p in parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--records", type=int, default=20_000, help="records of B1, B2 and the relay's drain"
    )
    parser.add_argument("--small", type=int, default=10_000, help="the small backlog")
    parser.add_argument("--large", type=int, default=1_000_000, help="the large backlog")
    parser.add_argument("--latency-seconds", type=float, default=15)
    parser.add_argument(
        "--latency-rate", type=float, help="records/s of the latency load (default: relay rate / 2)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of B1, B2 and the relay")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=BATCH,
        help="the relay's batch_size, and B1's transaction and B2's claim (default: the relay's)",
    )
    args = parser.parse_args()
    batch = args.batch_size
    if batch < 1:
        parser.error(f"--batch-size must be at least 1, not {batch}")
    for name in ("repeat", "latency_seconds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.latency_rate is not None and args.latency_rate <= 0:
        parser.error("--latency-rate must be positive")
    if min(args.records, args.small, args.large) <= batch:
        parser.error(f"--records, --small and --large must exceed the batch size, {batch}: a "
                     "drain's rate is timed after its first batch")  # fmt: skip
    _cpu.warn_if_busy()  # once the arguments are known good
    bootstrap = service_env()["OUTBOX_TEST_KAFKA_BOOTSTRAP"]
    sweep_leftover_topics(bootstrap)
    atexit.register(delete_made_topics, bootstrap)  # on an exception too

    # This machine's broker is noisy (B1 has varied 2x between runs): each figure is the median
    # of --repeat runs, interleaved so that a slow spell hits each alike.
    # The order turns each repeat: a spell that slows the first or last of a repeat hits each.
    b1s: list[Timed] = []
    b1ps: list[Timed] = []
    b2s: list[Timed] = []
    runs: list[Drain] = []

    def b2_run() -> None:
        with scratch_database() as dsn:
            b2s.append(b2_postgres(dsn, args.records, batch))

    def relay_run() -> None:
        with scratch_database() as dsn:
            runs.append(drain(dsn, bootstrap, args.records, batch=batch))

    steps: list[Callable[[], None]] = [
        lambda: b1s.append(b1_kafka(bootstrap, args.records, batch)),
        lambda: b1ps.append(b1_protocol(bootstrap, args.records, batch)),
        b2_run,
        relay_run,
    ]
    for n in range(args.repeat):
        for step in steps[n % len(steps) :] + steps[: n % len(steps)]:
            step()
        print(
            f"B1 {b1s[-1].rate:8.0f}/s   B1' {b1ps[-1].rate:8.0f}/s   B2 {b2s[-1].rate:8.0f}/s   "
            f"relay {runs[-1].rate:8.0f}/s (after its first batch {runs[-1].steady_rate:.0f}/s; "
            f"{args.records} backlog, peak RSS {runs[-1].peak_rss_mb:.0f} MB)\n"
            f"  CPU µs/record: B1 {b1s[-1].cpu}\n  B1' {b1ps[-1].cpu}\n  B2 {b2s[-1].cpu}\n"
            f"  relay {runs[-1].cpu}",
            flush=True,
        )
    # each repeat's own ratio (sorted): how far the run-to-run noise moves the headline's
    ratios = sorted(r.rate / min(a.rate, b.rate) for a, b, r in zip(b1s, b2s, runs, strict=True))
    b1 = statistics.median(t.rate for t in b1s)
    b1_protocol_rate = statistics.median(t.rate for t in b1ps)
    b2 = statistics.median(t.rate for t in b2s)
    small = statistics.median(r.rate for r in runs)
    steady = statistics.median(r.steady_rate for r in runs)
    rss_small = max(r.peak_rss_mb for r in runs)
    # half the rate it keeps once going: the conservative (higher) load of the two
    lat_rate = args.latency_rate or steady / 2
    with scratch_database() as dsn:
        lat = latency(dsn, bootstrap, lat_rate, args.latency_seconds, batch=batch)
    print(
        f"latency at {lat_rate:.0f}/s (written: {lat.achieved_per_s:.0f}/s, {PER_TX} a "
        f"transaction): p50 {lat.p50_ms:.1f} ms, p99 {lat.p99_ms:.1f} ms ({lat.records} records)",
        flush=True,
    )
    # Two shards: the backlog's transactions (10 keys of 100) each span both, and their home
    # shards alternate; a shard that waited for the other's whole backlog sent ~20 records/s.
    with scratch_database() as dsn:
        two_shard_run = drain(dsn, bootstrap, args.records, shards=2, batch=batch)
    two_shards = two_shard_run.rate
    print(f"relay, 2 shards, transactions across both: {two_shards:.0f}/s", flush=True)
    # Each backlog drain on a broker holding only its own topics: the earlier runs' left behind
    # made the large drain, run last, slower than the small ones (41% with many, _services.py).
    backlog_small = []
    for _ in range(args.repeat):
        delete_made_topics(bootstrap)
        with scratch_database() as dsn:
            backlog_small.append(drain(dsn, bootstrap, args.small, batch=batch))
    small_backlog = statistics.median(d.rate for d in backlog_small)
    small_backlog_steady = statistics.median(d.steady_rate for d in backlog_small)
    delete_made_topics(bootstrap)
    with scratch_database() as dsn:
        large_run = drain(dsn, bootstrap, args.large, batch=batch)
    large, rss_large = large_run.rate, large_run.peak_rss_mb
    rss_others = [
        two_shard_run.peak_rss_mb,
        lat.peak_rss_mb,
        *(d.peak_rss_mb for d in backlog_small),
    ]
    print(
        f"relay, backlog {args.small}: {small_backlog:.0f}/s ({small_backlog_steady:.0f}/s after "
        f"its first batch), backlog {args.large}: {large:.0f}/s "
        f"({large_run.steady_rate:.0f}/s after its first batch, which went out "
        f"{large_run.first_batch_s:.1f} s after its go; peak RSS {rss_large:.0f} MB)",
        flush=True,
    )

    # The CPU a record cost the whole stack (the client or relay, Postgres, the broker). A relay
    # does B1's Kafka work and B2's Postgres work: where the cores are all busy, its rate is at
    # most cores / its CPU per record, so above 1 here it cannot reach min(B1, B2) however it
    # overlaps them. None where /proc is not there to read.
    work = {
        name: statistics.median(_cpu.work_us(t.cpu, measuring=name == "relay") for t in timed)
        for name, timed in (("b1", b1s), ("b1_protocol", b1ps), ("b2", b2s), ("relay", runs))
    }

    def cpu_ratio(halves: float) -> float | None:
        return round(work["relay"] / halves, 3) if halves > 0 else None

    print(
        json.dumps(
            {
                "benchmark": "relay",
                "records": args.records,
                "repeat": args.repeat,
                "batch_size": batch,
                "b1_kafka_per_s": round(b1),
                "b2_postgres_per_s": round(b2),
                "relay_per_s": round(small),
                # after its first batch: the stamping of the backlog and the first claim apart
                "relay_steady_per_s": round(steady),
                "ratio_relay_vs_min_b1_b2": round(small / min(b1, b2), 3),
                "ratio_per_repeat": [round(r, 3) for r in ratios],
                # B1 with the relay's headers and markers (b1_protocol): no goal, a measure
                "b1_protocol_per_s": round(b1_protocol_rate),
                "ratio_relay_vs_b1_protocol": round(small / b1_protocol_rate, 3),
                # where each one's records cost CPU: medians per part over the runs
                "cpu_us_per_record": {
                    "b1": median_cpu([t.cpu for t in b1s]),
                    "b1_protocol": median_cpu([t.cpu for t in b1ps]),
                    "b2": median_cpu([t.cpu for t in b2s]),
                    "relay": median_cpu([r.cpu for r in runs]),
                },
                "cpu_work_us_per_record": {k: round(v, 1) for k, v in work.items()},
                "cpu_relay_vs_b1_plus_b2": cpu_ratio(work["b1"] + work["b2"]),
                "cpu_relay_vs_b1_protocol_plus_b2": cpu_ratio(work["b1_protocol"] + work["b2"]),
                "latency_rate_per_s": round(lat_rate),
                "latency_rate_achieved_per_s": round(lat.achieved_per_s),
                # false: the writer fell behind, and the percentiles are of a lighter load
                "latency_rate_reached": lat.achieved_per_s >= 0.95 * lat_rate,
                "latency_records_per_tx": PER_TX,
                "latency_p50_ms": round(lat.p50_ms, 1),
                "latency_p99_ms": round(lat.p99_ms, 1),
                # the largest of every relay run: drains, two shards, the latency load
                "peak_rss_mb": round(max(rss_small, rss_large, *rss_others), 1),
                "relay_two_shards_per_s": round(two_shards),
                "two_shards_vs_one": round(two_shards / small, 3),
                "small_backlog": args.small,
                "relay_small_backlog_per_s": round(small_backlog),
                "large_backlog": args.large,
                "relay_large_backlog_per_s": round(large),
                "throughput_drop_small_to_large": round(1 - large / small_backlog, 3),
                # the same after each drain's first batch, a measure, not the goal's figure: it
                # leaves out the go, the first claim and the stamping of the backlog's commit
                # times, which grows with the backlog (a million rows: ~30-60 s before the first
                # batch), so it flatters the large backlog
                "relay_small_backlog_steady_per_s": round(small_backlog_steady),
                "throughput_drop_steady": round(
                    1 - large_run.steady_rate / small_backlog_steady, 3
                ),
                "relay_large_backlog_steady_per_s": round(large_run.steady_rate),
                "large_backlog_first_batch_s": round(large_run.first_batch_s, 1),
                "goals": {
                    "ratio": 0.6,
                    "latency_p50_ms": 25,
                    "latency_p99_ms": 150,
                    "peak_rss_mb": 200,
                    "throughput_drop": 0.2,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
