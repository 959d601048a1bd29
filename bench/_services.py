"""A scratch database on the local services for a benchmark run."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox

ROOT = Path(__file__).resolve().parent.parent


def service_env() -> dict[str, str]:
    """Addresses from the environment, else from `scripts/services.py up` (which starts them)."""
    if os.environ.get("OUTBOX_TEST_PG_DSN") and os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP"):
        return {k: v for k, v in os.environ.items() if k.startswith("OUTBOX_")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "services.py"), "up"],
        check=True,
        text=True,
        capture_output=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if line.startswith("OUTBOX_"))


@contextmanager
def scratch_database() -> Iterator[str]:
    """A fresh, migrated database; dropped afterwards."""
    admin_dsn = service_env()["OUTBOX_TEST_PG_DSN"]
    name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(admin_dsn)
    params["dbname"] = name
    dsn = make_conninfo(**params)  # type: ignore[arg-type]
    try:
        outbox.migrate(dsn)
        yield dsn
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def delete_topics(bootstrap: str, names: list[str]) -> None:
    """Delete these topics; one that was never created (a relay that did not start) is fine."""
    if not names:
        return
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics(names).values():
        try:
            future.result(30)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


BENCH_TOPIC_PREFIX = "bench."


def sweep_leftover_topics(bootstrap: str) -> int:
    """Delete every `bench.` topic: what earlier runs left behind when they were killed (their
    own cleanup did not run). A developer's broker gathered 195 of them, 8.9 GB: its CPU per
    record produced tripled, and the relay's 1M-record drain ran 41 % below its 10k one (none
    once they were gone). A run owns the `bench.` topics: run one benchmark at a time. Returns
    how many were deleted."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(BENCH_TOPIC_PREFIX)]
    delete_topics(bootstrap, names)
    if names:
        print(f"deleted {len(names)} topics earlier benchmark runs left behind", flush=True)
    return len(names)
