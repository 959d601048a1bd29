"""publish() overhead on a business transaction (issue: outbox benchmark).

Three variants of one business transaction (BEGIN; one row insert; COMMIT), interleaved in rounds
so that drift of the machine hits them alike:
  baseline  the business row only
  publish   plus publish() of one 1 KiB record
  batch100  plus publish_many() of 100 1 KiB records
and, as a reference for what the library adds over hand-written SQL, `raw_insert`: the business
row plus a plain INSERT of one 1 KiB row into a table of the same shape.
Goal: publish / baseline <= 1.3. Final line: JSON with medians (microseconds) and ratios.

    .venv/bin/python -m bench.publish [--transactions 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

import outbox
from bench import _cpu
from bench._services import scratch_database

VALUE = os.urandom(512).hex().encode()  # 1 KiB
BATCH = [outbox.Record("bench.orders", VALUE, key=str(i)) for i in range(100)]


def variants(ob: outbox.Outbox) -> dict[str, Callable[[psycopg.Connection[Any], int], None]]:
    def baseline(conn: psycopg.Connection[Any], i: int) -> None:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id, body) VALUES (%s, %s)", (i, "order"))

    def publish(conn: psycopg.Connection[Any], i: int) -> None:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id, body) VALUES (%s, %s)", (i, "order"))
            ob.publish(conn, "bench.orders", VALUE, key=str(i))

    def batch100(conn: psycopg.Connection[Any], i: int) -> None:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id, body) VALUES (%s, %s)", (i, "order"))
            ob.publish_many(conn, BATCH)

    def raw_insert(conn: psycopg.Connection[Any], i: int) -> None:
        with conn.transaction():
            conn.execute("INSERT INTO orders (id, body) VALUES (%s, %s)", (i, "order"))
            conn.execute(
                "INSERT INTO raw_outbox (topic, key, value) VALUES (%s, %s, %s)",
                ("bench.orders", str(i).encode(), VALUE),
            )

    return {
        "baseline": baseline,
        "publish": publish,
        "batch100": batch100,
        "raw_insert": raw_insert,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transactions", type=int, default=1000, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    _cpu.warn_if_busy()

    samples: dict[str, list[float]] = {}
    with scratch_database() as dsn, psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE orders (id bigint, body text)")
        conn.execute(
            "CREATE TABLE raw_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " topic text, key bytea, value bytea, created_at timestamptz DEFAULT now())"
        )
        conn.commit()
        runs = variants(outbox.Outbox())
        n = 0
        for run in runs.values():  # warm-up: prepared statements, caches
            for _ in range(50):
                run(conn, (n := n + 1))
        for _round in range(args.rounds):
            for name, run in runs.items():
                count = args.transactions // (10 if name == "batch100" else 1)
                start = time.perf_counter()
                for _ in range(count):
                    run(conn, (n := n + 1))
                per_tx = (time.perf_counter() - start) / count * 1e6
                samples.setdefault(name, []).append(per_tx)
                print(f"round {_round + 1} {name:10} {per_tx:8.1f} µs/transaction", flush=True)

    median = {k: round(statistics.median(v), 1) for k, v in samples.items()}
    result = {
        "benchmark": "publish",
        "median_us_per_transaction": median,
        "ratio_publish_vs_baseline": round(median["publish"] / median["baseline"], 3),
        "ratio_batch100_vs_baseline": round(median["batch100"] / median["baseline"], 3),
        "ratio_publish_vs_raw_insert": round(median["publish"] / median["raw_insert"], 3),
        "goal_ratio_publish_vs_baseline": 1.3,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
