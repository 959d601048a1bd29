"""How `outboxctl records` shows a key, a tx id and a reason: as they are only when printing
them cannot mislead."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

import pytest

from relay.cli import main
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


@pytest.fixture
def refused_dsn() -> str:
    """A loopback port nothing listens on: any connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/app"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["records", "--limit", "0"], "outboxctl records: limit must be at least 1, not 0"),
        (["records", "--state", "lost"], "outboxctl records: state must be one of prepared"),
        (["findings", "--limit", "0"], "outboxctl findings: limit must be at least 1, not 0"),
        (["findings", "--kind", "lost"], "outboxctl findings: unknown finding kinds ['lost']"),
    ],
)
def test_a_bad_listing_option_is_a_usage_error_with_the_database_away(
    argv: list[str], said: str, refused_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked after connecting, `records --limit 0` said "connection refused" (exit 1) when
    the database was away, and exit 2 when it was there: a script could not tell them apart."""
    assert main([*argv, "--dsn", refused_dsn, "--schema", "outbox"]) == 2
    err = capsys.readouterr().err
    assert said in err
    assert "refused" not in err


@pytest.mark.parametrize("command", ["records", "findings", "status"])
def test_a_malformed_dsn_fails_every_listing_alike(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`records` took a malformed --dsn for bad input (2), `status` for a failure (1)."""
    assert main([command, "--dsn", "postgresql://u:p%zz@h/db", "--schema", "outbox"]) == 1
    assert "p%zz" not in capsys.readouterr().err  # the password stays unsaid
