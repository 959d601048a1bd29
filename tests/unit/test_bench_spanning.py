"""bench/spanning.py's backlog: its shape is what the benchmark's figures are read against."""

from __future__ import annotations

import pytest

from bench.spanning import KEYS, spans, transactions

# four shards of the benchmark's keys, as key_shards() would give them (pure: no database)
SHARDS = {key: i % 4 for i, key in enumerate(KEYS)}


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
def test_the_backlog_holds_the_records_asked_in_transactions_of_one_to_four(share: float) -> None:
    txs = transactions(SHARDS, 5000, share, seed=3)
    assert sum(map(len, txs)) == 5000
    assert {len(tx) for tx in txs} <= {1, 2, 3, 4}
    assert all(key in SHARDS for tx in txs for key in tx)


def test_the_share_asked_of_transactions_of_two_or_more_span_shards() -> None:
    txs = [tx for tx in transactions(SHARDS, 20_000, 0.25, seed=3) if len(tx) > 1]
    share = sum(spans(SHARDS, tx) for tx in txs) / len(txs)
    assert 0.22 < share < 0.28


def test_the_baseline_keeps_every_transaction_in_one_shard_and_one_shard_never_spans() -> None:
    assert not any(spans(SHARDS, tx) for tx in transactions(SHARDS, 5000, 0.0, seed=3))
    one_shard = dict.fromkeys(KEYS, 0)
    assert not any(spans(one_shard, tx) for tx in transactions(one_shard, 5000, 1.0, seed=3))


def test_the_same_seed_gives_the_same_backlog() -> None:
    assert transactions(SHARDS, 3000, 0.25, seed=7) == transactions(SHARDS, 3000, 0.25, seed=7)
