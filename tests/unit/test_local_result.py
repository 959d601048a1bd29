"""send_in_transaction's result: when the records' fate contradicts the local answer."""

from __future__ import annotations

import functools

import pytest

from outbox import LocalTransactionResult, OutboxUsageError, State, TransactionStatus, Written
from outbox._callbacks import is_async
from outbox._local import parse_status

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


@pytest.mark.parametrize(
    ("awaited", "said"),
    [
        (False, "returned an awaitable, which Outbox cannot await: use AsyncOutbox"),
        (True, "answer, once awaited, was another awaitable (a Task or a coroutine"),
    ],
)
def test_an_awaitable_answer_is_refused_with_the_fix_of_the_api_that_got_it(
    awaited: bool, said: str
) -> None:
    """AsyncOutbox awaits the answer once: an awaitable out of that (a Task returned) was told
    to use AsyncOutbox, which it was using."""

    async def status() -> TransactionStatus:
        return COMMIT

    answer = status()
    with pytest.raises(OutboxUsageError) as refused:
        parse_status(answer, Written("tx", (1,), "g"), awaited=awaited)
    assert said in str(refused.value)
    assert ("AsyncOutbox" in str(refused.value)) is not awaited
    assert "stay so" in str(refused.value)  # the records are named, left prepared
    assert answer.cr_frame is None  # closed: never awaited, and no warning later


class _AsyncCallable:
    async def __call__(self, written: Written, note: str = "") -> TransactionStatus:
        return COMMIT


async def _async_function(written: Written, note: str = "") -> TransactionStatus:
    return COMMIT


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (_async_function, True),
        (_AsyncCallable(), True),
        (functools.partial(_async_function, note="x"), True),
        (functools.partial(_AsyncCallable(), note="x"), True),  # was taken for a sync one
        (functools.partial(functools.partial(_AsyncCallable()), note="x"), True),
        (functools.partial(lambda written, note="": COMMIT, note="x"), False),
        (lambda written: COMMIT, False),
    ],
)
def test_an_async_callback_is_told_apart_through_partials(fn: object, expected: bool) -> None:
    """The sync send_in_transaction refuses an async local transaction before writing anything;
    a partial of an object with an async __call__ got past, its records were prepared, and only
    then was it refused."""
    assert is_async(fn) is expected
