"""Settings only the Kafka client, the TOML reader or the probes' socket can refuse: refused at
start and by `outboxctl config`, naming what is wrong, never as an uncaught traceback."""

from __future__ import annotations

import json
import logging
import socket
from datetime import timedelta
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from relay.cli import main
from relay.http import ProbeServer, ProbeServerUnavailable
from relay.kafka import ShardProducer, check_client_settings, recovery_consumer_conf


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://relay@db/orders")


def config(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ({"sasl_password": "x"}, 'No such configuration property: "sasl_password"'),
        (
            {"message.timeout.ms": "600000"},  # above the transaction timeout (60 s)
            "`message.timeout.ms` must be set <= `transaction.timeout.ms`",
        ),
    ],
)
def test_settings_the_kafka_client_refuses_are_refused_by_config_and_at_start(
    extra: dict[str, str],
    said: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", json.dumps(extra))
    code, out, err = config(capsys)
    assert (code, out) == (1, "")
    assert "kafka: the Kafka client refuses these settings" in err
    assert said in err
    assert "Traceback" not in err
    monkeypatch.setenv("OUTBOX_LOG_FORMAT", "text")
    assert main(["run"]) == 1  # before anything starts or connects


def test_settings_only_the_recovery_consumer_refuses_are_refused_at_start_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a producer was built to check them: the relay started, and every recovery's
    consumer refused its settings, for every shard, for ever."""
    extra = {"group.protocol": "consumer", "session.timeout.ms": "10000"}
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", json.dumps(extra))
    code, _, err = config(capsys)
    assert code == 1
    assert "for the consumer that reads the op markers back in a recovery" in err
    assert "`session.timeout.ms` is not supported for `group.protocol=consumer`" in err


def test_message_sizes_raised_for_large_records_fit_the_recovery_consumer_too() -> None:
    """A common pair for large records: the recovery's consumer refused it ("receive.message.
    max.bytes must be >= fetch.max.bytes + 512"), at every recovery."""
    conf = {"message.max.bytes": "100000000", "receive.message.max.bytes": "100000000"}
    check_client_settings(conf, timedelta(seconds=60))
    consumer = recovery_consumer_conf(conf, "g")
    Consumer(consumer).close()
    assert consumer["fetch.max.bytes"] == 100_000_000
    assert consumer["receive.message.max.bytes"] == 100_000_512
    assert consumer["isolation.level"] == "read_committed"
    smaller = recovery_consumer_conf({"fetch.max.bytes": 500_000}, "g")
    assert smaller["fetch.max.bytes"] == 1_000_000  # at least message.max.bytes
    Consumer(smaller).close()


def test_settings_librdkafka_takes_pass(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", json.dumps({"compression.type": "zstd"}))
    code, out, _ = config(capsys)
    assert code == 0
    assert json.loads(out)["kafka"]["extra"] == {"compression.type": "zstd"}


def test_a_value_that_is_not_json_names_its_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", '{"compression.type": zstd}')
    code, _, err = config(capsys)
    assert code == 1
    assert "the environment variable OUTBOX_KAFKA__EXTRA (JSON expected) cannot be read" in err
    assert "line 1 column" in err
    assert "_FoldedEnv" not in err  # a class of ours, not what the operator set
    assert "Traceback" not in err


def test_a_value_not_json_among_a_sections_variables_is_the_one_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint's secrets given as the bare secret, not a JSON list: the error named only
    "OUTBOX_CHECKER (or an OUTBOX_CHECKER__...)", among a dozen variables of the section."""
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS__orders__URL", "https://orders/check")
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS__orders__SECRETS", "whsec_abc")
    monkeypatch.setenv("OUTBOX_CHECKER__MAX_CHECKS", "5")
    code, _, err = config(capsys)
    assert code == 1
    assert (
        "the environment variable OUTBOX_CHECKER__ENDPOINTS__orders__SECRETS (JSON expected) "
        "cannot be read"
    ) in err
    assert "whsec_abc" not in err


def test_a_config_file_that_is_not_toml_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "sidecar.toml"
    bad.write_text("[relay\nshards = 2\n")
    code, _, err = config(capsys, "--config", str(bad))
    assert code == 1
    assert f"config file {bad} is not TOML" in err


def test_the_checker_says_its_settings_cannot_be_read_as_the_sidecar_logs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It read them for the schema first, and said in plain text that they "cannot be read for
    the schema; pass --schema", where `run` logs a JSON line naming what is wrong."""
    bad = tmp_path / "sidecar.toml"
    bad.write_text("[relay\n")
    assert main(["checker", "--once", "--config", str(bad)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    logged = json.loads(line)
    assert logged["level"] == "CRITICAL"
    assert logged["message"].startswith(f"outboxctl checker: config file {bad} is not TOML")


def test_a_probe_port_taken_names_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ProbeServerUnavailable, match=f"http.port {port} on http.host"):
            ProbeServer("127.0.0.1", port, alive={}, ready={})


def test_a_transactional_id_given_is_said_to_be_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relay.kafka")
    ShardProducer({"transactional.id": "mine"}, "outbox-relay-0", timedelta(seconds=60))
    assert "kafka.extra transactional.id ignored" in caplog.text


def test_the_check_sends_no_oidc_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OIDC client fetches a token as soon as it is made: the settings check must not post
    the client credentials to the token endpoint (from `outboxctl config`, anywhere)."""
    with socket.socket() as token_endpoint:
        token_endpoint.bind(("127.0.0.1", 0))
        token_endpoint.listen()
        token_endpoint.settimeout(1.0)
        port = token_endpoint.getsockname()[1]
        oidc = {
            "security.protocol": "sasl_plaintext",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.oauthbearer.method": "oidc",
            "sasl.oauthbearer.client.id": "relay",
            "sasl.oauthbearer.client.secret": "s3cret",
            "sasl.oauthbearer.token.endpoint.url": f"http://127.0.0.1:{port}/token",
        }
        monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", json.dumps(oidc))
        code, _, _ = config(capsys)
        with pytest.raises(TimeoutError):
            token_endpoint.accept()  # nobody came
    assert code == 0


@pytest.mark.parametrize(
    ("grace", "connect_timeout", "warned"),
    [("PT5S", "10", True), ("PT12S", "10", False), ("PT5S", "2", False), ("PT25S", None, False)],
)
def test_a_database_wait_the_stop_cannot_outlast_is_said(
    grace: str,
    connect_timeout: str | None,
    warned: bool,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGTERM in a database outage waits up to connect_timeout_s, then ~2 s more: with a
    grace shorter than that, it exited 1 with the shards held, and nothing had said why."""
    monkeypatch.setenv("OUTBOX_RELAY__SHUTDOWN_GRACE", grace)
    if connect_timeout is not None:
        monkeypatch.setenv("OUTBOX_DATABASE__CONNECT_TIMEOUT_S", connect_timeout)
    code, out, _ = config(capsys)
    assert code == 0  # said, not refused
    assert out
    said = [r.getMessage() for r in caplog.records if "relay.shutdown_grace" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert f"database.connect_timeout_s ({connect_timeout}s)" in said[0]
        assert "lower database.connect_timeout_s or raise relay.shutdown_grace" in said[0]


@pytest.mark.parametrize(
    ("url", "warned"),
    [
        ("http://orders.shop.svc:8080/check", True),
        ("http://10.0.0.7/check", True),
        ("http://localhost:8080/check", False),
        ("http://127.0.0.2:8080/check", False),
        ("http://[::1]:8080/check", False),
        ("http://[::ffff:127.0.0.1]:8080/check", False),
        ("http://LocalHost.:8080/check", False),
        ("http://orders.localhost:8080/check", True),  # cluster DNS, not /etc/hosts
        ("https://orders.shop.svc/check", False),
    ],
)
def test_a_check_endpoint_over_plain_http_beyond_the_pod_is_said(
    url: str,
    warned: bool,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each check sends its records' keys and headers; over plain http to another host anyone
    on the path reads them, and nothing said so (the signatures only keep answers honest)."""
    endpoint = {"url": f"{url}?code=k3y", "secrets": ["whsec_" + "A" * 32]}
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS", json.dumps({"orders": endpoint}))
    code, out, _ = config(capsys)
    assert code == 0  # said, not refused
    assert out
    said = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert said[0].startswith("checker.endpoints.orders.url")
        assert "k3y" not in said[0]  # the query masked, as config shows it
