"""Latency histograms of the summary windows, kept between judgements.

A running job judges each copy once, but a summary window spans many judgements. Its percentiles
cannot be merged, so each judgement adds its copies to a histogram of the window (latencies kept
with LATENCY_DIGITS significant digits: exact counts, values within 0.5 %), and the window is
summarised from it once it closes. The windows still open are carried to the next judgement
(and kept under the checkpoint with `judged_to`), instead of classifying their copies again.

Nothing here imports PySpark (unit tests run it without a JVM).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

LATENCY_DIGITS = 3
PERCENTILES = (0.5, 0.95, 0.99)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def bucket(latency_ms: float) -> float:
    """`latency_ms` rounded to LATENCY_DIGITS significant digits (transform.latency_bucket)."""
    if latency_ms == 0:
        return 0.0
    quantum = 10.0 ** (math.floor(math.log10(abs(latency_ms))) - (LATENCY_DIGITS - 1))
    steps = math.floor(abs(latency_ms) / quantum + 0.5)  # half away from zero, as Spark's round
    return math.copysign(steps * quantum, latency_ms)


@dataclass
class WindowLatency:
    """One summary window's canonical copies: how many of each latency bucket, and the maximum."""

    start: datetime
    end: datetime
    counts: Counter[float] = field(default_factory=Counter)
    max_ms: float | None = None

    def add(self, bucket_ms: float, records: int, max_ms: float) -> None:
        self.counts[bucket_ms] += records
        self.max_ms = max_ms if self.max_ms is None else max(self.max_ms, max_ms)

    @property
    def records(self) -> int:
        return sum(self.counts.values())

    def percentile(self, p: float) -> float | None:
        """The smallest bucket with at least p of the records at or below it (nearest rank)."""
        total = self.records
        if total == 0:
            return None
        rank, seen = max(1, math.ceil(p * total)), 0
        for bucket_ms in sorted(self.counts):
            seen += self.counts[bucket_ms]
            if seen >= rank:
                return bucket_ms
        raise AssertionError("unreachable: the ranks add up to the total")

    def summary(self) -> dict[str, Any]:
        """The window's row in the sink (transform.WINDOW_SCHEMA)."""
        p50, p95, p99 = (self.percentile(p) for p in PERCENTILES)
        return {
            "window_start": self.start,
            "window_end": self.end,
            "records": self.records,
            "latency_p50_ms": p50,
            "latency_p95_ms": p95,
            "latency_p99_ms": p99,
            "latency_max_ms": self.max_ms,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "start_us": _micros(self.start),
            "end_us": _micros(self.end),
            "counts": [[b, n] for b, n in sorted(self.counts.items())],
            "max_ms": self.max_ms,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WindowLatency:
        window = cls(_from_micros(int(data["start_us"])), _from_micros(int(data["end_us"])))
        for bucket_ms, records in data["counts"]:
            window.counts[float(bucket_ms)] += int(records)
        window.max_ms = None if data["max_ms"] is None else float(data["max_ms"])
        return window


@dataclass
class OpenWindows:
    """The summary windows still open after a judgement: they hold every canonical copy from
    `counted_from` up to that judgement's `hi`."""

    counted_from: datetime
    windows: dict[datetime, WindowLatency]

    def as_json(self) -> dict[str, Any]:
        return {
            "counted_from_us": _micros(self.counted_from),
            "windows": [w.as_json() for _, w in sorted(self.windows.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpenWindows:
        windows = [WindowLatency.from_json(w) for w in data["windows"]]
        return cls(_from_micros(int(data["counted_from_us"])), {w.start: w for w in windows})


def close(
    merged: dict[datetime, WindowLatency], hi: datetime, counted_from: datetime
) -> tuple[list[WindowLatency], OpenWindows]:
    """The windows that ended by `hi` (in order: emit them), and those still open."""
    closed = sorted((w for w in merged.values() if w.end <= hi), key=lambda w: w.start)
    still_open = {start: w for start, w in merged.items() if w.end > hi}
    return closed, OpenWindows(counted_from, still_open)


def merge_rows(
    carried: dict[datetime, WindowLatency], rows: list[tuple[datetime, datetime, float, int, float]]
) -> dict[datetime, WindowLatency]:
    """The carried windows plus a judgement's histogram rows (start, end, bucket, records, max)."""
    merged = {start: _copy(w) for start, w in carried.items()}
    for start, end, bucket_ms, records, max_ms in rows:
        merged.setdefault(start, WindowLatency(start, end)).add(bucket_ms, records, max_ms)
    return merged


def _copy(window: WindowLatency) -> WindowLatency:
    return WindowLatency(window.start, window.end, Counter(window.counts), window.max_ms)


def _micros(t: datetime) -> int:
    return (t - _EPOCH) // timedelta(microseconds=1)


def _from_micros(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)
