"""The relay's array literals as Postgres reads them (relay/pgarray.py)."""

import psycopg

from relay import pgarray


def test_postgres_reads_the_literals_as_the_lists_they_came_from(pg_dsn: str) -> None:
    ids, offsets = [7, -3, 9_223_372_036_854_775_807], [None, 0, 12]
    states, xids = ["committed", "NULL", "rolled_back"], ["18446744073709551615", "5"]
    with psycopg.connect(pg_dsn) as conn:
        for binary in (False, True):  # the relay's claims ask for binary results
            row = conn.execute(
                "SELECT %(ids)s::bigint[], %(offsets)s::bigint[], %(states)s::text[],"
                " cardinality(%(xids)s::xid8[]), (%(xids)s::xid8[])[1]::text",
                {
                    "ids": pgarray.integers(ids),
                    "offsets": pgarray.integers(offsets),
                    "states": pgarray.words(states),
                    "xids": pgarray.words(xids),
                },
                binary=binary,
            ).fetchone()
            assert row == (ids, offsets, states, 2, xids[0])
