"""Which producer errors are a fencing (Fenced: maybe another owner, the lease decides) and
which a fatal error of this producer instance only (ProducerFailed)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from relay.kafka import Fenced, OutcomeUnknown, ProducerFailed, ShardProducer


class _Failing:
    """A librdkafka producer whose transactional calls all fail with one error."""

    def __init__(self, error: KafkaError) -> None:
        self.error = error

    def begin_transaction(self) -> None:
        raise KafkaException(self.error)

    def commit_transaction(self, timeout: float) -> None:
        raise KafkaException(self.error)


def producer_failing_with(error: KafkaError) -> ShardProducer:
    producer = ShardProducer({}, "test-0", timedelta(seconds=1))
    producer._producer = _Failing(error)  # type: ignore[assignment]
    return producer


FENCED = [
    KafkaError(KafkaError._FENCED, fatal=True),
    KafkaError(KafkaError.PRODUCER_FENCED, fatal=True),
    KafkaError(KafkaError.INVALID_PRODUCER_EPOCH),
]
FATAL = KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True)


@pytest.mark.parametrize("error", FENCED, ids=lambda e: e.name())
@pytest.mark.parametrize("call", ["begin", "commit"])
def test_a_fencing_is_told_apart(error: KafkaError, call: str) -> None:
    with pytest.raises(Fenced):
        getattr(producer_failing_with(error), call)()


@pytest.mark.parametrize("call", ["begin", "commit"])
def test_a_fatal_error_that_is_not_a_fencing_is_the_producer_s_own(call: str) -> None:
    with pytest.raises(ProducerFailed, match="OUT_OF_ORDER_SEQUENCE_NUMBER") as failed:
        getattr(producer_failing_with(FATAL), call)()
    assert not isinstance(failed.value, Fenced)


def test_a_retriable_commit_error_past_the_timeout_leaves_the_outcome_unknown() -> None:
    error: Any = KafkaError(KafkaError._TIMED_OUT, retriable=True)
    with pytest.raises(OutcomeUnknown):
        producer_failing_with(error).commit()
