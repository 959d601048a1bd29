"""The broker is a real Kafka with working transactions, not a stand-in."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import KafkaException, Producer

from tests.fixtures.kafka import TIMEOUT_S, consume_all


def _produce_in_transaction(
    producer: Producer, topic: str, values: list[str], commit: bool
) -> None:
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value=value.encode(), key=b"k")
    if commit:
        producer.commit_transaction(TIMEOUT_S)
    else:
        producer.flush(TIMEOUT_S)  # the records really reach the log before the abort
        producer.abort_transaction(TIMEOUT_S)


def test_read_committed_sees_committed_transactions_only(
    kafka_bootstrap: str, topic_factory: Callable[..., str], transactional_producer: Producer
) -> None:
    topic = topic_factory()
    _produce_in_transaction(transactional_producer, topic, ["a1", "a2", "a3"], commit=True)
    _produce_in_transaction(transactional_producer, topic, ["x1", "x2"], commit=False)
    _produce_in_transaction(transactional_producer, topic, ["b1"], commit=True)

    committed = consume_all(kafka_bootstrap, topic, "read_committed")
    assert [m.value() for m in committed] == [b"a1", b"a2", b"a3", b"b1"]

    # The aborted records were written to the log: a read_uncommitted reader sees them.
    uncommitted = consume_all(kafka_bootstrap, topic, "read_uncommitted")
    assert [m.value() for m in uncommitted] == [b"a1", b"a2", b"a3", b"x1", b"x2", b"b1"]


def test_a_second_producer_with_the_same_transactional_id_fences_the_first(
    kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    config = {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"fence-{topic}"}
    old = Producer(config)
    old.init_transactions(TIMEOUT_S)
    old.begin_transaction()
    old.produce(topic, value=b"zombie")

    new = Producer(config)
    new.init_transactions(TIMEOUT_S)  # bumps the epoch: the old producer is now a zombie
    _produce_in_transaction(new, topic, ["fresh"], commit=True)

    with pytest.raises(KafkaException) as raised:
        old.commit_transaction(TIMEOUT_S)
    error = raised.value.args[0]
    assert error.fatal() or error.txn_requires_abort()
    assert [m.value() for m in consume_all(kafka_bootstrap, topic, "read_committed")] == [b"fresh"]
