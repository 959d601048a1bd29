"""How `outboxctl records` shows a key, a tx id and a reason: as they are only when printing
them cannot mislead."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from relay.records import RecordRow, shown

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def row(key: bytes | None) -> RecordRow:
    return RecordRow(
        id=1,
        producer_group="g",
        tx_id="t",
        state="committed",
        topic="orders",
        key=key,
        partition=None,
        value_bytes=1,
        created_at=NOW,
        state_changed_at=NOW,
        check_count=0,
        next_check_at=None,
        ended_at=None,
        kafka_partition=None,
        kafka_offset=None,
        reason=None,
    )


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        (b"order-42", "order-42"),
        ("żółw 42".encode(), "żółw 42"),
        (None, "-"),
        (b"\xff\x01", "base64:/wE="),
        # a newline faked a second row of the listing; an escape could rewrite the terminal
        (b"k\n    99  rolled_back", "base64:awogICAgOTkgIHJvbGxlZF9iYWNr"),
        (b"\x1b[2Jk", "base64:G1sySms="),
        (b"base64:/wE=", "base64:YmFzZTY0Oi93RT0="),  # not mistaken for the binary key above
    ],
)
def test_a_key_is_text_when_printable_else_marked_base64(key: bytes | None, shown: str) -> None:
    assert row(key).key_text() == shown


@pytest.mark.parametrize(
    ("text", "printed"),
    [
        ("01a226bd-6d2c", "01a226bd-6d2c"),
        ("zamówienie-7", "zamówienie-7"),
        # any writer may store a tx id (or a broker's reason) of several lines
        ("t\n    99  rolled_back", "t\\n    99  rolled_back"),
        ("\x1b[2Jt", "\\x1b[2Jt"),
    ],
)
def test_a_tx_id_or_reason_is_printed_with_its_control_characters_escaped(
    text: str, printed: str
) -> None:
    assert shown(text) == printed
