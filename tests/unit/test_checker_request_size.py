"""A check request's size as sent, and what an error answer says: pure logic of the checker."""

from __future__ import annotations

from datetime import UTC, datetime

from checker._claim import Claim
from checker._client import _error_said
from outbox.checkback import CheckRecord

T = datetime(2026, 11, 29, tzinfo=UTC)


def claim(records: list[CheckRecord]) -> Claim:
    return Claim(
        "orders", "tx-1", 1, T, T, T, T, T, record_count=len(records), records=tuple(records)
    )


def test_a_request_stays_under_its_budget_in_bytes_not_characters() -> None:
    """Counted in characters, headers of 1000 "€" (3000 bytes each) made a body three times
    the budget: refused by an endpoint at its limit, at every check, then discarded."""
    records = [
        CheckRecord(id=i, topic="orders", key=None, headers={"note": "€" * 1000})
        for i in range(100)
    ]
    request = claim(records).request(64 * 1024)
    assert len(request.model_dump_json().encode()) <= 64 * 1024
    assert 0 < len(request.records) < 100
    assert request.record_count == 100
    assert [r.id for r in request.records] == list(range(len(request.records)))  # the first


def test_an_error_answer_nested_past_the_parsers_depth_says_nothing_and_raises_nothing() -> None:
    assert _error_said(b"[" * 60_000) == ""
    assert _error_said(b'{"error": "signature_invalid", "detail": "no"}') == (
        " (signature_invalid: no)"
    )
