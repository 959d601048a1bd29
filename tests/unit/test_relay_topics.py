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


class _Creating(_Admin):
    """A broker that makes the topic, then shows it in its metadata only after a while, and
    its partitions led only after that."""

    def __init__(self, seen: list[Any]) -> None:
        super().__init__(None)
        self.seen = seen
        self.created = False

    def create_topics(self, new: list[Any]) -> dict[str, Any]:
        self.created = True
        return {new[0].topic: SimpleNamespace(result=lambda timeout: None)}

    def list_topics(self, name: str, timeout: float) -> Any:
        self.topic = self.seen.pop(0) if self.created and self.seen else self.topic
        return super().list_topics(name, timeout)


def _led(*leaders: int) -> Any:
    return SimpleNamespace(
        error=None, partitions={i: SimpleNamespace(leader=n) for i, n in enumerate(leaders)}
    )


def test_a_topic_made_is_ready_once_its_partitions_have_leaders() -> None:
    """Looked up at once, a marker topic just made had no leader, then seemed missing, and the
    relay stopped at its first start: "deleted while the relay ran"."""
    leaderless = SimpleNamespace(error=KafkaError(KafkaError.LEADER_NOT_AVAILABLE), partitions={})
    admin = _Creating([None, leaderless, _led(-1, 0), _led(0, 0)])
    topics = topics_seeing(None)
    topics._admin = admin  # type: ignore[assignment]
    topics.ensure("markers", 2, {})
    assert admin.seen == []  # it waited through each stage
    assert topics.partitions("markers") == 2


def test_a_topic_made_that_gets_no_leader_in_time_is_an_error_that_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("relay.kafka.TOPIC_READY_S", 0.3)
    admin = _Creating([_led(-1)] * 100)
    topics = topics_seeing(None)
    topics._admin = admin  # type: ignore[assignment]
    with pytest.raises(KafkaException, match=r"had no leaders after 0\.3s"):
        topics.ensure("markers", 1, {})


def test_a_topic_made_that_we_may_not_see_is_left_to_the_callers_checks_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not authorised to describe it, its leaders were awaited for the whole wait, then said
    to be missing: the setup's own check says what is wrong, and stops the relay."""
    monkeypatch.setattr("relay.kafka.TOPIC_READY_S", 30.0)
    forbidden = SimpleNamespace(
        error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), partitions={}
    )
    admin = _Creating([forbidden] * 100)
    topics = topics_seeing(None)
    topics._admin = admin  # type: ignore[assignment]
    topics.ensure("markers", 1, {})
    assert len(admin.seen) == 99  # one look-up after it was made, not a wait


def test_a_topic_with_the_zero_id_has_none() -> None:
    """A cluster in ZooKeeper mode mid-upgrade gives topics no id: all zeros, the same for a
    topic made again, which an id compared would never tell apart."""
    from confluent_kafka import Uuid

    class _Describing(_Admin):
        def describe_topics(self, names: Any, request_timeout: float) -> dict[str, Any]:
            done = SimpleNamespace(result=lambda timeout: SimpleNamespace(topic_id=Uuid(0, 0)))
            return {"t": done}

    topics = topics_seeing(None)
    topics._admin = _Describing(None)  # type: ignore[assignment]
    assert topics.topic_id("t") is None
