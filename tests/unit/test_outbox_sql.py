"""The library's and the relay's SQL files render for a schema: a brace meant for Postgres (an
array literal '{}') is a placeholder to psycopg's sql.SQL.format and must be doubled. One that
was not failed every claim that read a discarded record, with IndexError, before Postgres."""

from __future__ import annotations

import pytest

from outbox import sql


@pytest.mark.parametrize("name", sorted(sql._queries()))
def test_each_query_renders_for_a_schema(name: str) -> None:
    text = sql.query(name, "my schema").decode()
    if "{schema}" in sql._queries()[name]:
        assert '"my schema".' in text
    assert "{schema}" not in text
