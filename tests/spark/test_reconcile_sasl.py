"""The reconciliation reads Kafka through a SASL login given in a properties file
(`--kafka-config`): the secret never on its command line, and a wrong one said."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import outbox
from relay.config import SidecarSettings
from spark import ReconcileQueryError
from tests.fixtures.kafka import SaslListener
from tests.spark.test_reconcile_integration import publish, reconcile

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def properties(tmp_path: Path, sasl: SaslListener, password: str | None = None) -> str:
    path = tmp_path / f"consumer-{password or 'right'}.properties"
    path.write_text(sasl.java_properties(password), encoding="iso-8859-1")
    return str(path)


def test_the_job_reads_through_a_sasl_login_from_its_properties_file(
    spark: SparkSession,
    pg_dsn: str,
    sasl_listener: SaslListener,
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Callable[..., Any],
    topic_factory: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    orders, markers = topic_factory(), topic_factory()
    publish(pg_dsn, [outbox.Record(orders, {"i": i}, key=f"k{i}") for i in range(4)])
    # a relay logged in the same way delivers them, keeping the ledger rows
    settings = relay_settings(op_marker_topic=markers, delivered_retention="PT1H")
    sasl = {k.replace(".", "_"): v for k, v in sasl_listener.librdkafka().items()}
    relay = relay_factory(settings.model_copy(update={"kafka": type(settings.kafka)(**sasl)}))
    delivered, until = 0, time.monotonic() + 60
    while delivered < 4:
        assert time.monotonic() < until, f"the relay delivered {delivered} of 4"
        delivered += relay.run_once().delivered
    time.sleep(2.5)  # past the deadline: judged now
    argv = [
        "--dsn", pg_dsn, "--topics", orders, "--marker-topic", markers, "--deadline", "2s",
        "--checkpoint", str(tmp_path / "checkpoint"), "--once",
    ]  # fmt: skip
    report = reconcile(capsys, [*argv, "--kafka-config", properties(tmp_path, sasl_listener)])
    assert (report["copies"], report["markers"]) == (4, 4)
    assert report["found"] == dict.fromkeys(report["found"], 0)

    from spark.job import main

    wrong = properties(tmp_path, sasl_listener, password="not-the-password")
    with pytest.raises(ReconcileQueryError) as failed:
        main([*argv, "--checkpoint", str(tmp_path / "other"), "--kafka-config", wrong])
    said = f"{failed.value} {failed.value.__cause__}"
    assert "Authentication failed" in said, said
    assert "not-the-password" not in said


def test_secret_options_stay_out_of_sparks_plans(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """Spark's own redaction hid a value that looks like a password; an inline PEM private
    key (ssl.keystore.key) showed in clear in a source's option list."""
    from spark.config import ReconcileSettings
    from spark.job import ReconcileJob

    settings = ReconcileSettings(
        dsn="postgresql://reconciler@db/app", bootstrap_servers="127.0.0.1:1", topics=("t",),
        checkpoint="cp", kafka_options={
            "ssl.keystore.type": "PEM",
            "ssl.keystore.key": "-----BEGIN PRIVATE KEY-----keymaterial",
            "sasl.jaas.config": 'x required username="u" password="pw";',
        },
    )  # fmt: skip
    job = ReconcileJob(settings, spark)
    stream = spark.readStream.format("kafka").options(**job._source_options()).load()
    stream.explain(extended=True)
    # the source's option list (Spark's V1 fallback, printed beside it here, is not redacted
    # by any setting; the job never prints a plan)
    marker = "StreamingRelationV2"
    lines = capsys.readouterr().out.splitlines()
    (options,) = {line.split(marker, 1)[1] for line in lines if marker in line}
    options = options.split("~StreamingRelation DataSource", 1)[0]
    assert "kafka.ssl.keystore.key=*********(redacted)" in options
    assert "keymaterial" not in options
    assert "kafka.ssl.keystore.type=PEM" in options  # the rest still shown
