"""The summary windows' latency histograms, merged on the driver between judgements."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from spark.latency import OpenWindows, WindowLatency, bucket, close, merge_rows

T = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def test_a_bucket_keeps_three_significant_digits() -> None:
    assert [bucket(v) for v in (0.0, 7.0, 25.0, 999.0, 1000.0)] == [0.0, 7.0, 25.0, 999.0, 1000.0]
    assert bucket(1234.5) == 1230.0
    assert bucket(1235.0) == 1240.0  # half away from zero, as Spark's round()
    assert bucket(-1235.0) == -1240.0  # a Kafka clock behind the database's
    assert bucket(0.012345) == pytest.approx(0.0123)
    for value in (0.37, 3.7, 123_456.0, 9_999_999.0):
        assert abs(bucket(value) - value) <= value * 0.005  # half a unit of the third digit


def test_percentiles_are_nearest_ranks() -> None:
    w = WindowLatency(T, T + MINUTE)
    for ms in range(1, 101):  # 1..100 ms, one record each
        w.add(float(ms), 1, float(ms))
    assert (w.records, w.percentile(0.5), w.percentile(0.95), w.percentile(0.99)) == (
        100, 50.0, 95.0, 99.0,
    )  # fmt: skip
    assert w.summary()["latency_max_ms"] == 100.0
    assert WindowLatency(T, T + MINUTE).percentile(0.5) is None


def test_a_window_is_emitted_once_it_closes_with_what_every_judgement_added() -> None:
    first = [(T, T + MINUTE, 10.0, 3, 10.2), (T + MINUTE, T + 2 * MINUTE, 20.0, 1, 20.0)]
    closed, still_open = close(merge_rows({}, first), T + MINUTE - timedelta(seconds=1), T)
    assert closed == []
    assert set(still_open.windows) == {T, T + MINUTE}
    carried = still_open.windows
    second = [(T, T + MINUTE, 30.0, 1, 31.0)]
    closed, still_open = close(merge_rows(carried, second), T + MINUTE, T)
    ((summary),) = [w.summary() for w in closed]
    assert (summary["window_start"], summary["records"], summary["latency_max_ms"]) == (T, 4, 31.0)
    assert (summary["latency_p50_ms"], summary["latency_p99_ms"]) == (10.0, 30.0)
    assert set(still_open.windows) == {T + MINUTE}
    assert carried[T].records == 3  # merging made new histograms: a failed judgement left it


def test_open_windows_survive_a_restart() -> None:
    rows = [(T, T + MINUTE, 12.3, 5, 12.31), (T, T + MINUTE, -4.0, 1, -4.0)]
    _, still_open = close(merge_rows({}, rows), T + timedelta(seconds=30), T)
    loaded = OpenWindows.from_json(json.loads(json.dumps(still_open.as_json())))
    assert loaded == still_open
