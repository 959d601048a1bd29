"""send_in_transaction's result: when the records' fate contradicts the local answer."""

from __future__ import annotations

import pytest

from outbox import LocalTransactionResult, State, TransactionStatus, Written

COMMIT, ROLLBACK, UNKNOWN = (
    TransactionStatus.COMMIT,
    TransactionStatus.ROLLBACK,
    TransactionStatus.UNKNOWN,
)


@pytest.mark.parametrize(
    ("status", "state", "conflict"),
    [
        (COMMIT, State.COMMITTED, False),
        (COMMIT, State.DELIVERED, False),
        (COMMIT, State.PARKED, False),  # committed; the broker refused it: parked, not lost
        (COMMIT, State.PREPARED, False),  # the checker settles it with the endpoint
        (COMMIT, State.ROLLED_BACK, True),
        (COMMIT, State.DISCARDED, True),
        (ROLLBACK, State.ROLLED_BACK, False),
        (ROLLBACK, State.DISCARDED, False),  # never delivered either: as the answer wants
        (ROLLBACK, State.PREPARED, False),
        (ROLLBACK, State.COMMITTED, True),
        (ROLLBACK, State.DELIVERED, True),
        (ROLLBACK, State.PARKED, True),
        (UNKNOWN, State.COMMITTED, False),
        (UNKNOWN, State.ROLLED_BACK, False),
    ],
)
def test_conflict_is_a_fate_that_contradicts_the_answer(
    status: TransactionStatus, state: State, conflict: bool
) -> None:
    result = LocalTransactionResult(Written("tx", (1,), "g"), status, state)
    assert result.conflict is conflict
