"""Kafka secrets for real: the sidecar logs in to the broker's SASL PLAIN listeners (in clear
and over TLS) with a password from its secrets directory (where the chart mounts a Secret); a
wrong password, or a certificate it does not trust, is said."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.config import SidecarSettings
from tests.fixtures.http import free_port, get
from tests.fixtures.kafka import SaslListener, consume_all
from tests.integration.test_relay_crashes import FAST, publish, undelivered, wait_for

pytestmark = pytest.mark.integration


def sidecar(
    settings: SidecarSettings,
    sasl: SaslListener,
    password: str,
    tmp_path: Path,
    port: int,
    *,
    trust: bool = True,
) -> tuple[dict[str, str], Path]:
    """`outboxctl relay`'s environment: the login in settings, its password in a file only;
    over TLS, the broker's certificate trusted unless `trust` is false (the system's CAs)."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "outbox_kafka__sasl_password").write_text(password)
    env = {
        **os.environ,
        "OUTBOX_DATABASE__DSN": settings.database.dsn.get_secret_value(),
        "OUTBOX_RELAY": settings.relay.model_dump_json(),
        "OUTBOX_KAFKA__BOOTSTRAP_SERVERS": sasl.bootstrap,
        "OUTBOX_KAFKA__SECURITY_PROTOCOL": sasl.librdkafka()["security.protocol"],
        "OUTBOX_KAFKA__SASL_MECHANISM": "PLAIN",
        "OUTBOX_KAFKA__SASL_USERNAME": sasl.username,
        "OUTBOX_SECRETS_DIR": str(secrets),
        "OUTBOX_CHECKER__ENABLED": "false",
        "OUTBOX_HTTP__HOST": "127.0.0.1",
        "OUTBOX_HTTP__PORT": str(port),
        "OUTBOX_LOG_FORMAT": "text",
    }
    if sasl.ca_location and trust:  # beside the password, as the chart's Secret holds it
        shutil.copy(sasl.ca_location, secrets / "ca.pem")
        env["OUTBOX_KAFKA__SSL_CA_LOCATION"] = str(secrets / "ca.pem")
    return env, tmp_path / "sidecar.log"


def run(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "relay"], env=env, stdout=out, stderr=out
        )


def test_the_sidecar_delivers_through_a_sasl_login_with_its_password_in_a_file(
    pg_dsn: str,
    kafka_bootstrap: str,
    sasl_listener: SaslListener,
    relay_settings: Callable[..., SidecarSettings],
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic, port = topic_factory(), free_port()
    sent = publish(pg_dsn, topic, transactions=2, per_tx=3)
    login = sasl_listener
    env, log = sidecar(relay_settings(**FAST), login, login.password, tmp_path, port)
    shown = subprocess.run(
        [sys.executable, "-m", "relay.cli", "config"], env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert login.username in shown.stdout
    assert login.password not in shown.stdout
    proc = run(env, log)
    try:
        wait_for(lambda: undelivered(pg_dsn) == 0, 60, "delivery")
        wait_for(lambda: get(port, "/readyz")[0] == 200, 30, "the relay to be ready")
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    got = consume_all(kafka_bootstrap, topic, "read_committed")
    assert sorted(m.value() for m in got) == sorted(sent)
    assert all(dict(m.headers() or [])["outbox-tx-id"] for m in got)
    assert login.password not in log.read_text()


@pytest.mark.parametrize(
    ("listener", "wrong_password", "trust", "said"),
    [
        ("kafka_sasl", True, True, "Authentication failed"),
        # without ssl.ca_location the system's CAs are asked: none signed the test broker's
        ("kafka_sasl_ssl", False, False, "certificate verify failed"),
    ],
)
def test_a_login_or_certificate_refused_is_said_and_nothing_is_delivered(
    pg_dsn: str,
    relay_settings: Callable[..., SidecarSettings],
    topic_factory: Callable[..., str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    listener: str,
    wrong_password: bool,
    trust: bool,
    said: str,
) -> None:
    login: SaslListener = request.getfixturevalue(listener)
    password = "not-the-password" if wrong_password else login.password
    topic, port = topic_factory(), free_port()
    publish(pg_dsn, topic, transactions=1, per_tx=2)
    # Its broker look-ups block 10 s each while refused: the stop waits for none of that (cut
    # at the grace, so the log checked below holds the refusal, not a clean stop's lines)
    settings = relay_settings(**FAST, shutdown_grace="PT1S")
    env, log = sidecar(settings, login, password, tmp_path, port, trust=trust)
    proc = run(env, log)
    try:
        wait_for(lambda: said in log.read_text(), 60, said)
        status, body = get(port, "/readyz")
        assert status == 503, body
        assert undelivered(pg_dsn) == 2
    finally:
        proc.terminate()
        proc.wait(30)
    assert password not in log.read_text()
