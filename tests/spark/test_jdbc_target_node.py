"""The reconciliation's ledger is read over JDBC from the node its DSN asks for (jdbc_target),
checked with the real driver against a real primary and standby."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spark.config import jdbc_target
from tests.fixtures.pg_failover import PgPair

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def test_the_ledger_is_read_from_the_primary_when_the_dsn_asks_for_it(
    spark: SparkSession, pg_pair: PgPair
) -> None:
    """The standby listed first: without target_session_attrs carried over, the driver read
    the ledger there while psycopg's side of the job wrote to the primary."""
    host = "127.0.0.1"
    dsn = f"host={host},{host} port={pg_pair.standby.port},{pg_pair.primary.port} user=postgres"
    for attrs, on_standby in (("", True), (" target_session_attrs=read-write", False)):
        url, props = jdbc_target(dsn + " dbname=postgres" + attrs)
        query = "(SELECT pg_is_in_recovery() AS on_standby) AS node"
        (row,) = spark.read.jdbc(url, query, properties=props).collect()
        assert row["on_standby"] is on_standby, attrs or "no target_session_attrs"
