"""A running job's Prometheus metrics and probes (`--http-port`): what it found, how far it
has judged, whether it still judges. Imported only when asked for: a cluster's driver runs
the job without prometheus_client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relay.http import ProbeServer
from spark.config import FINDING_KINDS, ReconcileSettings

if TYPE_CHECKING:
    from spark.job import ReconcileJob, RunReport

# the summary window's columns, by the quantile label they are exported under
_WINDOW_QUANTILES = {
    "0.5": "latency_p50_ms",
    "0.95": "latency_p95_ms",
    "0.99": "latency_p99_ms",
    "1": "latency_max_ms",
}


def _timestamp(value: datetime | None) -> float:
    return value.timestamp() if value is not None else float("nan")


class ReconcileMetrics:
    """The job's metrics, in a registry of their own (a process may run several jobs: tests).

    `observe(report)` takes every judgement's report (ReconcileJob's `on_report`); `watch(job)`
    adds what is read from the running query when scraped.
    """

    def __init__(self, settings: ReconcileSettings) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.findings = Counter(
            "outbox_reconcile_findings_total",
            "Findings written for the first time, by kind (a finding found again is not counted).",
            ["kind"],
            registry=r,
        )
        for kind in FINDING_KINDS:  # at 0 from the start: increase() sees the first one
            self.findings.labels(kind=kind)
        self.judgements = Counter(
            "outbox_reconcile_judgements_total",
            "Judgements, by what made them: a micro-batch (batch) or an idle tick (tick).",
            ["trigger"],
            registry=r,
        )
        self.judgement_seconds = Histogram(
            "outbox_reconcile_judgement_duration_seconds",
            "Wall time of a judgement (idle ones included: they skip Spark).",
            buckets=(0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )
        # Each once, by the judgement whose window holds its Kafka time: counted for every
        # judgement that looked at it (its context too), a copy was counted ~13 times with the
        # defaults, and rate() said 13 times the traffic.
        self.copies = Counter(
            "outbox_reconcile_copies_judged_total",
            "Copies of records on the delivered topics judged, each once.",
            registry=r,
        )
        self.markers = Counter(
            "outbox_reconcile_markers_judged_total",
            "Op markers judged, each once.",
            registry=r,
        )
        self._deadline_s = settings.deadline.total_seconds()
        self._started_at = time.time()
        self._judged_at: float | None = None  # when this process's last judgement ended
        self._observed_to: datetime | None = None  # and up to when it judged
        self._job: Callable[[], ReconcileJob | None] = lambda: None
        self.judged_to = Gauge(
            "outbox_reconcile_judged_to_timestamp_seconds",
            "Records of times before this (commits, markers, copies) are judged: the last "
            "judgement's as-of time less the deadline (before this run's first, its checkpoint's).",
            registry=r,
        )
        # not 1970 on a dashboard before the first: NaN
        self.judged_to.set_function(lambda: _timestamp(self._judged_to()))
        self.last_judgement = Gauge(
            "outbox_reconcile_last_judgement_timestamp_seconds",
            "When the last judgement ended; before this run's first, when the checkpoint's last "
            "was made (its as-of time), or without one when the job started.",
            registry=r,
        )
        self.last_judgement.set_function(self._last_judgement)
        self.window_latency = Gauge(
            "outbox_reconcile_window_latency_seconds",
            "Commit to topic time in the newest closed summary window, by quantile (1: max).",
            ["quantile"],
            registry=r,
        )
        self.last_trigger = Gauge(
            "outbox_reconcile_last_trigger_timestamp_seconds",
            "When the streaming query's last trigger ended (one ends every trigger interval).",
            registry=r,
        )
        # the job's own settings, for alert thresholds and dashboards that follow them
        self.trigger_interval = Gauge(
            "outbox_reconcile_trigger_interval_seconds",
            "The job's --trigger.",
            registry=r,
        )
        self.trigger_interval.set(settings.trigger.total_seconds())
        self.deadline = Gauge(
            "outbox_reconcile_deadline_seconds",
            "The job's --deadline: a delivered record not on its topic by then is missing (one "
            "still waiting for the relay: by --undelivered-deadline).",
            registry=r,
        )
        self.deadline.set(settings.deadline.total_seconds())

    def observe(self, report: RunReport) -> None:
        for kind, count in report.new.items():
            self.findings.labels(kind=kind).inc(count)
        self.judgements.labels(trigger=report.detected_in.split(" ", 1)[0]).inc()
        self.judgement_seconds.observe(sum(report.seconds.values()))
        self.copies.inc(report.copies_judged)
        self.markers.inc(report.markers_judged)
        self._observed_to = report.window.hi
        self._judged_at = time.time()
        if report.windows:
            newest = max(report.windows, key=lambda w: w["window_start"])
            for quantile, column in _WINDOW_QUANTILES.items():
                ms = newest.get(column)
                if ms is not None:
                    self.window_latency.labels(quantile=quantile).set(ms / 1000)

    def _judged_to(self) -> datetime | None:
        if self._observed_to is not None:
            return self._observed_to
        current = self._job()  # before this run's first judgement: its checkpoint's
        return current.judged_to if current is not None else None

    def _last_judgement(self) -> float:
        """A stall alert counts across restarts: from the start of each, a job that failed
        and was started again every few minutes (a database gone silent) never stalled."""
        if self._judged_at is not None:
            return self._judged_at
        resumed = self._judged_to()
        if resumed is not None:
            return min(time.time(), resumed.timestamp() + self._deadline_s)
        return self._started_at

    def watch(self, job: Callable[[], ReconcileJob | None]) -> None:
        """Read the query's last trigger, and how far it judged, from the job `job()` returns
        (None: not made yet)."""
        self._job = job

        def last_trigger() -> float:
            current = job()
            return _timestamp(current.last_trigger_end if current is not None else None)

        self.last_trigger.set_function(last_trigger)


def start_probes(
    host: str,
    port: int,
    metrics: ReconcileMetrics,
    job: Callable[[], ReconcileJob | None],
) -> ProbeServer:
    """/healthz, /readyz and /metrics of a continuous job, served from before its Spark session
    exists (that takes half a minute or more): alive while it starts, and then while its query
    runs; ready once the query runs."""

    def alive() -> bool:
        current = job()
        return current is None or current.alive

    def ready() -> dict[str, Any]:
        current = job()
        if current is None or not current.running:
            return {"ready": False}
        last = current.last_trigger_end
        return {"ready": True, "last_trigger": last.isoformat() if last is not None else None}

    metrics.watch(job)
    server = ProbeServer(
        host,
        port,
        alive={"reconcile": alive},
        ready={"reconcile": ready},
        registry=metrics.registry,
        settings=("--http-port", "--http-host"),
    )
    server.start()
    return server
