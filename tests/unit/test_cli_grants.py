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
