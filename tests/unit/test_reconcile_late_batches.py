"""Which store batches have their late observations judged by a running reconciliation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from spark.job import late_due_batches

T = datetime(2026, 1, 1, tzinfo=UTC)
LOW = T - timedelta(minutes=1)  # the judgement's lo: late before it, for a batch read first now


def at(seconds: float) -> datetime:
    return T + timedelta(seconds=seconds)


def test_batches_written_by_the_due_time_are_judged_from_the_first_unjudged_one() -> None:
    written = {0: at(0), 1: at(1), 2: at(2), 3: at(5)}
    read_before = {1: at(-30)}  # the lo of the judgement that read batch 1 first
    due = late_due_batches(written, 1, read_before, due_by=at(2), low=LOW)
    # batch 0 was judged before; batch 3 waits: what came with it may be in the next batch
    assert due == {1: at(-30), 2: LOW}


def test_a_batch_written_out_of_order_waits_for_the_ones_before_it() -> None:
    """The ones due are the first, in order: the next judgement goes on from the first not
    judged, and would otherwise judge one again."""
    written = {4: at(0), 5: at(10), 6: at(1)}
    assert late_due_batches(written, 4, {}, due_by=at(5), low=LOW) == {4: LOW}


def test_nothing_is_due_before_its_batch_was_written_long_enough_ago() -> None:
    written = {7: at(3)}
    assert late_due_batches(written, 7, {}, due_by=at(2.999), low=LOW) == {}
    assert late_due_batches(written, 7, {}, due_by=at(3), low=LOW) == {7: LOW}
    assert late_due_batches(written, 8, {}, due_by=at(9), low=LOW) == {}  # judged already
