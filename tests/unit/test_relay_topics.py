"""Which metadata errors mean "no such topic" (records parked) and which pass (retried)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.kafka import Topics


class _Admin:
    def __init__(self, topic: Any) -> None:
        self.topic = topic

    def list_topics(self, name: str, timeout: float) -> Any:
        return SimpleNamespace(topics={} if self.topic is None else {name: self.topic})

    def poll(self, timeout: float) -> int:  # serves the client's log lines: none here
        return 0


def topics_seeing(topic: Any) -> Topics:
    topics = Topics({"bootstrap.servers": "127.0.0.1:1"})
    topics._admin = _Admin(topic)  # type: ignore[assignment]
    return topics


def test_a_topic_without_errors_has_its_partitions() -> None:
    assert topics_seeing(SimpleNamespace(error=None, partitions={0: 0, 1: 1})).partitions("t") == 2


@pytest.mark.parametrize(
    "missing",
    [
        None,
        KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART),
        KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED),
    ],
)
def test_an_unknown_or_forbidden_topic_has_none(missing: Any) -> None:
    topic = None if missing is None else SimpleNamespace(error=missing, partitions={})
    assert topics_seeing(topic).partitions("t") == 0


def test_a_topic_without_a_leader_for_now_is_an_error_that_passes_not_a_missing_topic() -> None:
    leaderless = SimpleNamespace(error=KafkaError(KafkaError.LEADER_NOT_AVAILABLE), partitions={})
    topics = topics_seeing(leaderless)
    with pytest.raises(KafkaException):
        topics.partitions("t")
    topics._admin = _Admin(SimpleNamespace(error=None, partitions={0: 0}))  # type: ignore[assignment]
    assert topics.partitions("t") == 1  # not cached as missing
