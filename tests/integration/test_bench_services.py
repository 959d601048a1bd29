"""bench/_services.py against the real broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench._services import sweep_leftover_topics
from tests.fixtures.kafka import TIMEOUT_S


def test_a_benchmark_run_first_deletes_the_bench_topics_left_behind(
    kafka_admin: AdminClient, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    left = f"bench.left.{uuid.uuid4().hex[:8]}"
    kafka_admin.create_topics(
        [NewTopic(left, num_partitions=1, replication_factor=1)], operation_timeout=TIMEOUT_S
    )[left].result(timeout=TIMEOUT_S)
    other = topic_factory()  # not a benchmark's: kept

    assert sweep_leftover_topics(kafka_bootstrap) >= 1
    until = time.monotonic() + TIMEOUT_S
    while left in (topics := kafka_admin.list_topics(timeout=TIMEOUT_S).topics):
        assert time.monotonic() < until, f"{left} is still there"  # metadata may lag a moment
        time.sleep(0.1)
    assert other in topics
    assert not [n for n in topics if n.startswith("bench.")]
