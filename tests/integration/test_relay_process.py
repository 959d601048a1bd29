"""The relay process as operators see it: probes, metrics, graceful SIGTERM hand-over."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import outbox
from relay import sidecar
from relay.config import HttpSettings, SidecarSettings
from relay.service import Relay, RelayRound
from tests.fixtures.http import free_port, get
from tests.fixtures.relay import RelayProcess
from tests.integration.test_relay_crashes import FAST, undelivered, wait_for


def test_probes_metrics_and_graceful_shutdown(
    pg_dsn: str, topic_factory: Callable[..., str], relay_process: Callable[..., RelayProcess]
) -> None:
    topic = topic_factory()
    port = free_port()
    relay = relay_process(http_port=port, **FAST)
    wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "the relay to be ready")
    ready = json.loads(get(port, "/readyz")[1])
    assert ready["relay"]["database"] is True
    assert ready["relay"]["broker"] is True
    wait_for(lambda: json.loads(get(port, "/readyz")[1])["relay"]["shards"] == [0], 30, "a shard")
    assert get(port, "/healthz")[0] == 200
    assert get(port, "/nope")[0] == 404

    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(3):
            outbox.publish(conn, topic, f"m{i}")
    wait_for(lambda: undelivered(pg_dsn) == 0, 30, "delivery")
    metrics = get(port, "/metrics")[1].decode()
    assert f'outbox_relay_records_delivered_total{{topic="{topic}"}} 3.0' in metrics
    assert "outbox_relay_kafka_commit_seconds_count" in metrics
    assert "outbox_relay_delivery_lag_seconds_count 1.0" in metrics  # one transaction
    assert "outbox_relay_shards_owned 1.0" in metrics

    assert relay.terminate(timeout=30) == 0, relay.output()
    assert "received SIGTERM" in relay.output()
    with psycopg.connect(pg_dsn) as conn:  # handed back, not left to expire
        assert conn.execute("SELECT owner FROM outbox.shard_lease").fetchall() == [(None,)]
        assert conn.execute("SELECT count(*) FROM outbox.relay_member").fetchone() == (0,)


def test_a_relay_is_not_ready_before_its_setup_is_done(relay_factory: Callable[..., Any]) -> None:
    """Database and broker reachable was all /readyz asked: a relay whose setup (its topics,
    the schema and settings checks) had not run, or kept failing, probed ready."""
    relay = relay_factory()
    before = relay.ready()
    assert (before["database"], before["broker"]) == (True, True)
    assert (before["ready"], before["set_up"]) == (False, False)
    relay.run_once()
    after = relay.ready()
    assert (after["ready"], after["set_up"]) == (True, True)


def test_a_relay_stopped_by_a_setting_that_cannot_work_ends_the_process(
    pg_dsn: str,
    relay_factory: Callable[..., Any],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """Not a process that lingers, probes green, doing nothing: it exits non-zero with the
    error in its log, and is restarted."""
    relay_factory(shards=2).run_once()  # the outbox's leases are for 2 shards
    proc = relay_process(shards=4)
    assert proc.proc.wait(60) == 1
    assert "made for 2 shards" in proc.output()
    assert "no longer running" in proc.output()


def test_a_sidecar_told_to_retry_stays_up_while_its_relay_cannot_run(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    relay_settings: Callable[..., SidecarSettings],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """In an application's pod (the chart's sidecar mode) the sidecar's exit made the pod
    unready, out of its Service: an outbox not migrated yet made the application unavailable.
    With on_part_stopped = retry it stays up, says so, and starts the relay once it can run."""
    port = free_port()
    settings = relay_settings(schema_name="migrated_later", **FAST)
    retrying = {"OUTBOX_ON_PART_STOPPED": "retry", "OUTBOX_PART_RETRY_INTERVAL": "PT1S"}
    proc = relay_process(settings=settings, http_port=port, env=retrying)

    def stopped() -> float | None:
        status, body = get(port, "/metrics")
        for line in body.decode().splitlines() if status == 200 else ():
            if line.startswith('outbox_sidecar_part_stopped{part="relay"}'):
                return float(line.rsplit(" ", 1)[1])
        return None

    wait_for(lambda: stopped() == 1.0, 60, "the relay to stop and wait", proc)
    assert "run `outboxctl migrate --schema migrated_later`" in proc.output()
    assert proc.proc.poll() is None, proc.output()  # up, not exited
    assert get(port, "/healthz")[0] == 200  # not restarted by the liveness probe
    assert json.loads(get(port, "/readyz")[1])["relay"] == {"ready": False, "stopped": True}
    outbox.migrate(pg_dsn, "migrated_later")
    wait_for(lambda: stopped() == 0.0, 60, "the relay to start again", proc)
    topic = topic_factory()
    later = outbox.Outbox(outbox.OutboxConfig(schema_name="migrated_later"))
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        later.publish(conn, topic, "delivered once the schema is there")
    wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "the relay to be ready", proc)

    def waiting() -> int:
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM migrated_later.outbox_record WHERE state = 'committed'"
            ).fetchone()
        return int(row[0]) if row else -1

    wait_for(lambda: waiting() == 0, 60, "the delivery", proc)
    assert "relay started again" in proc.output()
    assert proc.terminate() == 0, proc.output()


def test_a_sigterm_during_a_slow_gauge_refresh_stops_the_sidecar_at_once(
    relay_settings: Callable[..., SidecarSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main loop used to refresh the gauges itself: a SIGTERM that came during a refresh
    (a new connection, up to the connect timeout in a database outage) waited for it."""
    refreshing, release = threading.Event(), threading.Event()

    def slow_refresh(_relay: Relay) -> None:
        refreshing.set()
        release.wait(45)

    monkeypatch.setattr(Relay, "refresh_gauges", slow_refresh)
    monkeypatch.setattr(sidecar, "_GAUGE_INTERVAL_S", 0.05)
    monkeypatch.setattr(sidecar.logs, "configure", lambda *_: None)  # keep pytest's logging
    settings = relay_settings(**FAST).model_copy(update={"http": HttpSettings(enabled=False)})
    terminated_at: list[float] = []

    def terminate_during_a_refresh() -> None:
        if refreshing.wait(60):
            terminated_at.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=terminate_during_a_refresh, daemon=True).start()
    try:
        status = sidecar.run(settings, only="relay")
        stopped_after = time.monotonic() - terminated_at[0]
    finally:
        release.set()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status == 0
    assert stopped_after < 30, f"stopped {stopped_after:.1f} s after SIGTERM"  # was 45: the refresh


def test_a_round_that_outlasts_the_grace_makes_the_exit_status_1(
    relay_settings: Callable[..., SidecarSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay still in its round after shutdown_grace left a Kafka transaction open and its
    leases held, and the process still exited 0, as after a clean stop."""
    in_round, release = threading.Event(), threading.Event()

    def stuck_round(_relay: Relay, **_: Any) -> RelayRound:
        in_round.set()
        release.wait(30)
        return RelayRound()

    monkeypatch.setattr(Relay, "run_once", stuck_round)
    monkeypatch.setattr(sidecar.logs, "configure", lambda *_: None)  # keep pytest's logging
    settings = relay_settings(**FAST, shutdown_grace="PT1S").model_copy(
        update={"http": HttpSettings(enabled=False)}
    )

    def terminate_in_the_round() -> None:
        if in_round.wait(60):
            os.kill(os.getpid(), signal.SIGTERM)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=terminate_in_the_round, daemon=True).start()
    try:
        status = sidecar.run(settings, only="relay")
    finally:
        release.set()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status == 1


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a sidecar's output, as the JSON object it must be."""
    entries = []
    for line in text.splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a line that is not JSON: {line[:300]!r}\n{text[-3000:]}")
    return entries


def _sidecar_env(relay_settings: Callable[..., SidecarSettings], **more: str) -> dict[str, str]:
    settings = relay_settings(**FAST)
    return {
        **os.environ,
        "OUTBOX_DATABASE__DSN": settings.database.dsn.get_secret_value(),
        "OUTBOX_RELAY": settings.relay.model_dump_json(),
        "OUTBOX_CHECKER__ENABLED": "false",
        "OUTBOX_LOG_FORMAT": "json",
        **more,
    }


def test_the_sidecar_logs_only_json_through_an_outage_and_a_probe_given_up(
    relay_settings: Callable[..., SidecarSettings], tmp_path: Any
) -> None:
    """librdkafka wrote its own lines to stderr (about 14 a second with the broker down), and
    a probe whose client gave up before the answer printed a raw traceback: a log pipeline
    that parses one JSON object per line lost or rejected them."""
    port = free_port()
    env = _sidecar_env(
        relay_settings,
        OUTBOX_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",  # nobody listens there
        OUTBOX_HTTP__HOST="127.0.0.1",
        OUTBOX_HTTP__PORT=str(port),
    )
    log = tmp_path / "sidecar.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "relay"], env=env, stdout=out, stderr=out
        )
    try:
        wait_for(lambda: get(port, "/healthz")[0] == 200, 60, "the probes")
        for _ in range(3):  # a client that gives up: it closes before the answer
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: "relay.librdkafka" in log.read_text(), 30, "librdkafka's own lines")
    finally:
        proc.terminate()
        proc.wait(30)
    entries = _json_lines(log.read_text())
    kafka_lines = [e for e in entries if e["logger"] == "relay.librdkafka"]
    assert any("Connect to" in e["message"] for e in kafka_lines), kafka_lines[:3]


def _the_line_of_a_failed_start(env: dict[str, str], command: str) -> dict[str, Any]:
    """`outboxctl <command>` that cannot start: exit 1, and one JSON line saying why."""
    done = subprocess.run(
        [sys.executable, "-m", "relay.cli", command], env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    (entry,) = _json_lines(done.stderr)
    return entry


def test_a_sidecar_with_nothing_to_run_says_so_in_json(
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    env = _sidecar_env(relay_settings, OUTBOX_RELAY__ENABLED="false")
    env.pop("OUTBOX_RELAY")
    entry = _the_line_of_a_failed_start(env, "run")
    assert entry["message"] == "nothing to run: the relay and the checker are both disabled"
    entry = _the_line_of_a_failed_start(env, "relay")  # it said "both" of the relay alone too
    assert entry["message"] == "nothing to run: the relay is disabled (relay.enabled = false)"


def test_settings_a_sidecar_cannot_read_are_said_in_json(
    relay_settings: Callable[..., SidecarSettings],
) -> None:
    env = _sidecar_env(relay_settings, OUTBOX_RELAY__SHARDS="many")
    env.pop("OUTBOX_RELAY")
    entry = _the_line_of_a_failed_start(env, "relay")
    assert entry["level"] == "CRITICAL"
    assert "relay.shards" in entry["message"]
