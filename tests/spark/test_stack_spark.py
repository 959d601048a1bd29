"""PySpark's real Kafka source reads only committed transactions with read_committed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from confluent_kafka import Producer

from tests.fixtures.kafka import TIMEOUT_S
from tests.fixtures.services import Services, _script

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_structured_streaming_reads_committed_records(
    spark: SparkSession,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    transactional_producer: Producer,
    tmp_path,
) -> None:
    topic = topic_factory(partitions=2)
    for values, commit in ((["c1", "c2"], True), (["aborted"], False), (["c3"], True)):
        transactional_producer.begin_transaction()
        for v in values:
            transactional_producer.produce(topic, key=v.encode(), value=v.encode())
        if commit:
            transactional_producer.commit_transaction(TIMEOUT_S)
        else:
            transactional_producer.flush(TIMEOUT_S)
            transactional_producer.abort_transaction(TIMEOUT_S)

    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    query = (
        stream.selectExpr("CAST(value AS STRING) AS value")
        .writeStream.format("memory")
        .queryName("smoke_" + topic.replace(".", "_").replace("-", "_"))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120), "the availableNow query did not finish"
    assert query.exception() is None
    rows = spark.sql(f"SELECT value FROM {query.name}").collect()
    assert sorted(r.value for r in rows) == ["c1", "c2", "c3"]


def test_the_services_script_gives_the_connector_jars(services: Services) -> None:
    """What the spark_jars fixture reads when OUTBOX_SPARK_JARS is unset (CI): the script's
    `spark-jars` printed the last of its lines, which became PgBouncer's address once a
    PgBouncer ran, and every Spark test failed to set up."""
    printed = _script("spark-jars")
    assert list(printed) == ["OUTBOX_SPARK_JARS"]
    jars = printed["OUTBOX_SPARK_JARS"].split(",")
    assert any("spark-sql-kafka" in jar for jar in jars)
    assert all(Path(jar).exists() for jar in jars)
