"""The reconciliation's JDBC reads give up on a database that sends nothing for
--jdbc-read-timeout (the driver's socketTimeout), with the real driver in Spark: a database gone
silent held a ledger read for ever, the job alive and reporting nothing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

from scripts import services as local_services
from spark.config import ReconcileSettings
from tests.fixtures.pg_failover import PgPair

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Answers after 2 s: longer than the 1 s timeout.
SLOW = "(SELECT 1 AS answered FROM pg_sleep(2)) AS slow"
# Answers after 8 s, inside the 10 s timeout of the test that cuts the node off under it:
# long enough for the cut, however slowly it is made (its firewall rules wait for a lock a
# cluster's proxy takes too; 2 s ran out once), and only the cut makes the read time out.
SILENCED = "(SELECT 1 AS answered FROM pg_sleep(8)) AS silenced"


def _jdbc(dsn: str, timeout_s: float) -> tuple[str, dict[str, str]]:
    return ReconcileSettings(
        dsn=dsn,
        bootstrap_servers="unused:9092",
        topics=("unused",),
        checkpoint="unused",
        jdbc_read_timeout=timedelta(seconds=timeout_s),
    ).jdbc()


def test_a_read_that_receives_nothing_for_the_timeout_fails_unless_the_url_says_otherwise(
    spark: SparkSession, pg_dsn: str
) -> None:
    """What the setting costs, said in the README: a statement that answers nothing for that
    long is cut too. A socketTimeout in --jdbc-url wins over it."""
    url, props = _jdbc(pg_dsn, 1)
    with pytest.raises(Exception, match="Read timed out"):  # 1 s without a byte of the answer
        spark.read.jdbc(url, SLOW, properties=props).collect()
    (row,) = spark.read.jdbc(f"{url}?socketTimeout=0", SLOW, properties=props).collect()
    assert row["answered"] == 1


def test_a_read_from_a_database_gone_silent_is_given_up(
    spark: SparkSession, pg_pair: PgPair, can_partition: None
) -> None:
    """The node drops off the network while the read waits for its answer: no reset comes, and
    without the timeout the read waited for ever (the driver sets no keepalives)."""
    url, props = _jdbc(pg_pair.primary.dsn, 10)
    frame = spark.read.jdbc(url, SILENCED, properties=props)  # its schema is read here, at once
    failure: list[BaseException] = []

    def read() -> None:
        try:
            frame.collect()
        except Exception as exc:
            failure.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    # running: not the schema's query (WHERE 1=0), whose backend may still be listed, idle
    while not pg_pair.primary.query(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
        "AND query LIKE '%pg_sleep(8)%' AND query NOT LIKE '%1=0%' AND pid <> pg_backend_pid()"
    ):
        assert time.monotonic() < deadline, "the read never reached the server"
        time.sleep(0.05)
    silenced = time.monotonic()
    assert local_services.partition(pg_pair.primary.port)  # healed by the fixture
    reader.join(timeout=45)
    assert not reader.is_alive(), "the read still waits on a database that answers nothing"
    (error,) = failure
    assert "Read timed out" in str(error)
    assert time.monotonic() - silenced < 30  # the 10 s timeout, and Spark's failing the job
