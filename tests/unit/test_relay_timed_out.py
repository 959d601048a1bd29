"""What a shard says of a batch whose Kafka transaction outran kafka_transaction_timeout."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from relay.kafka import OutcomeUnknown, TransactionTimedOut
from relay.shard import Row, ShardWorker, _Batch


def _tx(tx_id: str, n: int) -> list[Row]:
    return [Row(i, "orders", tx_id, "t", b"k", b"vv", None, None, 0, "committed") for i in range(n)]


def _worker(batch_size: int = 1000) -> Any:
    return SimpleNamespace(
        settings=SimpleNamespace(batch_size=batch_size),
        producer=SimpleNamespace(timeout_s=60.0, timeout_setting="relay.kafka_transaction_timeout"),
        _claim_limit=batch_size,
    )


def _said(worker: Any, batch: _Batch) -> str:
    timed_out = ShardWorker._timed_out(worker, batch, OutcomeUnknown("7 records had no report"))
    assert isinstance(timed_out, TransactionTimedOut)
    return str(timed_out)


def test_a_batch_within_batch_size_blames_kafka_or_the_batch_size_not_a_transaction() -> None:
    """A broker down for a minute timed out every batch: telling the operator to split an
    outbox transaction of 3 records, and sending one transaction a round, was wrong."""
    worker = _worker()
    said = _said(worker, _Batch(transactions=[_tx("a", 3), _tx("b", 997)]))
    assert "a batch of 1,000 records was not sent within" in said
    assert "Kafka was slow or unreachable, or batch_size (1000)" in said
    assert "7 records had no report" in said
    assert worker._claim_limit == 1000  # the next claim as usual


def test_a_batch_past_batch_size_names_its_largest_transaction_and_sends_the_first_alone() -> None:
    worker = _worker()
    said = _said(worker, _Batch(transactions=[_tx("small", 2), _tx("big", 5000)]))
    assert "a batch of 5,002 records of 2 outbox transactions" in said
    assert "transaction 'big' of producer group 'orders' (5,000 records, 15,000 bytes" in said
    assert worker._claim_limit == 1


def test_a_transaction_too_large_alone_says_how_to_go_on() -> None:
    worker = _worker()
    said = _said(worker, _Batch(transactions=[_tx("big", 5000)]))
    assert "'big' of producer group 'orders' (5,000 records" in said
    assert "in a batch of its own" in said
    assert "Raise relay.kafka_transaction_timeout" in said
