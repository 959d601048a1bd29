"""The job's Kafka consumer properties: a properties file (`--kafka-config`), `--kafka-option`,
and what Spark's Kafka source would refuse only when the query starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from spark import ReconcileConfigError
from spark.config import ReconcileSettings
from spark.job import build_parser, settings_from_args

JAAS = (
    "org.apache.kafka.common.security.plain.PlainLoginModule required "
    'username="reconciler" password="s3cr3t-Pa55";'
)
REQUIRED = ["--dsn", "postgresql://u@db/app", "--topics", "orders", "--once", "--checkpoint", "cp"]


def settings(*args: str) -> ReconcileSettings:
    return settings_from_args(build_parser().parse_args([*REQUIRED, *args]))


def write(tmp_path: Path, text: str, encoding: str = "iso-8859-1") -> str:
    path = tmp_path / "consumer.properties"
    path.write_text(text, encoding=encoding)
    return str(path)


def test_a_properties_file_in_java_format(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# as kafka-console-consumer --consumer.config takes it\n"
        "bootstrap.servers = kafka-1:9093,\\\n    kafka-2:9093\n"
        "security.protocol: SASL_SSL\n"
        "sasl.mechanism SCRAM-SHA-512\n"
        f"sasl.jaas.config={JAAS}\n"
        "! a comment too\n"
        "client.id=r\\u00e9conciler\n"
        "isolation.level=read_committed\n",
    )
    got = settings("--kafka-config", path)
    assert got.bootstrap_servers == "kafka-1:9093,kafka-2:9093"  # from the file, continued
    assert got.kafka_options == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.jaas.config": JAAS,
        "client.id": "réconciler",
        "isolation.level": "read_committed",
    }
    source = got.kafka_source_options()
    assert source["kafka.sasl.jaas.config"] == JAAS
    assert source["kafka.bootstrap.servers"] == "kafka-1:9093,kafka-2:9093"
    assert "s3cr3t" not in repr(got)  # the settings print no secret


def test_the_command_line_goes_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "bootstrap.servers=file:9092\nsecurity.protocol=SASL_SSL\n")
    got = settings(
        "--kafka-config", path, "--bootstrap", "cli:9092", "--kafka-option",
        "security.protocol=SASL_PLAINTEXT",
    )  # fmt: skip
    assert got.bootstrap_servers == "cli:9092"
    assert got.kafka_options == {"security.protocol": "SASL_PLAINTEXT"}


def test_latin_1_as_kafkas_tools_read_it(tmp_path: Path) -> None:
    path = write(tmp_path, "bootstrap.servers=k:9092\nclient.id=caf\xe9\n", encoding="latin-1")
    assert settings("--kafka-config", path).kafka_options == {"client.id": "caf\xe9"}


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("auto.offset.reset=latest", "auto.offset.reset cannot be set"),
        ("enable.auto.commit=true", "enable.auto.commit cannot be set"),
        ("key.deserializer=x.Y", "key.deserializer cannot be set"),
        ("interceptor.classes=x.Y", "interceptor.classes cannot be set"),
        ("isolation.level=read_uncommitted", "isolation.level must be read_committed"),
        ("kafka.security.protocol=SSL", "without Spark's 'kafka.'"),
    ],
)
def test_what_spark_would_refuse_is_refused_by_name(tmp_path: Path, line: str, said: str) -> None:
    path = write(tmp_path, f"bootstrap.servers=k:9092\n{line}\n")
    with pytest.raises(ReconcileConfigError, match=said):
        settings("--kafka-config", path)
    with pytest.raises(ReconcileConfigError, match=said):  # and on the command line
        settings("--bootstrap", "k:9092", "--kafka-option", line)


def test_file_problems_name_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.properties")
    with pytest.raises(ReconcileConfigError, match=f"--kafka-config {missing}: No such file"):
        settings("--kafka-config", missing)
    with pytest.raises(ReconcileConfigError, match="is a directory"):
        settings("--kafka-config", str(tmp_path))
    bad = write(tmp_path, "bootstrap.servers=k\nsasl.jaas.config=pass\\u12zzword\n")
    with pytest.raises(ReconcileConfigError, match=r"consumer.properties: a \\u escape is") as e:
        settings("--kafka-config", bad)
    assert "12zz" not in str(e.value)  # a password's characters are not shown


def test_a_group_id_passes_as_spark_takes_it(tmp_path: Path) -> None:
    """Spark only warns about one, and a cluster's ACLs may require it."""
    path = write(tmp_path, "bootstrap.servers=k:9092\ngroup.id=reconciler\n")
    assert settings("--kafka-config", path).kafka_options == {"group.id": "reconciler"}


def test_bootstrap_servers_are_needed_from_somewhere(tmp_path: Path) -> None:
    with pytest.raises(ReconcileConfigError, match="no Kafka bootstrap servers: pass --bootstrap"):
        settings("--kafka-config", write(tmp_path, "security.protocol=SSL\n"))
    with pytest.raises(ReconcileConfigError, match="no Kafka bootstrap servers"):
        settings()
    with pytest.raises(ValidationError, match="with --bootstrap"):
        ReconcileSettings(
            dsn="postgresql://x", bootstrap_servers="k", topics=("a",), checkpoint="cp",
            kafka_options={"bootstrap.servers": "other:9092"},
        )  # fmt: skip
