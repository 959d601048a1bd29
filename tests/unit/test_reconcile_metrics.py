"""A running reconciliation's metrics and probes (`--http-port`), without Spark: the reports and
the job are stand-ins; tests/spark/test_reconcile_integration.py scrapes a real job."""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spark.config import FINDING_KINDS, JudgeWindow, ReconcileSettings
from spark.job import ReconcileJob, RunReport
from spark.metrics import ReconcileMetrics, start_probes
from tests.fixtures.http import get

T = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SETTINGS = ReconcileSettings(
    dsn="postgresql://u:secret@db:5432/app",
    bootstrap_servers="k:9092",
    topics=("orders",),
    checkpoint="/tmp/cp",
    trigger=timedelta(seconds=10),
    deadline=timedelta(seconds=60),
)


def _report(detected_in: str, new: dict[str, int], **fields: Any) -> RunReport:
    window = JudgeWindow.streaming(T, SETTINGS.deadline, SETTINGS.horizon)
    values: dict[str, Any] = {
        "detected_in": detected_in,
        "window": window,
        "copies": 0,
        "markers": 0,
        "ledger_rows": 0,
        "found": dict(new),
        "new": new,
        **fields,
    }
    return RunReport(**values)


def _samples(metrics: ReconcileMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_reports_add_up_to_new_findings_judgements_and_what_was_judged() -> None:
    started = time.time()
    metrics = ReconcileMetrics(SETTINGS)
    before = _samples(metrics)
    for kind in FINDING_KINDS:  # every kind there at 0 before the first finding
        assert before[("outbox_reconcile_findings_total", (("kind", kind),))] == 0
    assert math.isnan(before[("outbox_reconcile_judged_to_timestamp_seconds", ())])
    # a stall alert counts from the job's start until its first judgement
    assert before[("outbox_reconcile_last_judgement_timestamp_seconds", ())] >= started
    metrics.observe(
        _report(
            "batch 7",
            {"missing": 1, "duplicate": 2},
            copies=400,  # its context too: seen again by the next judgements
            markers=410,
            copies_judged=40,
            markers_judged=41,
            seconds={"store": 1.5, "ledger": 0.5},
        )
    )
    metrics.observe(_report("tick", {"missing": 0}, seconds={"idle_check": 0.01}))
    metrics.observe(
        _report("batch 8", {"missing": 3}, copies=20, markers=10, copies_judged=2, markers_judged=1)
    )
    s = _samples(metrics)
    assert s[("outbox_reconcile_findings_total", (("kind", "missing"),))] == 4
    assert s[("outbox_reconcile_findings_total", (("kind", "duplicate"),))] == 2
    assert s[("outbox_reconcile_findings_total", (("kind", "orphan"),))] == 0
    assert s[("outbox_reconcile_judgements_total", (("trigger", "batch"),))] == 2
    assert s[("outbox_reconcile_judgements_total", (("trigger", "tick"),))] == 1
    assert s[("outbox_reconcile_copies_judged_total", ())] == 42
    assert s[("outbox_reconcile_markers_judged_total", ())] == 42
    assert s[("outbox_reconcile_judgement_duration_seconds_count", ())] == 3
    assert s[("outbox_reconcile_judgement_duration_seconds_sum", ())] == pytest.approx(2.01)
    hi = JudgeWindow.streaming(T, SETTINGS.deadline, SETTINGS.horizon).hi
    assert s[("outbox_reconcile_judged_to_timestamp_seconds", ())] == hi.timestamp()
    assert s[("outbox_reconcile_last_judgement_timestamp_seconds", ())] > T.timestamp()
    assert s[("outbox_reconcile_trigger_interval_seconds", ())] == 10
    assert s[("outbox_reconcile_deadline_seconds", ())] == 60


def test_a_stall_counts_across_restarts_from_the_checkpoints_last_judgement() -> None:
    """Counted from each start, a job that failed and was started again every few minutes (a
    database gone silent: --jdbc-read-timeout) never stalled, and judged nothing (found by a
    review of the alerts)."""
    metrics = ReconcileMetrics(SETTINGS)
    job: list[_Job] = []  # started from its checkpoint, not judged yet
    metrics.watch(lambda: cast("ReconcileJob", job[0]) if job else None)
    started = _samples(metrics)[("outbox_reconcile_last_judgement_timestamp_seconds", ())]
    assert started >= time.time() - 60  # before the job is made: the start
    job.append(_Job(judged_to=T))  # its checkpoint: judged to T, an hour or more ago
    s = _samples(metrics)
    assert s[("outbox_reconcile_judged_to_timestamp_seconds", ())] == T.timestamp()
    assert s[("outbox_reconcile_last_judgement_timestamp_seconds", ())] == T.timestamp() + 60
    job[0] = _Job(judged_to=None)  # no checkpoint: from the start
    s = _samples(metrics)
    assert math.isnan(s[("outbox_reconcile_judged_to_timestamp_seconds", ())])
    assert s[("outbox_reconcile_last_judgement_timestamp_seconds", ())] == started
    job[0] = _Job(judged_to=T)
    metrics.observe(_report("batch 0", {}))  # this run's own judgement
    s = _samples(metrics)
    hi = JudgeWindow.streaming(T, SETTINGS.deadline, SETTINGS.horizon).hi
    assert s[("outbox_reconcile_judged_to_timestamp_seconds", ())] == hi.timestamp()
    assert s[("outbox_reconcile_last_judgement_timestamp_seconds", ())] >= started


def test_the_newest_closed_window_sets_the_latency_quantiles() -> None:
    metrics = ReconcileMetrics(SETTINGS)

    def window(start: datetime, p50: float, p95: float, p99: float, most: float) -> dict[str, Any]:
        return {
            "window_start": start,
            "records": 10,
            "latency_p50_ms": p50,
            "latency_p95_ms": p95,
            "latency_p99_ms": p99,
            "latency_max_ms": most,
        }

    older = window(T - timedelta(minutes=1), 900, 900, 900, 900)
    newest = window(T, 20, 45, 80, 120)
    metrics.observe(_report("batch 1", {}, windows=[newest, older]))
    s = _samples(metrics)
    by_quantile = {
        dict(labels)["quantile"]: value
        for (name, labels), value in s.items()
        if name == "outbox_reconcile_window_latency_seconds"
    }
    assert by_quantile == pytest.approx({"0.5": 0.02, "0.95": 0.045, "0.99": 0.08, "1": 0.12})


@dataclass
class _Job:
    """What the probes read of a ReconcileJob."""

    alive: bool = True
    running: bool = False
    last_trigger_end: datetime | None = None
    judged_to: datetime | None = None


def _scraped(port: int) -> dict[str, float]:
    """/metrics' samples without labels."""
    code, text = get(port, "/metrics")
    assert code == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.labels
    }


def test_the_probes_answer_while_the_job_starts_runs_and_fails() -> None:
    metrics = ReconcileMetrics(SETTINGS)
    made: list[_Job] = []
    server = start_probes("127.0.0.1", 0, metrics, lambda: cast(Any, made[0]) if made else None)
    try:
        # before the Spark session exists: alive (a kubelet must not kill a starting job), not
        # ready, and the last trigger unknown
        assert get(server.port, "/healthz") == (200, b'{"reconcile": true}')
        code, body = get(server.port, "/readyz")
        assert (code, json.loads(body)) == (503, {"reconcile": {"ready": False}})
        assert math.isnan(_scraped(server.port)["outbox_reconcile_last_trigger_timestamp_seconds"])

        job = _Job(running=True, last_trigger_end=T)
        made.append(job)
        code, body = get(server.port, "/readyz")
        assert (code, json.loads(body)) == (
            200,
            {"reconcile": {"ready": True, "last_trigger": T.isoformat()}},
        )
        scraped = _scraped(server.port)
        assert scraped["outbox_reconcile_last_trigger_timestamp_seconds"] == T.timestamp()
        assert not [name for name in scraped if not name.startswith("outbox_reconcile_")]

        job.alive, job.running = False, False  # the query died, or the idle judgement failed
        assert get(server.port, "/healthz") == (503, b'{"reconcile": false}')
        assert get(server.port, "/readyz")[0] == 503
    finally:
        server.stop()


def test_a_taken_port_is_refused_naming_the_option() -> None:
    from spark._errors import ReconcileConfigError
    from spark.job import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--dsn", "postgresql://x", "--bootstrap", "k", "--topics", "a"]
        argv += ["--checkpoint", "cp", "--http-host", "127.0.0.1", "--http-port", str(port)]
        with pytest.raises(ReconcileConfigError, match=f"--http-port {port} on --http-host"):
            main(argv)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--http-port", "8090", "--once"], "not with --once or --from/--to"),
        (["--http-port", "80000"], "not a port number (0-65535): '80000'"),
        (["--http-port", "metrics"], "not a port number (0-65535): 'metrics'"),
    ],
)
def test_http_port_is_refused_where_it_cannot_serve(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from spark.job import main

    argv = ["--dsn", "postgresql://x", "--bootstrap", "k", "--topics", "a", "--checkpoint", "cp"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, *extra])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
