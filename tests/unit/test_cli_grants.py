"""`outboxctl grants`: the SQL to run, as text or in JSON."""

from __future__ import annotations

import json

import pytest

from outbox import sql as outbox_sql
from relay.cli import main

ROLES = ["--writer-role", "app", "--relay-role", "relay", "--reconciler-role", "recon"]


def test_grants_as_text_and_as_json_say_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    expected = outbox_sql.grants_sql("billing", "app", "relay", "recon").as_string(None)
    assert main(["grants", "--schema", "billing", *ROLES]) == 0
    assert capsys.readouterr().out == expected + "\n"
    # --json printed the SQL text too, which no JSON reader takes
    assert main(["grants", "--schema", "billing", "--json", *ROLES]) == 0
    assert json.loads(capsys.readouterr().out) == {"schema": "billing", "sql": expected}


@pytest.mark.parametrize("command", [["grants", *ROLES], ["status"], ["records"]])
def test_a_schema_name_no_outbox_can_have_is_refused_by_every_command(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --schema a-b` said to run `migrate --schema a-b`, which refuses the name, and
    `grants` printed grants for a schema that cannot exist."""
    with pytest.raises(SystemExit, match=r"--schema: .*'a-b' is not a plain identifier"):
        main([command[0], "--schema", "a-b", *command[1:], "--dsn", "postgresql://x@h/db"])
    assert capsys.readouterr().out == ""


def test_the_grants_let_the_roles_call_the_schemas_function() -> None:
    """Left to PUBLIC's default EXECUTE: a database that revoked it refused the writer's
    prepare(check_immunity=...) (an index's expression) and every checker round."""
    text = outbox_sql.grants_sql("billing", "app", "relay", "recon").as_string(None)
    assert (
        'GRANT EXECUTE ON FUNCTION "billing".immune_until(timestamptz, interval) TO "app", "relay"'
        in text
    )


def test_a_checker_round_asked_of_a_disabled_checker_is_not_a_success(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_CHECKER__ENABLED", "false")
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://x@127.0.0.1:1/db")
    assert main(["checker", "--once", "--json"]) == 1
    assert json.loads(capsys.readouterr().out) == {"disabled": True}
