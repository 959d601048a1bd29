"""Sidecar settings: environment, mounted secrets, TOML file, librdkafka rendering, masking."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from relay.config import (
    KafkaSettings,
    RelaySettings,
    SettingsUnreadable,
    SidecarSettings,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_environment_with_nested_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://app@db/app")
    monkeypatch.setenv("OUTBOX_RELAY__SHARDS", "8")
    monkeypatch.setenv("OUTBOX_RELAY__LINGER", "PT0.005S")
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", '{"compression.type": "zstd"}')
    settings = load_settings()
    assert settings.relay.shards == 8
    assert settings.relay.linger.total_seconds() == 0.005
    assert settings.kafka.to_librdkafka()["compression.type"] == "zstd"


def test_secrets_mounted_as_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "outbox_database__dsn").write_text("postgresql://secret@db/app")
    (tmp_path / "outbox_kafka__sasl_password").write_text("hunter2")
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv("OUTBOX_KAFKA__SECURITY_PROTOCOL", "sasl_ssl")
    settings = load_settings()
    assert settings.database.dsn.get_secret_value() == "postgresql://secret@db/app"
    assert settings.kafka.to_librdkafka()["sasl.password"] == "hunter2"


def test_files_of_a_tls_setup_beside_the_secrets_are_not_read_as_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The chart's Secret may hold a keystore too (values.yaml says so): read as UTF-8 text,
    a binary one failed every command's start."""
    # as a Secret's volume lays its keys out: each a link to ..data/<key>, ..data a link to
    # the current version's directory
    version = tmp_path / "..2026_11_30_18_00_00.123"
    version.mkdir()
    (version / "outbox_database__dsn").write_text("postgresql://secret@db/app")
    (version / "keystore.p12").write_bytes(bytes(range(256)) * 4)  # not UTF-8
    (version / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "..data").symlink_to(version.name)
    for key in ("outbox_database__dsn", "keystore.p12", "ca.pem"):
        (tmp_path / key).symlink_to(f"..data/{key}")
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    assert load_settings().database.dsn.get_secret_value() == "postgresql://secret@db/app"


def test_a_secret_file_or_config_file_not_utf8_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "outbox_database__dsn").write_text("postgresql://secret@db/app")
    (secrets / "outbox_kafka__sasl_password").write_bytes(b"hunter\xff")
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(secrets))
    with pytest.raises(SettingsUnreadable, match=r"secret file .*outbox_kafka__sasl_password is"):
        load_settings()
    (secrets / "outbox_kafka__sasl_password").unlink()
    config = tmp_path / "sidecar.toml"
    config.write_bytes(b"[relay]\nrelay_id = '\xe9'\n")  # Latin-1
    with pytest.raises(SettingsUnreadable, match=r"sidecar\.toml is not UTF-8 text"):
        load_settings(config)


def test_toml_file_and_env_overrides_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "sidecar.toml"
    config.write_text(
        '[database]\ndsn = "postgresql://file@db/app"\n[relay]\nbatch_size = 50\nshards = 2\n'
    )
    monkeypatch.setenv("OUTBOX_RELAY__SHARDS", "3")
    settings = load_settings(config)
    assert (settings.relay.batch_size, settings.relay.shards) == (50, 3)


def test_a_missing_config_file_is_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.toml"):
        load_settings("nope.toml")


def test_unknown_settings_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://x")
    monkeypatch.setenv("OUTBOX_RELAY__BATCHSIZE", "10")  # a typo must not pass silently
    with pytest.raises(ValidationError, match="batchsize"):
        load_settings()


def test_secrets_are_masked_but_rendered_for_librdkafka() -> None:
    kafka = KafkaSettings(
        bootstrap_servers="b:9093",
        security_protocol="sasl_ssl",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="relay",
        sasl_password="hunter2",  # type: ignore[arg-type]
    )
    assert "hunter2" not in repr(kafka)
    assert "hunter2" not in kafka.model_dump_json()
    conf = kafka.to_librdkafka()
    assert conf["sasl.password"] == "hunter2"
    assert conf["security.protocol"] == "sasl_ssl"
    assert "ssl.ca.location" not in conf


@pytest.mark.parametrize("setting", ["off", None])
def test_the_relay_refuses_postgres_without_commit_timestamps(setting: str | None) -> None:
    from relay.service import RelayConfigError, require_commit_timestamps

    with pytest.raises(RelayConfigError, match=r"track_commit_timestamp = on in postgresql\.conf"):
        require_commit_timestamps(setting)
    require_commit_timestamps("on")


def test_secrets_in_passed_through_properties_are_masked_when_shown() -> None:
    kafka = KafkaSettings(
        extra={
            "sasl.oauthbearer.client.secret": "topsecret",
            "ssl.key.pem": "-----BEGIN",
            "sasl.oauthbearer.assertion.private.key.passphrase": "keypass",
            "acks": "all",
        }
    )
    shown = kafka.model_dump_json()
    assert "topsecret" not in shown
    assert "BEGIN" not in shown
    assert "keypass" not in shown  # "passphrase" was not a word the mask knew
    assert "topsecret" not in repr(kafka)
    assert '"acks":"all"' in shown
    assert kafka.to_librdkafka()["sasl.oauthbearer.client.secret"] == "topsecret"  # still used


def test_a_setting_refused_does_not_print_its_value(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://db/app")
    (tmp_path / "outbox_kafka__sasl_pasword").write_text("filesecret")  # a mistyped name
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    with pytest.raises(ValidationError) as caught:
        load_settings()
    assert "sasl_pasword" in str(caught.value)  # what is wrong...
    assert "filesecret" not in str(caught.value)  # ...without the value


@pytest.mark.parametrize(
    ("relay", "said"),
    [
        # in ISO 8601, as they are given (not Python's 0:00:05)
        (
            {"lease_duration": "PT10S", "heartbeat_interval": "PT5S"},
            r"heartbeat_interval \(PT5S\) must be under half of lease_duration \(PT10S\)",
        ),
        ({"poll_interval": "PT0S"}, "poll_interval"),  # rounds back to back, for nothing
        ({"shutdown_grace": "-PT5S"}, "shutdown_grace"),  # a SIGTERM skipped the graceful stop
        ({"shutdown_grace": "PT0S"}, "shutdown_grace"),  # no stop ends within none: exit 1
        ({"delivered_retention": "-PT1S"}, "delivered_retention"),
        ({"lease_duration": "PT0S"}, "lease_duration"),
        # the broker refused to make these, and the relay retried that for ever
        ({"op_marker_retention": "-P1D"}, "op_marker_retention"),
        ({"op_marker_retention": "PT30M"}, r"op_marker_retention\n.*1 day"),  # recovery reads them
        ({"op_marker_topic": "bad topic name"}, r"op_marker_topic\n.*is invalid"),
        ({"dead_letter_topic": ".."}, r"dead_letter_topic\n.*not allowed"),
        # recovery reads the marker topic's every message as markers: a copy ended rows unsent
        ({"dead_letter_topic": "outbox.op-markers"}, "both 'outbox.op-markers'"),
        ({"kafka_transaction_timeout": "PT0.5S"}, "kafka_transaction_timeout"),  # librdkafka: 1 s
    ],
)
def test_relay_durations_that_cannot_work_are_refused_by_name(
    relay: dict[str, str], said: str
) -> None:
    with pytest.raises(ValidationError, match=said):
        RelaySettings.model_validate(relay)


def test_names_are_taken_in_any_case_as_kafkas_docs_and_habits_write_them() -> None:
    kafka = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="scram-sha-512")  # type: ignore[arg-type]
    assert kafka.to_librdkafka()["security.protocol"] == "sasl_ssl"
    assert kafka.to_librdkafka()["sasl.mechanism"] == "SCRAM-SHA-512"
    settings = SidecarSettings(database={"dsn": "dbname=x"}, log_level="info", log_format="TEXT")  # type: ignore[arg-type]
    assert (settings.log_level, settings.log_format) == ("INFO", "text")


def test_names_of_no_setting_are_said_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pydantic-settings skips them: a misspelt section kept its default, unsaid."""
    import relay.config

    monkeypatch.setattr(relay.config, "_warned_unknown", set())
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://db/app")
    monkeypatch.setenv("OUTBOX_LOG_LEVL", "DEBUG")
    monkeypatch.setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "broker:9092")  # one underscore
    monkeypatch.setenv("OUTBOX_TEST_PG_DSN", "postgresql://db/test")  # the tests' own
    for link in ("SERVICE_HOST", "SERVICE_PORT", "SERVICE_PORT_HTTP", "PORT", "PORT_8080_TCP",
                 "PORT_8080_TCP_ADDR"):  # fmt: skip
        monkeypatch.setenv(f"OUTBOX_OUTBOX_SIDECAR_{link}", "10.0.0.1")  # Kubernetes' own
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    (tmp_path / "outbox_kafka_sasl_password").write_text("s3cret")
    (tmp_path / "outbox_kafka__sasl_password").write_text("s3cret")
    monkeypatch.setenv("OUTBOX_KAFKA__SECURITY_PROTOCOL", "sasl_ssl")
    (tmp_path / "other_app_key").write_text("x")
    caplog.set_level("WARNING", logger="relay.config")
    settings = load_settings()
    load_settings()
    assert settings.kafka.sasl_password is not None  # the well-named file is read
    warned = sorted(r.getMessage().split(" is not a setting")[0] for r in caplog.records)
    assert warned == [
        "environment variable OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        "environment variable OUTBOX_LOG_LEVL",
        f"secret file in {tmp_path} outbox_kafka_sasl_password",
    ]
    assert "s3cret" not in caplog.text


def test_the_project_scripts_variables_are_not_said_to_be_no_setting() -> None:
    """The local stack's variables (README, "The local services"), exported in a shell that then
    ran the sidecar, were each logged as "not a setting and is ignored"."""
    import relay.config

    read = re.compile(r"environ(?:\.get\(|\[)\"(OUTBOX_[A-Z0-9_]+)\"")
    scripts = Path(__file__).parents[2] / "scripts"
    names = {n for f in scripts.glob("*.py") for n in read.findall(f.read_text())}
    assert {"OUTBOX_LOCAL_DIR", "OUTBOX_KAFKA_SSL_PORT"} <= names  # the pattern finds them
    settings = {n for n in names if "__" in n}  # OUTBOX_DATABASE__DSN and the like
    prefixed = {n for n in names if n.startswith(relay.config._NOT_SETTINGS_PREFIXES)}
    assert names - settings - prefixed - relay.config._NOT_SETTINGS == set()


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("OUTBOX_RELAY__AUDIT_RETENTION", "P1M", "months and years have no fixed length"),
        ("OUTBOX_RELAY__DELIVERED_RETENTION", "P1Y", "months and years have no fixed length"),
        ("OUTBOX_RELAY__AUDIT_RETENTION", "P10000Y", "months and years have no fixed length"),
        ("OUTBOX_RELAY__DELIVERED_RETENTION", "P3650000D", "at most 36500 days"),
        ("OUTBOX_CHECKER__MAX_PREPARED_AGE", "P3650000D", "at most 36500 days"),
        ("OUTBOX_CHECKER__MAX_BACKOFF", "P36501D", "at most 36500 days"),
    ],
)
def test_durations_of_no_fixed_length_or_past_postgres_range_are_refused_by_name(
    setting: str, value: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1M was taken as 30 days; P10000Y passed `outboxctl config`, then every relay or
    checker round failed with 'timestamp out of range'."""
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://db/app")
    monkeypatch.setenv(setting, value)
    with pytest.raises(ValidationError) as caught:
        load_settings()
    name = setting.removeprefix("OUTBOX_").lower().replace("__", ".")
    assert name in str(caught.value)
    assert said in str(caught.value)


def test_durations_of_days_weeks_and_fractions_pass() -> None:
    relay = RelaySettings(audit_retention="P2W", delivered_retention="P1DT12H", linger="PT0.005S")  # type: ignore[arg-type]
    assert relay.audit_retention.days == 14
    assert relay.delivered_retention.total_seconds() == 36 * 3600


def test_a_number_of_seconds_is_a_duration_in_the_environment_as_in_the_toml_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart reads `env`'s grace as TOML does (a number: seconds) and passed "20" on; the
    sidecar refused it ("day" identifier) and never started."""
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://db/app")
    monkeypatch.setenv("OUTBOX_RELAY__SHUTDOWN_GRACE", "20")
    monkeypatch.setenv("OUTBOX_RELAY__LINGER", " 0.005 ")
    settings = load_settings()
    assert settings.relay.shutdown_grace == timedelta(seconds=20)
    assert settings.relay.linger == timedelta(milliseconds=5)


def test_printed_durations_are_read_back_as_they_were() -> None:
    """A retention of a year or more was printed with years (`P1Y35D`), which the settings
    refuse: `outboxctl config`'s output given back as settings stopped the sidecar."""
    relay = RelaySettings(
        delivered_retention="P400D",  # type: ignore[arg-type]
        audit_retention="P36500D",  # type: ignore[arg-type]
        lease_duration="PT1H2M3.25S",  # type: ignore[arg-type]
    )
    printed = relay.model_dump(mode="json")
    assert printed["delivered_retention"] == "P400D"
    assert printed["audit_retention"] == "P36500D"
    assert printed["lease_duration"] == "PT1H2M3.25S"
    assert printed["linger"] == "PT0S"
    again = RelaySettings(**printed)
    assert (again.delivered_retention, again.audit_retention) == (
        relay.delivered_retention,
        relay.audit_retention,
    )


def test_a_relay_id_longer_than_its_wake_ups_may_carry_is_refused_by_name() -> None:
    """It is the payload of its NOTIFY (relay_wake_relays), which Postgres limits: too long, it
    failed every batch's end."""
    assert RelaySettings(relay_id="r" * 200).relay_id == "r" * 200
    with pytest.raises(ValidationError, match=r"relay_id\n.*at most 200 characters"):
        RelaySettings(relay_id="r" * 201)


def test_transaction_pooling_turns_listen_off_and_prepared_statements_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://app@pgbouncer:6432/app")
    plain = load_settings()
    assert plain.relay.listen_notify is True
    assert plain.database.connect_options() == {}
    monkeypatch.setenv("OUTBOX_DATABASE__TRANSACTION_POOLING", "true")
    pooled = load_settings()
    assert pooled.relay.listen_notify is False  # a LISTEN through the pooler hears nothing
    assert pooled.database.connect_options() == {"prepare_threshold": None}
    assert '"listen_notify":false' in pooled.model_dump_json()  # as `outboxctl config` shows


@pytest.mark.parametrize("where", ["environment", "file"])
def test_listen_asked_for_through_a_transaction_pooler_is_refused_by_name(
    where: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://app@pgbouncer:6432/app")
    monkeypatch.setenv("OUTBOX_DATABASE__TRANSACTION_POOLING", "true")
    config = None
    if where == "environment":
        monkeypatch.setenv("OUTBOX_RELAY__LISTEN_NOTIFY", "true")
    else:
        config = tmp_path / "sidecar.toml"
        config.write_text("[relay]\nlisten_notify = true\n")
    with pytest.raises(ValidationError, match="listen_notify = true cannot work with database"):
        load_settings(config)
    monkeypatch.setenv("OUTBOX_RELAY__LISTEN_NOTIFY", "false")  # said off: taken
    assert load_settings(config).relay.listen_notify is False


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (
            {"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"},
            "kafka.sasl_mechanism, kafka.sasl_username, kafka.sasl_password: not used with "
            "security_protocol plaintext; set security_protocol to sasl_ssl or sasl_plaintext",
        ),
        (
            {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
             "ssl_ca_location": "/ca.pem"},
            "kafka.ssl_ca_location: not used with security_protocol sasl_plaintext; set "
            "security_protocol to sasl_ssl",
        ),
        (
            {"ssl_ca_location": "/ca.pem"},
            "not used with security_protocol plaintext; set security_protocol to ssl",
        ),
    ],
)  # fmt: skip
def test_a_login_or_tls_files_the_protocol_would_not_use_are_refused(
    given: dict[str, str], said: str
) -> None:
    """They were dropped, unsaid: the client connected without them (librdkafka's warning went
    to a log nobody reads at `outboxctl config`)."""
    with pytest.raises(ValidationError, match=re.escape(said)):
        KafkaSettings.model_validate(given)
    # the protocol given through extra, as Kafka's own properties name it, counts
    protocol = {"extra": {"security.protocol": "SASL_SSL"}}
    assert KafkaSettings.model_validate({**given, **protocol}).to_librdkafka()


@pytest.mark.parametrize("timeout", ["inf", "nan", "86400"])
def test_a_connect_timeout_past_an_hour_or_not_finite_is_refused(timeout: str) -> None:
    """inf passed `outboxctl config`, then every connection failed (OverflowError)."""
    with pytest.raises(ValidationError, match="connect_timeout_s"):
        SidecarSettings.model_validate(
            {"database": {"dsn": "postgresql://db/app", "connect_timeout_s": timeout}}
        )


def test_marker_messages_larger_than_the_producer_sends_are_refused_before_any_broker() -> None:
    """The producer's limit needs no broker: `outboxctl config` passed it, and the relay
    stopped at its start."""
    base = {"database": {"dsn": "postgresql://db/app"}}
    too_large = {**base, "relay": {"op_marker_message_bytes": 2_000_000}}
    with pytest.raises(ValidationError, match="set it to at most 967232"):
        SidecarSettings.model_validate(too_large)
    raised = {**too_large, "kafka": {"extra": {"message.max.bytes": 4_000_000}}}
    assert SidecarSettings.model_validate(raised).relay.op_marker_message_bytes == 2_000_000
    checker_only = {**too_large, "relay": {**too_large["relay"], "enabled": False}}
    assert SidecarSettings.model_validate(checker_only)


def test_a_value_every_member_of_a_union_refuses_is_one_error_not_four(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kafka.extra value none of str, int, float and bool takes was four errors, which used
    up those reported and hid the next setting's ('and 1 more')."""
    from relay.cli import main

    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://db/app")
    monkeypatch.setenv("OUTBOX_KAFKA__EXTRA", '{"linger.ms": [5]}')
    monkeypatch.setenv("OUTBOX_RELAY__SHARD", "2")  # a typo of shards
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert (
        "kafka.extra.linger.ms: Input should be a string or an integer or a number or a boolean; "
        "relay.shard: Extra inputs are not permitted"
    ) in err
    assert "more" not in err
