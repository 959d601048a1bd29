"""Partitions that left the reconciliation's Kafka source, told from its progress reports."""

from __future__ import annotations

import logging

import pytest

from spark.vanished import VanishedPartitions

BOTH = '{"orders":{"0":5,"1":7},"markers":{"0":3}}'
WITHOUT_ORDERS_1 = '{"orders":{"0":6},"markers":{"0":4}}'


def test_a_partition_gone_from_the_end_offsets_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = VanishedPartitions()
    assert seen.see(None, BOTH) == []  # the first batch: no start offsets
    assert seen.see(BOTH, BOTH) == []
    with caplog.at_level(logging.WARNING):
        assert seen.see(BOTH, WITHOUT_ORDERS_1) == [("orders", 1)]
    assert "orders[1] left the Kafka source" in caplog.text
    assert seen.see(BOTH, WITHOUT_ORDERS_1) == []  # the same report, read again
    assert seen.see(WITHOUT_ORDERS_1, WITHOUT_ORDERS_1) == []


def test_a_report_missed_between_reads_still_tells_the_partition_gone() -> None:
    """Only the last report is read between judgements: the one that lost the partition
    may have passed unseen, and the next one names it in neither offset."""
    seen = VanishedPartitions()
    seen.see(BOTH, BOTH)
    assert seen.see(WITHOUT_ORDERS_1, WITHOUT_ORDERS_1) == [("orders", 1)]


def test_a_restart_tells_the_partitions_its_checkpoint_named() -> None:
    seen = VanishedPartitions()
    assert seen.see(BOTH, WITHOUT_ORDERS_1) == [("orders", 1)]


def test_a_partition_that_comes_back_is_watched_again() -> None:
    seen = VanishedPartitions()
    seen.see(BOTH, WITHOUT_ORDERS_1)
    assert seen.see(WITHOUT_ORDERS_1, BOTH) == []  # made again
    assert seen.see(BOTH, WITHOUT_ORDERS_1) == [("orders", 1)]


@pytest.mark.parametrize("offsets", [None, "", "null", "not json", "[1]", '{"t": 3}'])
def test_offsets_that_are_not_a_kafka_sources_are_not_partitions(offsets: str | None) -> None:
    seen = VanishedPartitions()
    seen.see(BOTH, BOTH)
    assert seen.see(BOTH, offsets) == []  # nothing to compare with: nothing said gone
