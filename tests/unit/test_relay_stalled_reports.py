"""What a shard does when its records have had no delivery report for a while."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.kafka import Sent
from relay.shard import ShardWorker


class _Topics:
    """Partition counts as the broker would say them; a name in `failing` fails its look-up."""

    def __init__(self, counts: dict[str, int], failing: set[str]) -> None:
        self.counts, self.failing, self.asked = counts, failing, []

    def known_partitions(self, name: str) -> int | None:
        return 3

    def partitions(self, name: str, *, refresh: bool = False) -> int:
        self.asked.append(name)
        if name in self.failing:
            raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE))
        return self.counts[name]


def _worker(topics: _Topics) -> Any:
    return SimpleNamespace(topics=topics, settings=SimpleNamespace(dead_letter_topic="dlt"))


def _waiting(*topics: str) -> list[Sent]:
    return [Sent(topic=t) for t in topics]


def test_a_topic_gone_is_found_past_one_whose_look_up_fails() -> None:
    """The look-ups stopped at the first that failed: a deleted topic sorted after a topic
    without a leader was never looked at, and the shard waited out the transaction again."""
    topics = _Topics({"b.gone": 0}, failing={"a.leaderless"})
    with pytest.raises(KafkaException, match=r"topic b\.gone was deleted"):
        ShardWorker._look_up_waiting_topics(_worker(topics), _waiting("a.leaderless", "b.gone"))
    assert topics.asked == ["a.leaderless", "b.gone"]


def test_topics_still_there_with_their_partitions_are_waited_for() -> None:
    topics = _Topics({"a": 3, "b": 4}, failing=set())
    assert ShardWorker._look_up_waiting_topics(_worker(topics), _waiting("a", "b", "a")) is False
    assert topics.asked == ["a", "b"]  # each once


def test_fewer_partitions_than_the_client_knew_give_the_batch_up() -> None:
    topics = _Topics({"a": 1}, failing=set())
    with pytest.raises(KafkaException, match="topic a has 1 partitions now, not 3"):
        ShardWorker._look_up_waiting_topics(_worker(topics), _waiting("a"))
