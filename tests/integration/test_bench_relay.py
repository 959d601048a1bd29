"""`python -m bench.relay`, bench.spanning and bench.latency end to end, small: they run, honour
their arguments, and their final line is the JSON the README and the notes quote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

import outbox
from bench import relay as bench_relay
from bench.relay import b1_protocol, warmup_keys
from relay.markers import OUTBOX_ID_HEADER, Op, decode_markers
from relay.sharding import shard_of
from tests.fixtures.kafka import consume_all

ROOT = Path(__file__).resolve().parents[2]
# The relays spread their shards a heartbeat or two after they meet: 1 s apart, not 5 s, here
QUICK_SPREAD = {"OUTBOX_RELAY__HEARTBEAT_INTERVAL": "PT1S"}


def bench(
    *argv: str, module: str = "bench.relay", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_small_run_reports_every_figure_for_the_batch_size_asked(kafka_bootstrap: str) -> None:
    done = bench(
        *("--records", "300", "--small", "300", "--large", "600", "--repeat", "1"),
        *("--latency-seconds", "1", "--batch-size", "100"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["benchmark"] == "relay"
    assert (report["batch_size"], report["records"], report["large_backlog"]) == (100, 300, 600)
    for rate in ("b1_kafka_per_s", "b2_postgres_per_s", "relay_per_s", "relay_two_shards_per_s",
                 "relay_small_backlog_per_s", "relay_large_backlog_per_s"):  # fmt: skip
        assert report[rate] > 0, rate
    # The ratio is of the unrounded rates, to 3 decimals; the rates are reported whole: it lies
    # within what those roundings allow (a fixed tolerance failed for rates of a few hundred).
    relay, baseline = (
        report["relay_per_s"],
        min(report["b1_kafka_per_s"], report["b2_postgres_per_s"]),
    )
    lowest, highest = (relay - 0.5) / (baseline + 0.5), (relay + 0.5) / (baseline - 0.5)
    assert lowest - 0.0005 <= report["ratio_relay_vs_min_b1_b2"] <= highest + 0.0005
    assert 0 < report["latency_p50_ms"] <= report["latency_p99_ms"]
    assert report["latency_rate_achieved_per_s"] > 0
    assert isinstance(report["latency_rate_reached"], bool)
    # the latency load is half the rate the relay kept once going (both rounded to whole)
    assert abs(report["latency_rate_per_s"] - report["relay_steady_per_s"] / 2) <= 1
    small, large = report["relay_small_backlog_per_s"], report["relay_large_backlog_per_s"]
    drop = report["throughput_drop_small_to_large"]
    assert (
        1 - (large + 0.5) / (small - 0.5) - 0.0005
        <= drop
        <= 1 - (large - 0.5) / (small + 0.5) + 0.0005
    )
    assert 0 < report["peak_rss_mb"] < 1000
    assert set(report["cpu_us_per_record"]) == {"b1", "b1_protocol", "b2", "relay"}
    assert report["b1_protocol_per_s"] > 0
    assert len(report["ratio_per_repeat"]) == 1


def test_b1_protocol_writes_a_marker_of_each_record_where_it_landed(kafka_bootstrap: str) -> None:
    """B1' is said to do the Kafka work of the relay's protocol: each record with the relay's
    headers, and a delivered marker naming the partition and offset it landed at."""
    timed = b1_protocol(kafka_bootstrap, 250, batch=100)
    assert timed.rate > 0
    topic, markers = bench_relay.made_topics[-2:]
    try:
        landed = {
            int(dict(m.headers() or [])[OUTBOX_ID_HEADER]): (m.partition(), m.offset())
            for m in consume_all(kafka_bootstrap, topic, "read_committed")
            if m.key() != b"warm-up"
        }
        said = [
            marker
            for m in consume_all(kafka_bootstrap, markers, "read_committed")
            if m.value() != b"{}"  # the untimed warm-up's
            for marker in decode_markers(m.value() or b"")
        ]
    finally:
        bench_relay.delete_made_topics(kafka_bootstrap)
    assert sorted(landed) == list(range(250))
    assert {marker.op for marker in said} == {Op.DELIVERED}
    assert {marker.id: (marker.partition, marker.offset) for marker in said} == landed
    assert len(said) == 250


def test_the_spanning_benchmark_compares_each_shard_count_with_its_baseline(
    kafka_bootstrap: str,
) -> None:
    done = bench(
        *("--records", "600", "--shards", "2", "--relays", "2", "--batch-size", "100"),
        module="bench.spanning",
        env=QUICK_SPREAD,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert (report["benchmark"], report["records"], report["batch_size"]) == ("spanning", 600, 100)
    assert report["relays"] == 2
    figures = report["by_shards"]["2"]
    assert figures["spanning_per_s"] > 0
    assert figures["baseline_per_s"] > 0
    # from the rates before they were rounded to whole records/s: as far off as that rounding
    spanning_rate, baseline_rate = figures["spanning_per_s"], figures["baseline_per_s"]
    off = 0.5 / baseline_rate + 0.5 * spanning_rate / baseline_rate**2 + 0.0005
    assert abs(figures["ratio"] - spanning_rate / baseline_rate) <= off
    spanning = dict(re.findall(r"^2 shards, (\w+): .* (\d+) spanning shards", done.stdout, re.M))
    assert int(spanning["spanning"]) > 0
    assert spanning["baseline"] == "0"


def test_the_latency_benchmark_compares_each_shard_count_with_one_shard(
    kafka_bootstrap: str,
) -> None:
    done = bench(
        *("--shards", "2", "--rates", "100", "--seconds", "1", "--repeat", "1", "--relays", "2"),
        module="bench.latency",
        env=QUICK_SPREAD,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert (report["benchmark"], report["records_per_tx"], report["repeat"]) == ("latency", 1, 1)
    assert report["relays"] == 2
    figures = report["by_rate"]["100"]
    assert sorted(figures) == ["1", "2"]  # one shard, the baseline, runs though not asked
    for shards in ("1", "2"):
        assert 0 < figures[shards]["p50_ms"] <= figures[shards]["p99_ms"]
        assert figures[shards]["written_per_s"] > 0
    assert figures["1"]["p50_vs_one_shard"] == 1.0
    assert figures["2"]["p50_vs_one_shard"] == round(
        figures["2"]["p50_ms"] / figures["1"]["p50_ms"], 2
    )


@pytest.mark.parametrize(
    ("module", "argv", "said"),
    [
        ("bench.relay", ("--batch-size", "0"), "--batch-size must be at least 1, not 0"),
        ("bench.relay", ("--records", "100", "--batch-size", "100"),
         "must exceed the batch size, 100"),
        ("bench.spanning", ("--records", "0"), "--records must be at least 1, not 0"),
        ("bench.spanning", ("--relays", "0"), "--relays must be at least 1, not 0"),
        ("bench.spanning", ("--shards", "2,x"),
         "--shards must be whole numbers separated by commas"),
        ("bench.spanning", ("--share", "1.5"), "--share must be between 0 and 1, not 1.5"),
        ("bench.latency", ("--shards", "0,2"), "--shards must each be above 0, not '0,2'"),
        ("bench.latency", ("--rates", "fast"),
         "--rates must be numbers separated by commas, not 'fast'"),
        ("bench.latency", ("--seconds", "0"), "--seconds must be above 0, not 0"),
        ("bench.latency", ("--per-tx", "0"), "--per-tx must be above 0, not 0"),
        ("bench.latency", ("--relays", "0"), "--relays must be above 0, not 0"),
        ("bench.checker", ("--sizes", "10k"),
         "--sizes must be whole numbers separated by commas, not '10k'"),
        ("bench.checker", ("--sizes", "100,0"), "--sizes must each be above 0, not '100,0'"),
        ("bench.spanning", ("--shards", "1,0"), "--shards must each be above 0, not '1,0'"),
        ("bench.checker", ("--work", "half"),
         "--work must be all or a whole number of at least 1, not 'half'"),
        ("bench.checker", ("--work", "0"),
         "--work must be all or a whole number of at least 1, not '0'"),
        ("bench.checker", ("--rounds", "0"), "--rounds must be at least 1, not 0"),
        ("bench.checker", ("--concurrency", "0"), "--concurrency must be at least 1, not 0"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_runs(
    module: str, argv: tuple[str, ...], said: str
) -> None:
    done = bench(*argv, module=module)
    assert done.returncode == 2
    assert said in done.stderr


@pytest.mark.parametrize("shards", [1, 4])
def test_the_latency_warm_up_has_a_record_in_each_shard(pg_dsn: str, shards: int) -> None:
    """The timed load starts once each shard delivered: a shard still recovering when it began
    counted its start-up as latency."""
    keys = warmup_keys(pg_dsn, shards)
    with psycopg.connect(pg_dsn) as conn:
        for key in keys:
            with conn.transaction():
                outbox.publish(conn, "bench.warmup", b"warmup:", key=key)
        hashes = conn.execute("SELECT key_hash FROM outbox.outbox_record ORDER BY id").fetchall()
    assert [shard_of(h, shards) for (h,) in hashes] == list(range(shards))
