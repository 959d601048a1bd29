"""The checker against the real Postgres and real HTTP endpoints on loopback.

Endpoints are `outbox.checkback.serve(CheckHandler(...))` (the producer side as applications run
it) or, for misbehaving endpoints, a tiny HTTP server of the test's own. Time is the checker's
injectable clock, moved by the tests: nothing here sleeps to synchronise.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from checker import (
    CheckerSettings,
    CheckRoundResult,
    HttpCheckClient,
    TransactionBusyError,
    _claim,
    rearm,
    resolve,
)
from checker._claim import Claim
from checker._client import CheckAnswer, Outcome
from checker.config import EndpointSettings
from checker.service import Checker, utc_now
from outbox import IllegalTransitionError, Record, UnknownTransactionError
from outbox.checkback import (
    HEADER_ID,
    CheckHandler,
    CheckRequest,
    RunningServer,
    Signer,
    TransactionStatus,
    build_response,
    serve,
)
from relay.cli import main as cli_main
from relay.config import load_settings
from tests.fixtures.postgres import GrantedRoles
from tests.integration.test_relay_commit_wait import standby_that_never_answers  # noqa: F401
from tests.integration.test_relay_delivery import wait_for

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()
GROUP = "orders"
S = timedelta(seconds=1)
LEASE = 5 * S + 10 * S  # default endpoint timeout + default lease margin

COMMIT, ROLLBACK, UNKNOWN = (
    TransactionStatus.COMMIT,
    TransactionStatus.ROLLBACK,
    TransactionStatus.UNKNOWN,
)


# --- helpers ---------------------------------------------------------------------------------


class Clock:
    """The checker's clock; tests set and move it."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now or datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


class Resolver:
    """The application's resolver: answers per tx id, records every request it gets."""

    def __init__(self, default: TransactionStatus = UNKNOWN) -> None:
        self.default = default
        self.answers: dict[str, TransactionStatus] = {}
        self.asked: list[CheckRequest] = []
        self.lock = threading.Lock()
        self.before_answer: Callable[[CheckRequest], None] | None = None

    def __call__(self, request: CheckRequest) -> TransactionStatus:
        with self.lock:
            self.asked.append(request)
        if self.before_answer is not None:
            self.before_answer(request)
        return self.answers.get(request.tx_id, self.default)

    def count(self, tx_id: str) -> int:
        with self.lock:
            return sum(1 for r in self.asked if r.tx_id == tx_id)


@dataclass
class Endpoint:
    url: str
    resolver: Resolver


Reply = tuple[int, dict[str, str], bytes]


class _QuietServer(ThreadingHTTPServer):
    closed = threading.Semaphore(0)  # released as each connection is closed (set per server)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a checker that dropped the connection on purpose: not worth a traceback

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        self.closed.release()


class RawServer:
    """A tiny HTTP server of the test's own: `reply(headers, body)` decides the whole answer."""

    def __init__(
        self,
        reply: Callable[[dict[str, str], bytes], Reply],
        tls: ssl.SSLContext | None = None,
        interim: bytes = b"",
        keep_alive: bool = True,
    ) -> None:
        self.requests = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                outer.requests += 1
                status, headers, data = reply({k.lower(): v for k, v in self.headers.items()}, body)
                self.wfile.write(interim)  # informational (1xx) responses before the answer
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                # not kept after all, unsaid (no Connection: close): closed as a server's
                # keep-alive timeout closes it, over TLS with no close_notify
                self.close_connection = not keep_alive

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.closed = threading.Semaphore(0)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.httpd.server_address[1]}/outbox/check"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def signed_answer(
    headers: dict[str, str], body: bytes, status: TransactionStatus, secret: str = SECRET
) -> Reply:
    request = json.loads(body)
    answer_headers, answer = build_response(
        Signer(secret), request_id=headers[HEADER_ID], tx_id=request["tx_id"], status=status
    )
    return 200, answer_headers, answer


def prepare(
    dsn: str,
    group: str = GROUP,
    *,
    records: int = 1,
    tx_id: str | None = None,
    check_immunity: float | None = None,
) -> tuple[str, datetime]:
    """A prepared transaction; returns its tx id and the records' created_at."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        written = outbox.prepare_many(
            conn,
            [
                Record("orders.paid", {"n": i}, key=f"k{i}", headers={"trace": f"t{i}"})
                for i in range(records)
            ],
            tx_id=tx_id,
            producer_group=group,
            check_immunity=check_immunity,
        )
        created = conn.execute(
            "SELECT min(created_at) FROM outbox.outbox_record WHERE tx_id = %s", (written.tx_id,)
        ).fetchone()
    assert created is not None
    return written.tx_id, created[0]


def rows(dsn: str, tx_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(
            "SELECT id, state, check_count, next_check_at, last_checked_at, check_lease_until,"
            " reason, ended_at, committed_xid::text AS committed_xid, topic, key, value, headers,"
            " created_at"
            " FROM outbox.outbox_record WHERE tx_id = %s ORDER BY id",
            (tx_id,),
        )
        names = [c.name for c in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def one(dsn: str, tx_id: str) -> dict[str, Any]:
    found = rows(dsn, tx_id)
    assert len({(r["state"], r["check_count"], r["next_check_at"]) for r in found}) == 1, (
        "records of one transaction must share state and check bookkeeping"
    )
    return found[0]


def audit(dsn: str, tx_id: str) -> list[dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(
            "SELECT actor, action, producer_group, detail, db_role FROM outbox.audit_log"
            " WHERE tx_id = %s ORDER BY id",
            (tx_id,),
        )
        return [
            {"actor": a, "action": b, "producer_group": c, "detail": d, "db_role": e}
            for a, b, c, d, e in cur.fetchall()
        ]


def endpoint_settings(url: str, **overrides: Any) -> dict[str, Any]:
    return {"url": url, "secrets": [SECRET], **overrides}


def settings(endpoints: dict[str, dict[str, Any]], **overrides: Any) -> CheckerSettings:
    base: dict[str, Any] = {"backoff_jitter": 0.0, "metrics_interval": "PT0S"}
    return CheckerSettings.model_validate({**base, **overrides, "endpoints": endpoints})


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    resolver = Resolver()
    with serve(CheckHandler(resolver, [SECRET])) as running:
        yield Endpoint(running.url, resolver)


@pytest.fixture
def raw_servers() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def start(reply: Callable[[dict[str, str], bytes], Reply], **kwargs: Any) -> RawServer:
        server = RawServer(reply, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def make_checker(pg_dsn: str) -> Iterator[Callable[..., Checker]]:
    made: list[Checker] = []

    def make(s: CheckerSettings, clock: Clock, dsn: str | None = None, **kwargs: Any) -> Checker:
        kwargs.setdefault("rng", random.Random(0))
        checker = Checker(s, dsn or pg_dsn, clock=clock, **kwargs)
        made.append(checker)
        return checker

    yield make
    for checker in made:
        checker.stop()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- answers ---------------------------------------------------------------------------------


def test_commit_answer_commits_every_record_and_wakes_the_relay(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = COMMIT
    tx_id, created = prepare(pg_dsn, records=3)
    clock = Clock(created + 6 * S)  # exactly the default check immunity
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    before = metric("outbox_checker_checks_total", producer_group=GROUP, outcome="commit")
    with psycopg.connect(pg_dsn, autocommit=True) as listen:
        listen.execute("LISTEN outbox_wakeup")
        result = checker.run_once()
        woken = list(listen.notifies(timeout=10, stop_after=1))
    assert (result.due, result.checked, result.committed) == (1, 1, 1)
    assert len(woken) == 1
    records = rows(pg_dsn, tx_id)
    assert [r["state"] for r in records] == ["committed"] * 3
    assert all(r["committed_xid"] is not None and r["next_check_at"] is None for r in records)
    [request] = endpoint.resolver.asked
    assert (request.producer_group, request.tx_id, request.check_count) == (GROUP, tx_id, 1)
    assert request.first_prepared_at == created
    assert [(r.id, r.topic, r.key, r.headers) for r in request.records] == [
        (rec["id"], "orders.paid", f"k{i}".encode(), {"trace": f"t{i}"})
        for i, rec in enumerate(records)
    ]
    after = metric("outbox_checker_checks_total", producer_group=GROUP, outcome="commit")
    assert after == before + 1


def test_the_checker_and_the_manual_commands_work_on_a_sql_ascii_database(
    database_in: Callable[[str], str], endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """psycopg gives text as bytes on a SQL_ASCII database, which the library supports: the
    checker's claim failed on b'orders'.casefold() every round, and `resolve` read states as
    "b'prepared'" (found by a review of the checker)."""
    dsn = database_in("SQL_ASCII")
    endpoint.resolver.default = COMMIT
    first, _ = prepare(dsn)
    second, created = prepare(dsn)
    clock = Clock(created + 6 * S)  # both past their check immunity
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock, dsn=dsn)
    result = checker.run_once()
    assert (result.checked, result.committed) == (2, 2)
    assert {bytes(r["state"]) for tx in (first, second) for r in rows(dsn, tx)} == {b"committed"}
    unchecked, _ = prepare(dsn, check_immunity=3600)
    argv = ["resolve", "--dsn", dsn, "--schema", "outbox", "--producer-group", GROUP]
    assert (
        cli_main([*argv, "--tx-id", unchecked, "--rollback", "--actor", "a", "--reason", "r"]) == 0
    )
    assert {bytes(r["state"]) for r in rows(dsn, unchecked)} == {b"rolled_back"}  # bytes here


def test_a_tx_id_another_writer_stored_is_ended_as_the_table_takes_it(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The table takes any tx id of 1 to 128 characters; the library's check for new ones is
    stricter (no spaces). Ending such a transaction was refused: the checker's COMMIT was never
    applied (discarded at max checks after all), and no operator could resolve it."""
    endpoint.resolver.default = COMMIT
    with psycopg.connect(pg_dsn) as conn:
        for tx_id in ("order 42", "order 43"):
            conn.execute(
                "INSERT INTO outbox.outbox_record (producer_group, tx_id, topic, value, key_hash,"
                " state, created_at) VALUES (%s, %s, 'orders.paid', 'v', 0, 'prepared',"
                " now() - interval '1 minute')",
                (GROUP, tx_id),
            )
        conn.commit()
        with pytest.raises(outbox.InvalidTxIdError):  # new records still get the strict check
            outbox.prepare(conn, "orders.paid", "v", tx_id="order 44")
        conn.rollback()
        resolve(conn, GROUP, "order 43", ROLLBACK, actor="alice", reason="checked by hand")
    assert (
        make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), Clock())
        .run_once()
        .committed
        == 1
    )
    assert (one(pg_dsn, "order 42")["state"], one(pg_dsn, "order 43")["state"]) == (
        "committed",
        "rolled_back",
    )


def test_a_producer_group_in_mixed_case_is_checked_by_an_endpoint_set_in_the_environment(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Environment variables carry no case: OUTBOX_CHECKER__ENDPOINTS__OrderService__URL
    reaches the settings as `orderservice`. The group `OrderService` is checked all the same,
    not left to be discarded at max age for want of an endpoint."""
    endpoint.resolver.default = COMMIT
    tx_id, created = prepare(pg_dsn, group="OrderService")
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS__OrderService__URL", endpoint.url)
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS__OrderService__SECRETS", json.dumps([SECRET]))
    from_env = load_settings(database={"dsn": pg_dsn}).checker
    s = from_env.model_copy(update={"backoff_jitter": 0.0})
    checker = make_checker(s, Clock(created + 7 * S))
    assert checker.run_once().committed == 1
    assert [r.producer_group for r in endpoint.resolver.asked] == ["OrderService"]
    assert {r["state"] for r in rows(pg_dsn, tx_id)} == {"committed"}
    checks = metric("outbox_checker_checks_total", producer_group="orderservice", outcome="commit")
    assert checks >= 1  # labelled by the endpoint's name, not by every spelling seen in rows


def test_rollback_answer_rolls_back(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = ROLLBACK
    tx_id, created = prepare(pg_dsn, records=2)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    assert checker.run_once().rolled_back == 1
    assert [(r["state"], r["committed_xid"], r["ended_at"]) for r in rows(pg_dsn, tx_id)] == [
        ("rolled_back", None, None)
    ] * 2


def test_unknown_backs_off_exponentially_and_asks_again(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created + 10 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)

    assert checker.run_once().unknown == 1
    row = one(pg_dsn, tx_id)
    assert (row["state"], row["check_count"]) == ("prepared", 1)
    assert row["next_check_at"] == clock.now + 30 * S  # check_interval, no jitter here
    assert row["last_checked_at"] == clock.now

    first = clock.now
    clock.now = first + 30 * S - timedelta(microseconds=1)
    assert checker.run_once().checked == 0
    clock.now = first + 30 * S
    assert checker.run_once().unknown == 1
    row = one(pg_dsn, tx_id)
    assert row["check_count"] == 2
    assert row["next_check_at"] == clock.now + 60 * S  # times backoff_multiplier
    assert [r.check_count for r in endpoint.resolver.asked] == [1, 2]


def test_jitter_spreads_the_next_checks(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    created = [prepare(pg_dsn)[1] for _ in range(20)]
    clock = Clock(max(created) + 10 * S)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}, backoff_jitter=0.5), clock
    )
    assert checker.run_once().unknown == 20
    with psycopg.connect(pg_dsn) as conn:
        waits = [
            r[0] - clock.now for r in conn.execute("SELECT next_check_at FROM outbox.outbox_record")
        ]
    assert all(15 * S <= w <= 30 * S for w in waits)
    assert len(set(waits)) > 10


def test_check_immunity_default_and_per_record(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    default_tx, created = prepare(pg_dsn)
    own_tx, own_created = prepare(pg_dsn, check_immunity=60)
    assert own_created - created < S
    clock = Clock(created)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)

    clock.now = created + 6 * S - timedelta(microseconds=1)
    assert checker.run_once().due == 0
    clock.now = created + 6 * S
    assert checker.run_once().due == 1
    assert [r.tx_id for r in endpoint.resolver.asked] == [default_tx]

    clock.now = own_created + 60 * S - timedelta(microseconds=1)
    checker.run_once()
    assert endpoint.resolver.count(own_tx) == 0
    clock.now = own_created + 60 * S
    checker.run_once()
    assert endpoint.resolver.count(own_tx) == 1


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def test_check_immunity_counts_from_prepare_not_from_the_writers_transaction_start(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """created_at was the writer's transaction start (now()): work done before prepare() used
    up the immunity, and the record was checked the moment it committed."""
    endpoint.resolver.default = COMMIT
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        conn.execute("SELECT pg_sleep(1.5)")  # the business work before prepare()
        tx_id = outbox.prepare(
            conn, "orders.paid", "v", producer_group=GROUP, check_immunity=1
        ).tx_id
    clock = Clock(utc_now())  # just after the commit
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    assert checker.run_once().checked == 0  # 1 s from prepare() is not over
    assert endpoint.resolver.asked == []
    clock.now += 2 * S
    assert checker.run_once().committed == 1
    assert one(pg_dsn, tx_id)["state"] == "committed"


def test_the_due_scan_reads_no_record_still_inside_its_own_immunity(pg_dsn: str) -> None:
    """Records with an immunity of their own are found by when it ends: the scan reads the due
    one, not the many still immune (read by age, every round read all of them)."""
    for _ in range(200):
        prepare(pg_dsn, check_immunity=3600)
    due_tx, created = prepare(pg_dsn, check_immunity=1)
    params = {
        "now": created + 2 * S,
        "limit": 100,
        "default_immunity_s": 6.0,
        "max_age_s": 72 * 3600.0,
    }
    query = outbox.sql.query("checker_lock_due", "outbox")
    with psycopg.connect(pg_dsn) as conn, conn.transaction(force_rollback=True):
        conn.execute("SET LOCAL enable_seqscan = off")  # the plan of a table of many rows
        assert [r[1] for r in conn.execute(query, params).fetchall()] == [due_tx]
        explain = b"EXPLAIN (ANALYZE, FORMAT JSON) " + query
        (explained,) = conn.execute(explain, params).fetchone()  # type: ignore[misc]
    nodes = list(_plan_nodes(explained[0]["Plan"]))
    assert sum(n.get("Rows Removed by Filter", 0) for n in nodes) == 0
    (own,) = [n for n in nodes if n.get("Index Name") == "outbox_record_own_immunity_due_idx"]
    assert own["Actual Rows"] == 1


def test_transactions_of_many_records_do_not_end_a_run_of_rounds_early(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The due scan reads `batch_size` records, not transactions: with transactions of several
    records a round found fewer than `batch_size` transactions, called itself not full, and the
    checker waited a whole poll interval while more were due."""
    endpoint.resolver.default = COMMIT
    txs = [prepare(pg_dsn, records=4)[0] for _ in range(3)]
    clock = Clock(utc_now() + 10 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}, batch_size=6), clock)
    rounds = [checker.run_once()]
    while rounds[-1].full:
        assert len(rounds) < 6, rounds
        rounds.append(checker.run_once())
    assert sum(r.committed for r in rounds) == 3, rounds
    assert [one(pg_dsn, tx)["state"] for tx in txs] == ["committed"] * 3


def test_a_full_scan_of_rows_held_elsewhere_does_not_spin(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Only a round that moved something goes again at once: what another process holds
    stays due, and going again at once would spin on it."""
    tx_id, _ = prepare(pg_dsn, records=3)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}, batch_size=2), Clock(utc_now() + 10 * S)
    )
    with psycopg.connect(pg_dsn) as holder, holder.transaction():
        holder.execute(  # one record of three: the scan comes full, and finds it held
            "SELECT 1 FROM outbox.outbox_record WHERE tx_id = %s ORDER BY id LIMIT 1 FOR UPDATE",
            (tx_id,),
        )
        result = checker.run_once()
    assert (result.due, result.full) == (0, False)
    assert endpoint.resolver.asked == []


@pytest.mark.parametrize("scan", ["never checked", "own immunity", "checked before"])
def test_transactions_behind_records_held_elsewhere_are_checked(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], scan: str
) -> None:
    """An application ending its transaction inside a long one of its own holds its records
    (so does another checker's claim): counted in each scan's limit, they came first every
    round, and no transaction behind them was checked, nor discarded at its maximum age."""
    immunity = 1.0 if scan == "own immunity" else None
    held, _ = prepare(pg_dsn, records=3, check_immunity=immunity)
    behind, _ = prepare(pg_dsn, check_immunity=immunity)
    if scan == "checked before":
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE outbox.outbox_record SET check_count = 1,"
                " next_check_at = created_at + interval '1 second'"
            )
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}, batch_size=2), Clock(utc_now() + 10 * S)
    )
    with psycopg.connect(pg_dsn) as holder, holder.transaction():
        holder.execute("SELECT 1 FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (held,))
        assert checker.run_once().due == 1
    assert [r.tx_id for r in endpoint.resolver.asked] == [behind]


def before_berlins_spring_change(
    pg_dsn: str, tx_id: str, endpoint: Endpoint, zone: str
) -> tuple[datetime, CheckerSettings, str]:
    """The transaction prepared 2026-03-27 12:00 UTC (Berlin moves on the 29th), a 3-day
    maximum age, and a DSN whose sessions are in `zone`."""
    created = datetime(2026, 3, 27, 12, 0, tzinfo=UTC)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET created_at = %s WHERE tx_id = %s", (created, tx_id)
        )
    s = settings({GROUP: endpoint_settings(endpoint.url)}, max_prepared_age="P3D")
    return created, s, make_conninfo(pg_dsn, options=f"-c TimeZone={zone}")


@pytest.mark.parametrize("ahead_s", [-30, 7, 30])
def test_a_checker_on_a_host_whose_clock_is_off_schedules_by_the_databases(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], ahead_s: int
) -> None:
    """created_at and other checkers' leases are the database's times: a host 7 s ahead asked
    before the 6 s check immunity was over, while the application's local transaction ran."""
    endpoint.resolver.default = COMMIT
    tx_id, _ = prepare(pg_dsn)
    off = timedelta(seconds=ahead_s)
    s = settings({GROUP: endpoint_settings(endpoint.url)})
    checker = make_checker(s, lambda: utc_now() + off, follow_database_clock=True)
    assert checker.run_once().due == 0  # inside its immunity, by the database's clock
    assert endpoint.resolver.asked == []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as if 6 s had passed
        conn.execute(
            "UPDATE outbox.outbox_record SET created_at = created_at - interval '6 seconds'"
            " WHERE tx_id = %s",
            (tx_id,),
        )
    assert checker.run_once().committed == 1


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "Asia/Kathmandu"])
def test_the_maximum_prepared_age_is_hours_whatever_the_sessions_time_zone(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], zone: str
) -> None:
    """A day added to a timestamptz is 23 hours across Berlin's spring change: a record whose
    own immunity outlasts the 3-day maximum age was due at 71 hours there, and asked about,
    while the checker (in hours) did not discard it yet."""
    tx_id, _ = prepare(pg_dsn, check_immunity=5 * 86400)
    created, s, dsn = before_berlins_spring_change(pg_dsn, tx_id, endpoint, zone)
    early = make_checker(s, Clock(created + timedelta(hours=71, minutes=30)), dsn=dsn)
    assert early.run_once().due == 0
    assert endpoint.resolver.asked == []
    late = make_checker(s, Clock(created + timedelta(hours=72)), dsn=dsn)
    assert late.run_once().discarded == 1


@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin"])
def test_the_next_check_is_never_capped_at_a_discard_an_hour_early(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], zone: str
) -> None:
    """psycopg gives times in the session's zone, where adding 72 hours counts wall time: from
    before Berlin's spring change the discard came an hour early in Python, capped every next
    check there (in the past), and the endpoint was asked each round until max checks."""
    tx_id, _ = prepare(pg_dsn)
    created, s, dsn = before_berlins_spring_change(pg_dsn, tx_id, endpoint, zone)
    clock = Clock(created + timedelta(hours=71, minutes=30))
    checker = make_checker(s, clock, dsn=dsn)
    assert checker.run_once().unknown == 1
    assert one(pg_dsn, tx_id)["next_check_at"] == clock.now + 30 * S  # not the past
    assert checker.run_once().due == 0


def test_a_transaction_mixing_default_and_own_immunity_is_due_at_the_earlier(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.prepare(conn, "orders.paid", "default", tx_id="mixed", producer_group=GROUP)
        outbox.prepare(
            conn, "orders.paid", "own", tx_id="mixed", producer_group=GROUP, check_immunity=60
        )
        created = conn.execute("SELECT min(created_at) FROM outbox.outbox_record").fetchone()
    assert created is not None
    clock = Clock(created[0])
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    clock.now = created[0] + 6 * S
    assert checker.run_once().due == 1
    assert endpoint.resolver.count("mixed") == 1


# --- endpoints that fail: nothing changes but the check bookkeeping --------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _garbage(headers: dict[str, str], body: bytes) -> Reply:
    junk = b"<html>not an answer</html>"
    return 200, Signer(SECRET).sign("msg_garbage", int(datetime.now(UTC).timestamp()), junk), junk


def _unsigned(headers: dict[str, str], body: bytes) -> Reply:
    _, _, answer = signed_answer(headers, body, COMMIT)  # a genuine COMMIT, without signature
    return 200, {"content-type": "application/json"}, answer


def _wrongly_signed(headers: dict[str, str], body: bytes) -> Reply:
    return signed_answer(headers, body, COMMIT, secret=OTHER_SECRET)


def _too_large(headers: dict[str, str], body: bytes) -> Reply:
    status, answer_headers, answer = signed_answer(headers, body, COMMIT)
    padded = answer[:-1] + b"," + b'"pad":"' + b"x" * 70_000 + b'"}'
    return status, answer_headers, padded


FAILURES = {
    "down": "connect_error",
    "http_500": "http_error",
    "garbage": "bad_response",
    "unsigned": "bad_signature",
    "wrongly_signed": "bad_signature",
    "too_large": "too_large",
    # more digits than int() takes (4,300): check() raised ValueError
    "length_too_long_to_read": "too_large",
    "redirect": "redirect",
    "slow": "timeout",
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_failed_check_changes_only_the_bookkeeping(
    kind: str,
    pg_dsn: str,
    endpoint: Endpoint,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
) -> None:
    endpoint.resolver.default = COMMIT  # the honest endpoint would commit
    overrides: dict[str, Any] = {}
    release = threading.Event()
    running: RunningServer | None = None
    if kind == "down":
        url = f"http://127.0.0.1:{_closed_port()}/outbox/check"
    elif kind == "http_500":

        def broken(_request: CheckRequest) -> TransactionStatus:
            raise RuntimeError("the application's database is down")

        running = serve(CheckHandler(broken, [SECRET]))
        url = running.url
    elif kind == "slow":

        def blocked(_request: CheckRequest) -> TransactionStatus:
            release.wait(30)
            return COMMIT

        running = serve(CheckHandler(blocked, [SECRET]))
        url = running.url
        overrides = {"timeout": "PT0.3S", "connect_timeout": "PT0.3S"}
    elif kind == "redirect":
        url = raw_servers(lambda h, b: (307, {"location": endpoint.url}, b"")).url
    else:
        replies = {
            "garbage": _garbage,
            "unsigned": _unsigned,
            "wrongly_signed": _wrongly_signed,
            "too_large": _too_large,
            "length_too_long_to_read": lambda h, b: (200, {"content-length": "9" * 5000}, b""),
        }
        url = raw_servers(replies[kind]).url
    try:
        tx_id, created = prepare(pg_dsn, records=2)
        before = rows(pg_dsn, tx_id)
        clock = Clock(created + 7 * S)
        checker = make_checker(settings({GROUP: endpoint_settings(url, **overrides)}), clock)
        result = checker.run_once()
    finally:
        release.set()
        if running is not None:
            running.close()
    assert result.checked == 1
    assert result.outcomes == Counter({FAILURES[kind]: 1})
    after = rows(pg_dsn, tx_id)
    bookkeeping = {"check_count", "next_check_at", "last_checked_at"}
    for old, new in zip(before, after, strict=True):
        assert {k: v for k, v in old.items() if k not in bookkeeping} == {
            k: v for k, v in new.items() if k not in bookkeeping
        }
        assert (new["check_count"], new["next_check_at"]) == (1, clock.now + 30 * S)
    assert endpoint.resolver.asked == []  # the redirect was not followed


def test_answers_from_a_clock_behind_are_taken_within_the_tolerance_set(
    pg_dsn: str,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
) -> None:
    """The checker's verifier was fixed at 300 s: an application that raised its handler's
    tolerance to ride out clock skew had every answer refused, and its transactions
    discarded at max checks."""

    def ten_minutes_behind(headers: dict[str, str], body: bytes) -> Reply:
        request = json.loads(body)
        answer_headers, answer = build_response(
            Signer(SECRET), request_id=headers[HEADER_ID], tx_id=request["tx_id"],
            status=COMMIT, now=lambda: time.time() - 600,
        )  # fmt: skip
        return 200, answer_headers, answer

    url = raw_servers(ten_minutes_behind).url
    refused, created = prepare(pg_dsn)
    strict = make_checker(settings({GROUP: endpoint_settings(url)}), Clock(created + 7 * S))
    assert strict.run_once().outcomes == Counter({"bad_signature": 1})
    taken, created = prepare(pg_dsn)
    lenient = make_checker(
        settings({GROUP: endpoint_settings(url, signature_tolerance="PT15M")}),
        Clock(created + 7 * S),
    )
    assert lenient.run_once().outcomes == Counter({"commit": 1})
    assert one(pg_dsn, taken)["state"] == "committed"
    assert one(pg_dsn, refused)["state"] == "prepared"


def test_an_error_answer_says_what_the_endpoint_said(
    pg_dsn: str, make_checker: Callable[..., Checker], caplog: pytest.LogCaptureFixture
) -> None:
    """A secret rotated on one side only was "HTTP 401" and no more, while the transactions
    marched towards their discard."""
    running = serve(CheckHandler(Resolver(COMMIT), [OTHER_SECRET]))
    try:
        _, created = prepare(pg_dsn)
        checker = make_checker(
            settings({GROUP: endpoint_settings(running.url)}), Clock(created + 7 * S)
        )
        with caplog.at_level(logging.INFO):
            result = checker.run_once()
    finally:
        running.close()
    assert result.outcomes == Counter({"http_error": 1})
    assert "HTTP 401 (signature_invalid: no signature matches any configured secret)" in (
        caplog.text
    )


def test_a_content_length_that_is_not_ascii_is_a_failed_check_not_a_crash(
    pg_dsn: str,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
) -> None:
    """int() refused "²" with a ValueError that escaped the client with its watchdog
    still armed; the round logged it as an internal error."""

    def odd_length(headers: dict[str, str], body: bytes) -> Reply:
        status, answer_headers, answer = signed_answer(headers, body, COMMIT)
        return status, {**answer_headers, "content-length": "²"}, answer

    server = raw_servers(odd_length)
    _, created = prepare(pg_dsn)
    checker = make_checker(settings({GROUP: endpoint_settings(server.url)}), Clock(created + 7 * S))
    result = checker.run_once()
    assert result.outcomes != Counter({"internal_error": 1})
    assert result.checked == 1


def test_replayed_answer_to_another_request_changes_nothing(
    pg_dsn: str,
    endpoint: Endpoint,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
) -> None:
    """A man in the middle captures a genuine COMMIT answer and replays it for a later check."""
    captured: list[Reply] = []

    def replay(headers: dict[str, str], body: bytes) -> Reply:
        if not captured:
            captured.append(signed_answer(headers, body, COMMIT))
        return captured[0]

    url = raw_servers(replay).url
    s = settings({GROUP: endpoint_settings(url)})
    first, created = prepare(pg_dsn)
    seen_it = Clock(created + 7 * S)
    witness = make_checker(s, seen_it)
    assert witness.run_once().committed == 1  # the genuine answer, captured on the way
    # a checker that never saw that answer: signature and timestamp are fine, the request id not
    second, created = prepare(pg_dsn)
    result = make_checker(s, Clock(created + 7 * S)).run_once()
    assert result.outcomes == Counter({"mismatch": 1})
    # the checker that saw it refuses the reused message id before anything else
    third, created = prepare(pg_dsn)
    seen_it.now = created + 7 * S
    assert witness.run_once().outcomes == Counter({"bad_signature": 1})
    assert one(pg_dsn, first)["state"] == "committed"
    for tx_id in (second, third):
        assert (one(pg_dsn, tx_id)["state"], one(pg_dsn, tx_id)["check_count"]) == ("prepared", 1)


def self_signed(where: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_is_verified(
    pg_dsn: str,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
    tmp_path: Path,
) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    url = raw_servers(lambda h, b: signed_answer(h, b, COMMIT), tls=tls).url
    untrusted, created = prepare(pg_dsn)
    clock = Clock(created + 7 * S)
    result = make_checker(settings({GROUP: endpoint_settings(url)}), clock).run_once()
    assert result.outcomes == Counter({"connect_error": 1})
    assert one(pg_dsn, untrusted)["state"] == "prepared"

    trusted = make_checker(
        settings({GROUP: endpoint_settings(url, ca_file=str(cert))}), Clock(clock.now + 30 * S)
    )
    assert trusted.run_once().committed == 1
    assert one(pg_dsn, untrusted)["state"] == "committed"


def test_a_tls_connection_the_server_closed_without_notice_is_opened_again(
    pg_dsn: str,
    raw_servers: Callable[..., RawServer],
    make_checker: Callable[..., Checker],
    tmp_path: Path,
) -> None:
    """A TLS server's keep-alive timeout ends a connection with no close_notify (Python's, as
    gunicorn's): the next check on it failed with SSLEOFError, counted against max_checks and
    the circuit, where a plain connection's reset was tried again on a new one."""
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = raw_servers(lambda h, b: signed_answer(h, b, COMMIT), tls=tls, keep_alive=False)
    client = HttpCheckClient(
        EndpointSettings.model_validate(endpoint_settings(server.url, ca_file=str(cert)))
    )
    try:
        for n in range(1, 4):
            request = CheckRequest(
                producer_group=GROUP,
                tx_id=f"tx-{n}",
                check_count=1,
                first_prepared_at=datetime.now(UTC),
                records=[],
            )
            answer = client.check(request)
            assert (answer.outcome, answer.detail) == ("commit", "")
            assert server.httpd.closed.acquire(timeout=10)  # before the next check is sent
        assert server.requests == 3
    finally:
        client.close()


# --- limits: discard -------------------------------------------------------------------------


def test_max_checks_discards_and_audits(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    tx_id, created = prepare(pg_dsn, records=2)
    clock = Clock(created + 7 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}, max_checks=2), clock)
    caplog.set_level("INFO", logger="checker.service")
    assert checker.run_once().unknown == 1
    assert "(check 1 of 2); next check in 30s" in caplog.text
    clock.now += 30 * S
    assert checker.run_once().unknown == 1
    # the last check: no "next check", which never came
    assert "(check 2 of 2); no check is left: discarded in 60s unless" in caplog.text
    clock.now += 60 * S
    with psycopg.connect(pg_dsn, autocommit=True) as listen:
        listen.execute("LISTEN outbox_wakeup")
        result = checker.run_once()
        woken = list(listen.notifies(timeout=10, stop_after=1))
    assert (result.discarded, result.checked) == (1, 0)
    assert len(woken) == 1  # the relay ships discarded records: wake it
    assert endpoint.resolver.count(tx_id) == 2
    for row in rows(pg_dsn, tx_id):
        assert row["state"] == "discarded"
        assert row["reason"] == "max checks (2) reached"
        assert row["ended_at"] is None
        assert row["committed_xid"] is None
        assert row["next_check_at"] is None
    [entry] = audit(pg_dsn, tx_id)
    assert entry["action"] == "discard"
    assert entry["actor"].startswith("checker:")
    assert entry["detail"]["reason"] == "max checks (2) reached"
    assert entry["detail"]["check_count"] == 2
    assert entry["detail"]["record_ids"] == [r["id"] for r in rows(pg_dsn, tx_id)]
    clock.now += 3600 * S
    assert checker.run_once().due == 0  # nothing more to do with it


def test_the_last_checks_log_says_when_its_maximum_age_discards_it(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The discard comes at the next due time, which the maximum prepared age may bring
    forward: the log said the backoff (60 s) all the same."""
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created + 7 * S)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}, max_checks=2, max_prepared_age="PT60S"),
        clock,
    )
    caplog.set_level("INFO", logger="checker.service")
    assert checker.run_once().unknown == 1
    clock.now += 30 * S
    assert checker.run_once().unknown == 1
    assert "(check 2 of 2); no check is left: discarded in 23s unless" in caplog.text
    assert one(pg_dsn, tx_id)["next_check_at"] == created + 60 * S


def test_max_prepared_age_discards_even_without_an_endpoint(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    configured, created = prepare(pg_dsn)
    unconfigured, _ = prepare(pg_dsn, "nobody")
    clock = Clock(created + timedelta(hours=72, seconds=1))
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    result = checker.run_once()
    assert (result.discarded, result.checked) == (2, 0)
    assert endpoint.resolver.asked == []
    for tx_id in (configured, unconfigured):
        row = one(pg_dsn, tx_id)
        assert (row["state"], row["reason"], row["ended_at"]) == (
            "discarded",
            "max prepared age (72h) reached with no check made",
            None,
        )
        assert [a["action"] for a in audit(pg_dsn, tx_id)] == ["discard"]


def test_a_next_check_is_never_set_past_the_max_prepared_age(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """It was now + max_backoff for a group without an endpoint, and now + the backoff after
    an UNKNOWN: the discard at max prepared age came that much late (minutes, not seconds)."""
    unconfigured, created = prepare(pg_dsn, "nobody")
    unknown, unknown_created = prepare(pg_dsn)
    clock = Clock(created + 10 * S)
    s = settings({GROUP: endpoint_settings(endpoint.url)}, max_prepared_age="PT45S")
    checker = make_checker(s, clock)
    result = checker.run_once()
    assert (result.unknown, result.not_sent) == (1, 1)
    assert one(pg_dsn, unconfigured)["next_check_at"] == created + 45 * S  # not now + 10 min
    assert one(pg_dsn, unknown)["next_check_at"] == clock.now + 30 * S  # check_interval: earlier
    clock.now += 30 * S
    assert checker.run_once().unknown == 1
    next_at = one(pg_dsn, unknown)["next_check_at"]
    assert next_at == unknown_created + 45 * S  # not now + the backoff (60 s)
    clock.now = next_at
    assert checker.run_once().discarded == 2
    assert one(pg_dsn, unknown)["reason"] == "max prepared age (45s) reached"  # asked twice
    assert (
        one(pg_dsn, unconfigured)["reason"] == "max prepared age (45s) reached with no check made"
    )


def test_no_check_immunity_outlasts_the_max_prepared_age(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    tx_id, created = prepare(pg_dsn, check_immunity=200 * 3600)  # 200 h, over the 72 h limit
    clock = Clock(created + timedelta(hours=72, seconds=1))
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    assert checker.run_once().discarded == 1
    assert one(pg_dsn, tx_id)["reason"] == "max prepared age (72h) reached with no check made"
    assert endpoint.resolver.asked == []


def test_group_without_endpoint_is_left_alone_and_logged_once(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    tx_id, created = prepare(pg_dsn, "nobody")
    clock = Clock(created + 7 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    before = metric(
        "outbox_checker_checks_not_sent_total", producer_group="other", why="no_endpoint"
    )
    result = checker.run_once()
    assert (result.due, result.checked, result.not_sent) == (1, 0, 1)
    row = one(pg_dsn, tx_id)
    assert (row["state"], row["check_count"]) == ("prepared", 0)
    assert row["next_check_at"] == clock.now + timedelta(minutes=10)  # out of the others' way
    clock.now = row["next_check_at"]
    assert checker.run_once().not_sent == 1
    logged = [r for r in caplog.records if "no endpoint is configured" in r.getMessage()]
    assert len(logged) == 1
    assert "nobody" in logged[0].getMessage()
    after = metric(
        "outbox_checker_checks_not_sent_total", producer_group="other", why="no_endpoint"
    )
    assert after == before + 2


def test_late_commit_after_rollback_changes_nothing(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The application rolls back while the check is in flight, and its endpoint says COMMIT."""
    tx_id, created = prepare(pg_dsn)

    def roll_back_first(request: CheckRequest) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            outbox.rollback(conn, request.tx_id, producer_group=GROUP)

    endpoint.resolver.before_answer = roll_back_first
    endpoint.resolver.default = COMMIT
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    result = checker.run_once()
    assert (result.committed, result.conflicts) == (1, 1)
    assert one(pg_dsn, tx_id)["state"] == "rolled_back"


@pytest.mark.parametrize("answer", [COMMIT, ROLLBACK])
def test_a_late_answer_leaves_a_later_transaction_that_took_the_tx_id_alone(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], answer: Any
) -> None:
    """While the check is in flight the application ends the transaction as the endpoint will
    answer, the relay removes its records, and the application takes the tx id again (README:
    it may). The answer, about the transaction asked about, must not end the later one."""
    tx_id, created = prepare(pg_dsn, tx_id=f"order-{random.getrandbits(64)}")
    later: list[datetime] = []

    def ended_removed_and_taken_again(request: CheckRequest) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            end = outbox.commit if answer is COMMIT else outbox.rollback
            end(conn, request.tx_id, producer_group=GROUP)
            conn.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (request.tx_id,))
        later.append(prepare(pg_dsn, tx_id=request.tx_id)[1])

    endpoint.resolver.before_answer = ended_removed_and_taken_again
    endpoint.resolver.default = answer
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    result = checker.run_once()
    assert (result.checked, result.conflicts) == (1, 0)
    row = one(pg_dsn, tx_id)
    assert (row["state"], row["check_count"]) == ("prepared", 0)  # the later, untouched
    assert row["created_at"] == later[0]


def test_a_late_answer_contradicting_records_the_relay_ended_apart_is_a_conflict(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The application commits while the check is in flight; the relay delivers one record
    (removed: no retention) and parks the other. A late ROLLBACK contradicts that: a conflict,
    not "gone", though the transaction's first record is."""
    tx_id, created = prepare(pg_dsn, records=2)

    def committed_delivered_and_parked(request: CheckRequest) -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            outbox.commit(conn, request.tx_id, producer_group=GROUP)
            first, second = (r.id for r in request.records)
            conn.execute("DELETE FROM outbox.outbox_record WHERE id = %s", (first,))
            conn.execute(
                "UPDATE outbox.outbox_record SET state = 'parked', reason = 'poison' WHERE id = %s",
                (second,),
            )

    endpoint.resolver.before_answer = committed_delivered_and_parked
    endpoint.resolver.default = ROLLBACK
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    result = checker.run_once()
    assert (result.rolled_back, result.conflicts) == (1, 1)
    assert one(pg_dsn, tx_id)["state"] == "parked"


@contextmanager
def _a_round_beside(checker: Checker, holding: list[psycopg.Connection[Any]]) -> Iterator[None]:
    """One checker round on a thread of its own while the application keeps the transactions
    in `holding` open (it must not wait for them); they commit when the block ends."""
    done: list[Any] = []
    worker = threading.Thread(target=lambda: done.append(checker.run_once()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    try:
        assert done, "the checker waited for the application's locks"
        yield
    finally:
        for conn in holding:
            conn.commit()
            conn.close()
        worker.join(timeout=30)


def test_rows_an_application_holds_delay_only_their_own_answer(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The application commits by itself while the check is in flight, and keeps its database
    transaction open: the checker must not wait for it, nor drop the other answers."""
    held, other = prepare(pg_dsn), prepare(pg_dsn)
    holding: list[psycopg.Connection[Any]] = []

    def commit_and_hold(request: CheckRequest) -> None:
        if request.tx_id == held[0] and not holding:
            conn = psycopg.connect(pg_dsn)
            outbox.commit(conn, request.tx_id, producer_group=GROUP)  # not committed yet
            holding.append(conn)

    endpoint.resolver.before_answer = commit_and_hold
    endpoint.resolver.default = COMMIT
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(max(held[1], other[1]) + 7 * S)
    )
    locked = metric("outbox_checker_answers_not_applied_total", producer_group=GROUP, why="locked")
    with _a_round_beside(checker, holding):
        assert one(pg_dsn, other[0])["state"] == "committed"  # applied
        assert one(pg_dsn, held[0])["state"] == "prepared"  # still the application's to end
        after = metric(
            "outbox_checker_answers_not_applied_total", producer_group=GROUP, why="locked"
        )
        assert after == locked + 1  # counted as locked, not as a refused row
    assert one(pg_dsn, held[0])["state"] == "committed"


def its_application_ending_the_first_asked(
    dsn: str, holding: list[psycopg.Connection[Any]]
) -> Callable[[CheckRequest], None]:
    """For the endpoint, before it answers: the application commits the first transaction asked
    about on a connection of its own, not committed yet (its rows held; in `holding`)."""

    def commit_and_hold(request: CheckRequest) -> None:
        if not holding:
            conn = psycopg.connect(dsn)
            outbox.commit(conn, request.tx_id, producer_group=GROUP)  # not committed yet
            holding.append(conn)

    return commit_and_hold


def test_a_check_whose_answer_held_rows_dropped_is_not_said_lost(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The application held the rows (it was ending the transaction), so the answer was
    dropped; then it rolled back instead: the check's lease ran out with nothing recorded, and
    the next round blamed a checker killed or cut from the database, counting a lost check."""
    tx_id, created = prepare(pg_dsn)
    holding: list[psycopg.Connection[Any]] = []
    endpoint.resolver.before_answer = its_application_ending_the_first_asked(pg_dsn, holding)
    endpoint.resolver.default = COMMIT
    clock = Clock(created + 7 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    lost_before = metric("outbox_checker_checks_lost_total", producer_group=GROUP) or 0
    try:
        checker.run_once()  # waits the round's 2 s for the rows, then drops the answer
    finally:
        for conn in holding:
            conn.rollback()  # the application's transaction fails after all
            conn.close()
    assert holding, "the endpoint was not asked"
    assert one(pg_dsn, tx_id)["state"] == "prepared"
    clock.now += LEASE
    caplog.set_level("INFO", logger="checker.service")
    assert checker.run_once().committed == 1  # asked again, and applied
    said = f"tx {tx_id} of producer group {GROUP}: check 1's outcome was not recorded while"
    assert said in caplog.text
    assert "was lost" not in caplog.text
    assert (metric("outbox_checker_checks_lost_total", producer_group=GROUP) or 0) == lost_before
    assert [r.check_count for r in endpoint.resolver.asked] == [1, 1]  # the first not counted


def test_a_tx_id_used_again_after_an_answer_dropped_for_held_rows_has_its_lost_check_said(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The checker remembered the dropped answer by producer group and tx id alone: a later
    transaction given the same tx id, whose first check a killed checker lost, was logged as
    held by its application and not counted lost."""
    tx_id, created = prepare(pg_dsn, tx_id="used-twice")
    holding: list[psycopg.Connection[Any]] = []
    endpoint.resolver.before_answer = its_application_ending_the_first_asked(pg_dsn, holding)
    endpoint.resolver.default = COMMIT
    clock = Clock(created + 7 * S)
    s = settings({GROUP: endpoint_settings(endpoint.url)})
    checker = make_checker(s, clock)
    try:
        checker.run_once()  # the answer dropped for the held rows
    finally:
        for conn in holding:
            conn.rollback()
            conn.close()
    assert holding, "the endpoint was not asked"
    with psycopg.connect(pg_dsn) as conn:  # the application rolls it back, the relay ends it
        outbox.rollback(conn, tx_id, producer_group=GROUP)
        conn.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,))
    again, created_again = prepare(pg_dsn, tx_id=tx_id)
    assert (again, created_again > created) == (tx_id, True)
    clock.now = created_again + 7 * S
    with pytest.raises(SimulatedCrash):  # its first check lost by another checker
        make_checker(s, clock, http=lambda _g, _e: Crashing()).run_once()
    lost_before = metric("outbox_checker_checks_lost_total", producer_group=GROUP) or 0
    clock.now += LEASE
    caplog.set_level("INFO", logger="checker.service")
    assert checker.run_once().committed == 1
    assert f"tx {tx_id} of producer group {GROUP}: check 1 was lost" in caplog.text
    assert "while its application held its rows" not in caplog.text
    assert metric("outbox_checker_checks_lost_total", producer_group=GROUP) == lost_before + 1


def test_a_rounds_answers_wait_for_rows_applications_hold_two_seconds_in_all(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Each answer whose rows an application held waited 2 s of its own, one after the other
    on the round's thread: with many held, answers queued behind them outlived their leases
    and were asked again by another checker."""
    txs = [prepare(pg_dsn) for _ in range(4)]
    holding: list[psycopg.Connection[Any]] = []

    def commit_and_hold(request: CheckRequest) -> None:  # the application ends each itself
        conn = psycopg.connect(pg_dsn)
        outbox.commit(conn, request.tx_id, producer_group=GROUP)  # not committed yet
        holding.append(conn)

    endpoint.resolver.before_answer = commit_and_hold
    endpoint.resolver.default = COMMIT
    due = max(created for _, created in txs) + 7 * S
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), Clock(due))
    began = time.monotonic()
    with _a_round_beside(checker, holding):
        took = time.monotonic() - began
        assert [one(pg_dsn, tx)["state"] for tx, _ in txs] == ["prepared"] * 4  # theirs to end
    assert took < 2 + 3  # the round's 2 s, and room for a loaded machine; was 4 x 2 s
    assert [one(pg_dsn, tx)["state"] for tx, _ in txs] == ["committed"] * 4


def test_a_late_answer_whose_rows_are_held_a_moment_still_waits_for_them(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """The round's 2 s for held rows are time spent waiting, not a deadline: as a deadline from
    the first answer applied on its own, a slow endpoint's answer arriving later found it
    passed, and a row an application held for a moment dropped that answer."""
    (early, _), (late, created) = prepare(pg_dsn), prepare(pg_dsn)
    apps: list[psycopg.Connection[Any]] = []
    releases: list[threading.Timer] = []

    def held_a_moment(tx_id: str, seconds: float) -> None:  # the application's, then released
        conn = psycopg.connect(pg_dsn)
        conn.execute("SELECT 1 FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (tx_id,))
        apps.append(conn)
        releases.append(threading.Timer(seconds, conn.rollback))
        releases[-1].start()

    def before_answer(request: CheckRequest) -> None:
        if request.tx_id == late:
            time.sleep(2.5)  # a slow endpoint's answer, past a deadline of 2 s
        held_a_moment(request.tx_id, 0.3)

    endpoint.resolver.before_answer = before_answer
    endpoint.resolver.default = COMMIT
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    try:
        result = checker.run_once()
    finally:
        for release in releases:
            release.join(5)  # released before its connection closes
        for conn in apps:
            conn.close()
    assert result.outcomes == Counter({"commit": 2})
    assert [one(pg_dsn, tx)["state"] for tx in (early, late)] == ["committed"] * 2  # applied


def _checker_waits_on_a_lock(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
    return bool(row and row[0])


def test_rows_an_application_holds_keep_only_their_own_unknown_answer_unrecorded(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two UNKNOWN answers applied together, one transaction's rows held by its application:
    the reschedules went in one statement, and the held rows made it drop the other's too (its
    check never recorded, asked again uncounted when its lease ran out). The log said "next
    check in" for the answer not recorded as well."""
    caplog.set_level("INFO", logger="checker.service")
    blocker, held, other = prepare(pg_dsn), prepare(pg_dsn), prepare(pg_dsn)
    holding: list[psycopg.Connection[Any]] = []

    def hold(tx_id: str) -> None:  # the application ends it itself, and keeps it open
        conn = psycopg.connect(pg_dsn)
        outbox.commit(conn, tx_id, producer_group=GROUP)
        holding.append(conn)

    def before_answer(request: CheckRequest) -> None:
        if request.tx_id != other[0]:
            hold(request.tx_id)
        if request.tx_id != blocker[0]:
            # answered while the checker waits for the blocker's rows (its COMMIT answer), so
            # that both arrive in one batch of answers
            wait_for(lambda: _checker_waits_on_a_lock(pg_dsn), 4)

    endpoint.resolver.before_answer = before_answer
    endpoint.resolver.answers = {blocker[0]: COMMIT}  # the others: UNKNOWN
    due = max(blocker[1], held[1], other[1]) + 7 * S
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), Clock(due))
    with _a_round_beside(checker, holding):
        recorded = one(pg_dsn, other[0])
        assert (recorded["state"], recorded["check_count"]) == ("prepared", 1)
        assert recorded["check_lease_until"] is None  # its outcome is recorded
        assert one(pg_dsn, held[0])["check_lease_until"] is not None  # not: held
    assert one(pg_dsn, held[0])["state"] == "committed"
    said = {r.args[0]: r.getMessage() for r in caplog.records if r.args and "unknown" in r.args}
    assert "next check in" in said[other[0]]
    assert "unknown (check 1 of 15), not recorded: the transaction was being" in said[held[0]]


def _waits_on_a_lock(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return bool(row and row[0])


def test_an_application_ending_two_answered_transactions_is_not_a_deadlocks_victim(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers applied together hold the rows of those applied first while the next one waits.
    An application ending two of the transactions in one of its own had the first's rows and
    waited for the other's: a deadlock, and the application, which had waited longer, its
    victim (after deadlock_timeout, the batch waiting up to 2 s). The batch now locks all its
    rows first, without waiting, and with any held its answers go again one transaction each."""
    (first, created), (second, _) = prepare(pg_dsn), prepare(pg_dsn)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    application = psycopg.connect(pg_dsn)
    ended_by_application: list[BaseException | None] = []

    def application_ends_both() -> None:
        try:
            outbox.commit(application, first, producer_group=GROUP)  # waits for the batch
            application.commit()
            ended_by_application.append(None)
        except BaseException as exc:
            ended_by_application.append(exc)

    ending = threading.Thread(target=application_ends_both, daemon=True)
    end = checker._end

    def end_then_let_the_application_wait(conn: Any, claim: Any, outcome: Any) -> Any:
        ended = end(conn, claim, outcome)
        if claim.tx_id == first and ending.ident is None:  # the first end, not a later one
            ending.start()
            wait_for(lambda: _waits_on_a_lock(pg_dsn, application.info.backend_pid), 10)
        return ended

    def apply_together(conn: Any, claims: list[Claim], result: CheckRoundResult) -> None:
        by_tx = {c.tx_id: c for c in claims}
        answers = [(by_tx[t], CheckAnswer(Outcome.COMMIT)) for t in (first, second)]
        outbox.commit(application, second, producer_group=GROUP)  # its rows, held
        checker._apply(conn, answers, result)

    monkeypatch.setattr(checker, "_end", end_then_let_the_application_wait)
    monkeypatch.setattr(checker, "_ask_and_apply", apply_together)
    try:
        result = checker.run_once()
        ending.join(timeout=30)
    finally:
        application.close()
    assert ended_by_application == [None]  # not DeadlockDetected
    assert result.committed == 2
    assert {one(pg_dsn, t)["state"] for t in (first, second)} == {"committed"}


def test_a_large_transaction_is_checked_under_a_databases_statement_timeout(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim counted a transaction's records once for each of its records (20k records:
    400M rows read, 133 s here, the relays' xid horizon held back meanwhile), and a database's
    statement_timeout cancelled it every round. The claim and the apply now run without it, as
    the relay's claims do."""
    big, created = prepare(pg_dsn, records=20_000)
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        database = admin.info.dbname
        admin.execute(f"ALTER DATABASE {database} SET statement_timeout = '1s'")
    timeouts: list[tuple[str, str]] = []

    def noting_the_timeout(step: Callable[..., Any]) -> Callable[..., Any]:
        def run(conn: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
            row = conn.execute("SHOW statement_timeout").fetchone()
            timeouts.append((step.__name__, row[0] if row else ""))
            return step(conn, *args, **kwargs)

        return run

    monkeypatch.setattr(_claim, "lock_due", noting_the_timeout(_claim.lock_due))
    monkeypatch.setattr(_claim, "reschedule", noting_the_timeout(_claim.reschedule))
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    checker.run_once()  # the endpoint answers UNKNOWN
    checked = one(pg_dsn, big)
    assert (checked["check_count"], checked["check_lease_until"]) == (1, None)
    assert timeouts == [("lock_due", "0"), ("reschedule", "0")]


def test_a_transaction_too_large_to_describe_whole_is_asked_about_with_its_first_records(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Ten records with 100 kB keys made a 1.3 MB request, over the endpoint's 1 MiB limit:
    every check was refused (413), and the transaction was discarded at max checks although
    the application would have said COMMIT."""
    endpoint.resolver.default = COMMIT
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        written = outbox.prepare_many(
            conn,
            [Record("orders.paid", {"n": i}, key=f"{i}" * 100_000) for i in range(10)],
            producer_group=GROUP,
        )
    tx_id = written.tx_id
    created = one(pg_dsn, tx_id)["created_at"]
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + 7 * S)
    )
    result = checker.run_once()
    assert result.outcomes == Counter({"commit": 1})
    assert {r["state"] for r in rows(pg_dsn, tx_id)} == {"committed"}
    (asked,) = endpoint.resolver.asked
    assert asked.record_count == 10
    assert [r.key for r in asked.records] == [b"0" * 100_000]  # the first, by id, alone fits
    assert len(asked.model_dump_json()) <= CheckerSettings().request_max_bytes


def test_partly_prepared_transaction_is_moved_out_of_the_way(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Published and prepared under one tx id (written by hand: the library refuses the mix):
    never checked, and never blocks the others."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        written = outbox.publish_many(
            conn,
            [Record("orders.paid", 1), Record("orders.paid", 2)],
            tx_id="mixed-1",
            producer_group=GROUP,
        )
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'prepared', committed_xid = NULL "
            "WHERE id = %s",
            (written.ids[1],),
        )
    normal, created = prepare(pg_dsn)
    endpoint.resolver.default = COMMIT
    clock = Clock(created + 7 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}, batch_size=1), clock)
    first = checker.run_once()  # the mixed one is older: it comes first
    assert (first.due, first.checked, first.not_sent) == (1, 0, 1)
    assert checker.run_once().committed == 1
    assert [r.tx_id for r in endpoint.resolver.asked] == [normal]
    states = sorted((r["state"], r["check_count"]) for r in rows(pg_dsn, "mixed-1"))
    assert states == [("committed", 0), ("prepared", 0)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        resolve(conn, GROUP, "mixed-1", ROLLBACK, actor="erin", reason="half of it never happened")
    states = sorted(r["state"] for r in rows(pg_dsn, "mixed-1"))
    assert states == ["committed", "rolled_back"]


def test_informational_responses_before_the_answer_are_skipped(
    raw_servers: Callable[..., RawServer],
) -> None:
    """103 Early Hints (and any 1xx) come before the final answer on the same connection: the
    answer is the one after them, and the next check on the kept-alive connection reads its own."""
    answers = iter([COMMIT, ROLLBACK])
    server = raw_servers(
        lambda h, b: signed_answer(h, b, next(answers)),
        interim=b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 102 Processing\r\n\r\n",
    )
    client = HttpCheckClient(EndpointSettings.model_validate(endpoint_settings(server.url)))
    try:
        outcomes = [
            client.check(
                CheckRequest(
                    producer_group=GROUP,
                    tx_id=f"tx-{n}",
                    check_count=1,
                    first_prepared_at=datetime.now(UTC),
                    records=[],
                )
            ).outcome
            for n in (1, 2)
        ]
    finally:
        client.close()
    assert outcomes == ["commit", "rollback"]
    assert server.requests == 2


def test_total_timeout_holds_against_a_server_dripping_bytes(
    raw_servers: Callable[..., RawServer],
) -> None:
    """Every read gets a byte in time, so only the watchdog's total deadline can end it."""
    stop = threading.Event()

    class Dripping(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.05):  # the server's slowness, not a synchronisation
                self.wfile.write(b"x-drip: y\r\n")
                self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Dripping)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/outbox/check"
    client = HttpCheckClient(
        EndpointSettings.model_validate(
            endpoint_settings(url, timeout="PT0.5S", connect_timeout="PT0.5S")
        )
    )
    request = CheckRequest(
        producer_group=GROUP,
        tx_id="tx-1",
        check_count=1,
        first_prepared_at=datetime.now(UTC),
        records=[],
    )
    try:
        started = time.monotonic()
        answer = client.check(request)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        client.close()
        httpd.shutdown()
        httpd.server_close()
    assert answer.outcome == "timeout"
    assert 0.5 <= elapsed < 5.0  # the total timeout (0.5 s) ended it; the drip never ends


def _a_request() -> CheckRequest:
    return CheckRequest(
        producer_group=GROUP,
        tx_id="tx-1",
        check_count=1,
        first_prepared_at=datetime.now(UTC),
        records=[],
    )


def test_a_name_lookup_that_hangs_is_given_up_at_the_connect_timeout(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The system resolver, its nameserver gone, takes tens of seconds, and the connect timeout
    did not cover it: the check's worker (and the round, which waits for every answer) waited
    for as long. There is no nameserver here to lose: the lookup of this name never returns."""
    looked_up = socket.getaddrinfo
    release = threading.Event()
    asked: list[str] = []

    def nameserver_gone(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "checks.example" and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            asked.append(host)
            release.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return looked_up(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", nameserver_gone)
    port = int(endpoint.url.split(":")[2].split("/")[0])
    unresolved, resolved = (
        HttpCheckClient(
            EndpointSettings.model_validate(
                endpoint_settings(
                    f"http://{host}:{port}/outbox/check", timeout="PT5S", connect_timeout="PT0.5S"
                )
            )
        )
        for host in ("checks.example", "localhost")
    )
    endpoint.resolver.default = COMMIT
    try:
        started = time.monotonic()
        answer = unresolved.check(_a_request())
        elapsed = time.monotonic() - started
        assert resolved.check(_a_request()).outcome == "commit"  # a name looked up, as before
        assert unresolved.check(_a_request()).outcome == "connect_error"
        assert asked == ["checks.example"]  # the second check waited for the same lookup
    finally:
        release.set()
        unresolved.close()
        resolved.close()
    assert (answer.outcome, answer.detail) == (
        "connect_error",
        "connect timed out (0.5s: name lookup of checks.example unanswered)",
    )
    assert elapsed < 5.0  # within the connect timeout, not the lookup's 30 s


def test_an_address_dropping_connections_leaves_the_next_one_time_to_connect(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name's first address dropping connections (an IPv6 route gone, say) took the whole
    connect timeout, and the endpoint, up on the next address, was never reached. Here the
    first address is a socket whose one place in its queue is taken: it drops the rest."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    filler = socket.create_connection(full.getsockname())
    port = int(endpoint.url.split(":")[2].split("/")[0])
    looked_up = socket.getaddrinfo

    def two_addresses(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "checks.example" and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            tcp = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
            return [(*tcp, full.getsockname()), (*tcp, ("127.0.0.1", port))]
        return looked_up(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    url = f"http://checks.example:{port}/outbox/check"
    client = HttpCheckClient(
        EndpointSettings.model_validate(
            endpoint_settings(url, timeout="PT5S", connect_timeout="PT1S")
        )
    )
    endpoint.resolver.default = COMMIT
    try:
        answer = client.check(_a_request())
    finally:
        client.close()
        filler.close()
        full.close()
    assert (answer.outcome, answer.detail) == ("commit", "")


# --- several checkers, crashes, dead endpoints -----------------------------------------------


def test_three_checkers_ask_about_each_transaction_once_per_interval(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    tx_ids = []
    for _ in range(40):
        tx_id, created = prepare(pg_dsn, records=2)
        tx_ids.append(tx_id)
    clock = Clock(created + 7 * S)
    s = settings({GROUP: endpoint_settings(endpoint.url, concurrency=8)}, batch_size=15)
    checkers = [make_checker(s, clock) for _ in range(3)]

    def rounds_together() -> list[CheckRoundResult]:
        barrier = threading.Barrier(3)
        results: list[CheckRoundResult | None] = [None] * 3
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                barrier.wait(10)
                results[i] = checkers[i].run_once()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return [r for r in results if r is not None]

    for interval in (1, 2):
        checked = 0
        for _ in range(10):  # until every due transaction has been asked about
            results = rounds_together()
            checked += sum(r.checked for r in results)
            if all(r.due == 0 for r in results):
                break
        counts = Counter(r.tx_id for r in endpoint.resolver.asked)
        assert counts == Counter({tx: interval for tx in tx_ids}), counts.most_common(3)
        assert checked == len(tx_ids)
        clock.now += 30 * S * interval  # the backoff after check 1, then after check 2


class SimulatedCrash(BaseException):
    """What a kill -9 looks like to the round: nothing after the claim happens."""


class Flaky:
    """A resolver that fails (HTTP 500) until `failing` is set False, then answers COMMIT."""

    def __init__(self) -> None:
        self.failing = True

    def __call__(self, request: CheckRequest) -> TransactionStatus:
        if self.failing:
            raise RuntimeError("down")
        return COMMIT


class Crashing:
    """A check client whose checker dies as it sends (SimulatedCrash)."""

    def check(self, request: CheckRequest) -> Any:
        raise SimulatedCrash

    def close(self) -> None:
        pass


class Broken:
    """A check client with a bug: every check raises."""

    def check(self, request: CheckRequest) -> Any:
        raise RuntimeError("a bug in the client")

    def close(self) -> None:
        pass


def test_a_check_that_fails_unexpectedly_logs_the_endpoint_with_its_query_masked(
    pg_dsn: str, make_checker: Callable[..., Checker], caplog: pytest.LogCaptureFixture
) -> None:
    # The query often holds an API key (?code=...); `outboxctl config` masks it, so must the log.
    tx_id, created = prepare(pg_dsn, records=1)
    url = "https://checks.example/outbox?code=the-functions-key&region=eu"
    s = settings({GROUP: endpoint_settings(url)})
    checker = make_checker(s, Clock(created + 7 * S), http=lambda _g, _e: Broken())
    with caplog.at_level(logging.ERROR, logger="checker"):
        assert checker.run_once().outcomes == Counter({"internal_error": 1})
    logged = [r.getMessage() for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(logged) == 1
    assert tx_id in logged[0]
    assert "https://checks.example/outbox?code=**********&region=**********" in logged[0]
    assert "the-functions-key" not in caplog.text


def test_checker_killed_mid_check_leaves_the_transaction_due_after_the_lease(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = COMMIT
    tx_id, created = prepare(pg_dsn, records=2)
    clock = Clock(created + 7 * S)
    s = settings({GROUP: endpoint_settings(endpoint.url)})

    doomed = make_checker(s, clock, http=lambda _g, _e: Crashing())
    with pytest.raises(SimulatedCrash):
        doomed.run_once()
    row = one(pg_dsn, tx_id)
    assert (row["state"], row["check_count"], row["next_check_at"]) == (
        "prepared",
        1,
        clock.now + LEASE,
    )
    claimed_at = clock.now
    survivor = make_checker(s, clock)
    clock.now = claimed_at + LEASE - timedelta(microseconds=1)
    assert survivor.run_once().due == 0  # still leased: nobody asks meanwhile
    assert endpoint.resolver.asked == []
    clock.now = claimed_at + LEASE
    assert survivor.run_once().committed == 1
    assert [r.check_count for r in endpoint.resolver.asked] == [1]  # the lost check: not counted
    assert one(pg_dsn, tx_id)["state"] == "committed"


def test_a_lost_last_check_is_asked_again_not_discarded(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checker killed during the last check it may make: the check was never answered, so the
    transaction is asked about again when the lease ends, not discarded for max checks."""
    endpoint.resolver.default = COMMIT
    tx_id, created = prepare(pg_dsn, records=2)
    clock = Clock(created + 7 * S)
    s = settings({GROUP: endpoint_settings(endpoint.url)}, max_checks=1)

    lost_before = metric("outbox_checker_checks_lost_total", producer_group=GROUP) or 0
    with pytest.raises(SimulatedCrash):
        make_checker(s, clock, http=lambda _g, _e: Crashing()).run_once()
    assert one(pg_dsn, tx_id)["check_count"] == 1  # counted when claimed, as RocketMQ does
    clock.now += LEASE
    caplog.set_level("WARNING", logger="checker.service")
    result = make_checker(s, clock).run_once()
    assert (result.discarded, result.committed) == (0, 1)
    assert [r.check_count for r in endpoint.resolver.asked] == [1]
    assert {r["state"] for r in rows(pg_dsn, tx_id)} == {"committed"}
    assert f"tx {tx_id} of producer group {GROUP}: check 1 was lost" in caplog.text
    assert metric("outbox_checker_checks_lost_total", producer_group=GROUP) == lost_before + 1


def test_a_check_whose_outcome_was_recorded_counts_after_its_lease(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Only a lease that ran out with no outcome gives a check back: an UNKNOWN recorded in time
    counts, however long after it the next check comes."""
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created + 7 * S)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}, max_checks=1), clock)
    assert checker.run_once().unknown == 1
    clock.now += 3 * LEASE
    result = checker.run_once()
    assert (result.discarded, result.checked) == (1, 0)
    assert endpoint.resolver.count(tx_id) == 1


def test_late_answer_after_the_lease_does_not_undo_a_newer_claim(
    pg_dsn: str, make_checker: Callable[..., Checker]
) -> None:
    """Checker A's request outlives its lease; B claims again; A's late UNKNOWN changes nothing."""
    entered, release = threading.Event(), threading.Event()

    def slow_first(request: CheckRequest) -> TransactionStatus:
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return UNKNOWN

    with serve(CheckHandler(slow_first, [SECRET])) as server:
        tx_id, created = prepare(pg_dsn)
        clock = Clock(created + 7 * S)
        claimed_at = clock.now
        s = settings({GROUP: endpoint_settings(server.url, timeout="PT60S")})
        a, b = make_checker(s, clock), make_checker(s, clock)
        late: list[CheckRoundResult] = []
        a_round = threading.Thread(target=lambda: late.append(a.run_once()))
        a_round.start()
        try:
            assert entered.wait(30)
            lease = 60 * S + 10 * S  # this endpoint's timeout + lease margin
            clock.now = claimed_at + lease
            assert b.run_once().unknown == 1  # asked again, by B
        finally:
            release.set()
        a_round.join(60)
    assert late[0].unknown == 1  # A got its answer, too late to matter
    row = one(pg_dsn, tx_id)
    # A's check, unrecorded when its lease ran out, was given back: B's is check 1 again
    assert row["check_count"] == 1
    assert row["next_check_at"] == claimed_at + lease + 30 * S  # B's backoff after check 1
    assert row["check_lease_until"] is None


def test_dead_endpoint_does_not_starve_a_healthy_one_in_the_same_round(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = COMMIT
    entered, release = threading.Event(), threading.Event()

    def stuck(_request: CheckRequest) -> TransactionStatus:
        entered.set()
        release.wait(60)
        return UNKNOWN

    with serve(CheckHandler(stuck, [SECRET])) as dead:
        try:
            dead_txs = [prepare(pg_dsn, "dead")[0] for _ in range(3)]
            healthy_txs = []
            for _ in range(5):
                tx_id, created = prepare(pg_dsn)
                healthy_txs.append(tx_id)
            s = settings(
                {
                    "dead": endpoint_settings(dead.url, concurrency=1, timeout="PT60S"),
                    GROUP: endpoint_settings(endpoint.url, concurrency=2),
                },
                # the dead group's transactions come first in the round
            )
            checker = make_checker(s, Clock(created + 7 * S))
            outcome: list[CheckRoundResult] = []
            with psycopg.connect(pg_dsn, autocommit=True) as listen:
                listen.execute("LISTEN outbox_wakeup")
                round_thread = threading.Thread(target=lambda: outcome.append(checker.run_once()))
                round_thread.start()
                # commits NOTIFY the relay: look at the states whenever one is announced
                for _ in listen.notifies(timeout=30):
                    if all(one(pg_dsn, tx)["state"] == "committed" for tx in healthy_txs):
                        break
            # every healthy transaction is committed while the dead endpoint still holds the round
            assert all(one(pg_dsn, tx)["state"] == "committed" for tx in healthy_txs)
            assert entered.wait(30)
            assert round_thread.is_alive()
            assert all(one(pg_dsn, tx)["state"] == "committed" for tx in healthy_txs)
        finally:
            release.set()
        round_thread.join(60)
    [result] = outcome
    assert result.committed == len(healthy_txs)
    assert all(one(pg_dsn, tx)["state"] == "prepared" for tx in dead_txs)


def tripping_in_two(url: str) -> CheckerSettings:
    """One request at a time to `url`, its circuit opened by two failures for a minute."""
    return settings(
        {GROUP: endpoint_settings(url, concurrency=1)},
        circuit_failure_threshold=2,
        circuit_cooldown="PT60S",
    )


def test_open_circuit_reschedules_without_asking_or_counting_then_probes(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    flaky = Flaky()
    with serve(CheckHandler(flaky, [SECRET])) as server:
        txs = []
        for _ in range(3):
            tx_id, created = prepare(pg_dsn)
            txs.append(tx_id)
        clock = Clock(created + 7 * S)
        s = tripping_in_two(server.url)
        checker = make_checker(s, clock)
        t0 = clock.now
        first = checker.run_once()
        assert first.outcomes == Counter({"http_error": 2})
        assert first.not_sent == 1  # the breaker opened before the third went out
        counts = {tx: one(pg_dsn, tx)["check_count"] for tx in txs}
        assert sorted(counts.values()) == [0, 1, 1]  # the third check was given back
        assert metric("outbox_checker_circuit_state", producer_group=GROUP) == 2

        clock.now = t0 + 30 * S  # the two failed ones are due again; the circuit is still open
        second = checker.run_once()
        assert (second.checked, second.not_sent) == (0, 2)
        assert {tx: one(pg_dsn, tx)["check_count"] for tx in txs} == counts
        assert all(one(pg_dsn, tx)["next_check_at"] == t0 + 60 * S for tx in txs)

        flaky.failing = False
        clock.now = t0 + 60 * S  # half-open: one probe
        third = checker.run_once()
        assert third.committed == 1
        assert metric("outbox_checker_circuit_state", producer_group=GROUP) == 0
        assert checker.run_once().committed == 2  # closed again: the rest go out
    assert all(one(pg_dsn, tx)["state"] == "committed" for tx in txs)


def test_groups_differing_by_case_share_their_endpoints_one_probe(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Probes were told apart by the group as written: `orders` and `ORDERS`, one endpoint,
    each had one claimed; the second was refused by the breaker and counted not sent for an
    open circuit (found by a review of the checker)."""
    flaky = Flaky()
    with serve(CheckHandler(flaky, [SECRET])) as server:
        failing = [prepare(pg_dsn)[0] for _ in range(2)]
        tx_lower, _ = prepare(pg_dsn, GROUP)
        tx_upper, created = prepare(pg_dsn, GROUP.upper())
        clock = Clock(created + 7 * S)
        s = tripping_in_two(server.url)
        checker = make_checker(s, clock)
        t0 = clock.now
        assert checker.run_once().outcomes["http_error"] == 2  # opened
        flaky.failing = False
        clock.now = t0 + 60 * S  # half-open: one probe for the endpoint, whichever group
        before = metric("outbox_checker_checks_not_sent_total", producer_group=GROUP,
                        why="circuit_open")  # fmt: skip
        probe = checker.run_once()
        assert (probe.checked, probe.not_sent) == (1, 0)
        after = metric("outbox_checker_checks_not_sent_total", producer_group=GROUP,
                       why="circuit_open")  # fmt: skip
        assert after == before
        assert checker.run_once().committed == 3  # closed again: the rest go out
    assert {one(pg_dsn, tx)["state"] for tx in [*failing, tx_lower, tx_upper]} == {"committed"}


def test_lost_checks_waiting_for_a_half_open_circuits_probe_are_counted_lost_once(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Lost checks of a group whose circuit is half-open wait for its one probe: they were left
    with their lease run out, and the next round logged and counted them lost again."""
    flaky = Flaky()
    with serve(CheckHandler(flaky, [SECRET])) as server:
        txs = [prepare(pg_dsn)[0] for _ in range(3)]
        created = max(one(pg_dsn, tx)["created_at"] for tx in txs)
        t0 = created + 7 * S
        clock = Clock(t0)
        s = settings(
            {GROUP: endpoint_settings(server.url, concurrency=1)},
            circuit_failure_threshold=1,
            circuit_cooldown="PT60S",
        )
        survivor = make_checker(s, clock)
        assert survivor.run_once().checked == 1  # failed: the circuit opens
        flaky.failing = False

        clock.now = t0 + 60 * S  # every one due again: the doomed checker claims all three
        with pytest.raises(SimulatedCrash):
            make_checker(s, clock, http=lambda _g, _e: Crashing()).run_once()
        lost_before = metric("outbox_checker_checks_lost_total", producer_group=GROUP)
        clock.now = t0 + 60 * S + LEASE  # all three lost; the survivor's circuit is half-open
        probe = survivor.run_once()
        assert (probe.committed, probe.checked) == (1, 1)
        assert metric("outbox_checker_checks_lost_total", producer_group=GROUP) == lost_before + 3
        rest = survivor.run_once()  # closed again: the two that waited go out
        assert rest.committed == 2
        assert metric("outbox_checker_checks_lost_total", producer_group=GROUP) == lost_before + 3
    assert all(one(pg_dsn, tx)["state"] == "committed" for tx in txs)


# --- manual tools ----------------------------------------------------------------------------


def _discarded(pg_dsn: str, make_checker: Callable[..., Checker], url: str) -> tuple[str, Clock]:
    tx_id, created = prepare(pg_dsn, records=2)
    clock = Clock(created + timedelta(hours=73))
    make_checker(settings({GROUP: endpoint_settings(url)}), clock).run_once()
    assert one(pg_dsn, tx_id)["state"] == "discarded"
    return tx_id, clock


def test_rearm_puts_a_discarded_transaction_back_and_it_is_checked_again(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = COMMIT
    tx_id, clock = _discarded(pg_dsn, make_checker, endpoint.url)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        result = rearm(conn, GROUP, tx_id, actor="alice", reason="endpoint fixed", now=clock.now)
    assert result.changed
    assert len(result.record_ids) == 2
    row = one(pg_dsn, tx_id)
    assert (row["state"], row["check_count"], row["reason"]) == ("prepared", 0, None)
    assert row["next_check_at"] == clock.now
    entry = audit(pg_dsn, tx_id)[-1]
    assert (entry["actor"], entry["action"]) == ("alice", "rearm")
    assert entry["detail"]["reason"] == "endpoint fixed"
    # who as the database knows them: the actor is only what the command was told
    with psycopg.connect(pg_dsn) as conn:
        assert (entry["db_role"],) == conn.execute("SELECT session_user").fetchone()

    # Discarded at its maximum prepared age (72 h), re-armed: that age counts from the re-arm,
    # as RocketMQ's resumed half message gets a new store time. Before, the same checker
    # discarded it again at once.
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    assert checker.run_once().committed == 1
    assert [r.check_count for r in endpoint.resolver.asked] == [1]


def test_a_re_armed_transaction_is_discarded_again_at_max_age_from_its_re_arm(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    tx_id, clock = _discarded(pg_dsn, make_checker, endpoint.url)  # 73 h old
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rearm(conn, GROUP, tx_id, actor="alice", now=clock.now)
    re_armed = clock.now
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    assert checker.run_once().checked == 1  # UNKNOWN: checked again later
    clock.now = re_armed + timedelta(hours=71)
    checker.run_once()
    assert one(pg_dsn, tx_id)["state"] == "prepared"
    clock.now = re_armed + timedelta(hours=72, seconds=1)
    assert checker.run_once().discarded == 1
    assert one(pg_dsn, tx_id)["reason"] == "max prepared age (72h) reached"


def test_rearm_refuses_what_is_not_discarded_or_already_shipped(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    shipped, _ = _discarded(pg_dsn, make_checker, endpoint.url)
    prepared, _ = prepare(pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(  # what the relay does once the dead-letter copy is out
            "UPDATE outbox.outbox_record SET ended_at = now() WHERE tx_id = %s", (shipped,)
        )
        with pytest.raises(IllegalTransitionError, match="prepared"):
            rearm(conn, GROUP, prepared, actor="alice")
        with pytest.raises(IllegalTransitionError, match="already shipped"):
            rearm(conn, GROUP, shipped, actor="alice")
        with pytest.raises(UnknownTransactionError):
            rearm(conn, GROUP, "no-such-tx", actor="alice")
    assert one(pg_dsn, prepared)["state"] == "prepared"
    assert one(pg_dsn, shipped)["state"] == "discarded"
    assert [a["action"] for a in audit(pg_dsn, shipped)] == ["discard"]


def test_a_discarded_transaction_partly_shipped_is_not_rearmed_or_resolved(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker], relay_factory: Any
) -> None:
    """The relay ships a discarded transaction a batch (and a shard) at a time, and deletes
    what it shipped when no archive is kept: rearm and resolve saw only the rest, and split
    the transaction, half on the dead-letter topic and half delivered."""
    tx_id, _ = _discarded(pg_dsn, make_checker, endpoint.url)
    relay = relay_factory(batch_size=1)
    assert relay.run_once().ended == 1  # one of its two records shipped, and deleted
    assert len(rows(pg_dsn, tx_id)) == 1
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(IllegalTransitionError, match=r"already shipped.*\(1 more\)"):
            rearm(conn, GROUP, tx_id, actor="alice")
        with pytest.raises(IllegalTransitionError, match="already shipped"):
            resolve(conn, GROUP, tx_id, COMMIT, actor="alice", reason="late answer")
    assert one(pg_dsn, tx_id)["state"] == "discarded"
    assert [a["action"] for a in audit(pg_dsn, tx_id)] == ["discard"]
    assert relay.run_once().ended == 1  # the rest follows it to the dead-letter topic
    assert rows(pg_dsn, tx_id) == []
    # all of it shipped and deleted: said so, not "no records", as of a mistyped tx id
    gone = r"was discarded, and its 2 records were shipped to the dead-letter topic"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(IllegalTransitionError, match=gone + ".*nothing is left to rearm"):
            rearm(conn, GROUP, tx_id, actor="alice")
        with pytest.raises(IllegalTransitionError, match=gone + ".*nothing is left to resolve"):
            resolve(conn, GROUP, tx_id, COMMIT, actor="alice", reason="late answer")
    assert [a["action"] for a in audit(pg_dsn, tx_id)] == ["discard"]


def test_a_transaction_resolved_after_its_discard_is_not_said_shipped_to_the_dead_letter_topic(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Resolved by hand after the discard, then delivered: a later command said its records
    were on the dead-letter topic and advised publishing them again, a duplicate."""
    tx_id, _ = _discarded(pg_dsn, make_checker, endpoint.url)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        resolve(conn, GROUP, tx_id, COMMIT, actor="alice", reason="late answer")
        # delivered: the relay deletes the rows (no archive kept)
        conn.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,))
        with pytest.raises(UnknownTransactionError):
            rearm(conn, GROUP, tx_id, actor="alice")
        with pytest.raises(UnknownTransactionError):
            resolve(conn, GROUP, tx_id, COMMIT, actor="alice", reason="again")
    assert [a["action"] for a in audit(pg_dsn, tx_id)] == ["discard", "resolve"]


def test_rearm_and_resolve_refuse_records_another_process_holds(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    tx_id, _ = _discarded(pg_dsn, make_checker, endpoint.url)
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn, autocommit=True) as conn:
        holder.execute(  # another process (a checker claiming them) holds their locks
            "SELECT id FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (tx_id,)
        )
        with pytest.raises(TransactionBusyError):
            rearm(conn, GROUP, tx_id, actor="alice")
        with pytest.raises(TransactionBusyError):
            resolve(conn, GROUP, tx_id, COMMIT, actor="alice", reason="x")
        holder.rollback()
    assert one(pg_dsn, tx_id)["state"] == "discarded"


def test_resolve_by_hand_is_audited(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    discarded, _ = _discarded(pg_dsn, make_checker, endpoint.url)
    prepared, _ = prepare(pg_dsn, records=2)
    with (
        psycopg.connect(pg_dsn, autocommit=True) as listen,
        psycopg.connect(pg_dsn, autocommit=True) as conn,
    ):
        listen.execute("LISTEN outbox_wakeup")
        result = resolve(conn, GROUP, prepared, COMMIT, actor="bob", reason="paid, says the PSP")
        assert len(list(listen.notifies(timeout=10, stop_after=1))) == 1
        assert (result.from_state, result.to_state, result.changed) == (
            "prepared",
            "committed",
            True,
        )
        gone = resolve(conn, GROUP, discarded, "ROLLBACK", actor="bob", reason="never paid")
        assert (gone.from_state, gone.to_state) == ("discarded", "rolled_back")
        again = resolve(conn, GROUP, prepared, COMMIT, actor="bob", reason="twice")
        assert not again.changed
        assert again.audit_id is None
        with pytest.raises(IllegalTransitionError, match="rolled_back"):
            resolve(conn, GROUP, discarded, COMMIT, actor="bob", reason="changed my mind")
        with pytest.raises(ValueError):
            resolve(conn, GROUP, prepared, COMMIT, actor="bob", reason=" ")
    assert [(r["state"], r["committed_xid"] is not None) for r in rows(pg_dsn, prepared)] == [
        ("committed", True)
    ] * 2
    row = one(pg_dsn, discarded)
    assert (row["state"], row["reason"], row["committed_xid"]) == ("rolled_back", None, None)
    entry = audit(pg_dsn, prepared)[-1]
    assert (entry["actor"], entry["action"], entry["producer_group"]) == ("bob", "resolve", GROUP)
    assert entry["detail"]["decision"] == "COMMIT"
    assert entry["detail"]["reason"] == "paid, says the PSP"
    assert entry["detail"]["record_ids"] == [r["id"] for r in rows(pg_dsn, prepared)]
    assert [a["action"] for a in audit(pg_dsn, discarded)] == ["discard", "resolve"]


# --- the service -----------------------------------------------------------------------------


def test_start_stop_and_probes(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    endpoint.resolver.default = COMMIT
    tx_id, _ = prepare(pg_dsn, check_immunity=0)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}, poll_interval="PT0.05S"), utc_now
    )
    with psycopg.connect(pg_dsn, autocommit=True) as listen:
        listen.execute("LISTEN outbox_wakeup")
        checker.start()
        assert len(list(listen.notifies(timeout=30, stop_after=1))) == 1
    assert one(pg_dsn, tx_id)["state"] == "committed"
    assert checker.alive()
    report = checker.ready()
    assert report["ready"]
    assert report["database"]
    assert report["circuits"] == {GROUP: "closed"}
    checker.stop(10)
    checker.stop(10)  # twice is fine
    assert not checker.alive()
    with pytest.raises(RuntimeError):
        checker.run_once()


def test_a_stopping_checker_sends_no_further_check_and_gives_the_rest_back(
    pg_dsn: str, raw_servers: Callable[..., RawServer], make_checker: Callable[..., Checker]
) -> None:
    """A round's requests queued behind a worker went on being sent after SIGTERM, each up to
    its timeout, and the stop overran its grace; those not begun are given back, uncounted."""
    entered, release = threading.Event(), threading.Event()

    def held(headers: dict[str, str], body: bytes) -> Reply:
        entered.set()
        release.wait(20)
        return signed_answer(headers, body, COMMIT)

    server = raw_servers(held)
    first, _ = prepare(pg_dsn, check_immunity=0)
    second, _ = prepare(pg_dsn, check_immunity=0)
    checker = make_checker(
        settings({GROUP: endpoint_settings(server.url, concurrency=1)}, poll_interval="PT0.05S"),
        utc_now,
    )
    checker.start()
    assert entered.wait(30)
    stopping = threading.Thread(target=checker.stop, args=(30,))
    stopping.start()
    wait_for(checker._stop.is_set, 10)
    release.set()  # the check in flight is answered; the one queued behind it must not go out
    stopping.join(40)
    assert not checker.alive()
    assert server.requests == 1
    ended, given_back = sorted([one(pg_dsn, first), one(pg_dsn, second)], key=lambda r: r["state"])
    assert (ended["state"], given_back["state"]) == ("committed", "prepared")
    assert given_back["check_count"] == 0


def test_a_checker_waiting_a_long_poll_interval_is_alive(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Liveness allowed 120 s without a finished round, whatever the poll interval: with one of
    150 s, `outboxctl checker` exited ("the thread died") and /healthz failed while it waited."""
    s = settings(
        {GROUP: endpoint_settings(endpoint.url, timeout="PT20S")},
        poll_interval="PT150S",
        lease_margin="PT10S",
    )
    checker = make_checker(s, utc_now)
    assert checker.stale_after_s() == 120 + 150 + 20 + 10
    checker.start()
    wait_for(lambda: checker._last_round_ok)  # its first round: then it waits 150 s
    checker._last_round_at -= 150  # as if it had been waiting out its poll interval
    assert checker.alive()
    checker._last_round_at -= 150  # and then as long again: stuck
    assert not checker.alive()
    assert not checker.ended_by_itself()  # stuck, not dead: the log must not say it died


def test_a_checker_on_a_schema_migrated_by_another_build_ends_by_itself(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    """Instead of failing every round on a missing column: the process exits, with why."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.schema_migration SET name = 'elsewhere' WHERE version = (SELECT"
            " max(version) FROM outbox.schema_migration)"
        )
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), utc_now)
    checker.start()
    assert checker._thread is not None
    checker._thread.join(30)
    assert checker.ended_by_itself()
    assert not checker.alive()


def test_prepared_age_gauges(
    pg_dsn: str, endpoint: Endpoint, make_checker: Callable[..., Checker]
) -> None:
    _, created = prepare(pg_dsn, records=3)
    prepare(pg_dsn, "nobody", records=2)
    checker = make_checker(
        settings({GROUP: endpoint_settings(endpoint.url)}), Clock(created + timedelta(hours=2))
    )
    checker.run_once()
    assert metric("outbox_checker_prepared_records", older_than="0s") == 5
    assert metric("outbox_checker_prepared_records", older_than="1h") == 5
    assert metric("outbox_checker_prepared_records", older_than="6h") == 0
    assert metric("outbox_checker_oldest_prepared_age_seconds") >= 7200


def test_client_reuses_connections_and_survives_a_closed_one(endpoint: Endpoint) -> None:
    endpoint.resolver.default = COMMIT
    client = HttpCheckClient(EndpointSettings.model_validate(endpoint_settings(endpoint.url)))
    try:
        request = CheckRequest(
            producer_group=GROUP,
            tx_id="tx-1",
            check_count=1,
            first_prepared_at=datetime.now(UTC),
            records=[],
        )
        assert client.check(request).outcome == "commit"
        conn = client._local.conn
        assert client.check(request).outcome == "commit"
        assert client._local.conn is conn  # kept alive
        conn.sock.shutdown(2)  # as if the server had closed it while idle
        assert client.check(request).outcome == "commit"
        assert len(endpoint.resolver.asked) == 3
    finally:
        client.close()


# --- the database in trouble ------------------------------------------------------------------


def test_a_claim_that_discards_waits_for_the_notify_lock_whatever_the_roles_lock_timeout(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    standby_that_never_answers: psycopg.Connection[Any],  # noqa: F811
) -> None:
    """Its commit notifies the relays and so waits for Postgres's notify lock, which the
    applications' notifying commits take one after another. A role's lock_timeout failed it,
    the whole claim with it (its discards, its checks), every round while they were busy. Staged
    with an application's notifying commit that waits for a standby, holding that lock."""
    from tests.integration.test_relay_commit_wait import await_commit_wait, commit_in_background

    admin = standby_that_never_answers
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created + timedelta(hours=72, seconds=1))  # due for its discard
    impatient = make_conninfo(pg_dsn, options="-c lock_timeout=200ms")
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock, impatient)
    app = psycopg.connect(pg_dsn)
    app.execute("SET synchronous_commit = on")
    outbox.publish(app, "orders.paid", {"n": 1})  # notifies the relays at its commit
    app_commit = commit_in_background(app)
    results: list[Any] = []
    round_ = threading.Thread(target=lambda: results.append(checker.run_once()), daemon=True)
    try:
        assert await_commit_wait(admin, app.info.backend_pid, app_commit)
        round_.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> %s"
        )
        wait_for(lambda: admin.execute(waiting, (app.info.backend_pid,)).fetchone() == (1,))
        round_.join(1.0)  # five times the role's lock_timeout
        assert round_.is_alive()  # waiting, not failed
    finally:
        admin.execute("SELECT pg_cancel_backend(%s)", (app.info.backend_pid,))
        app_commit.join(10)
        app.close()
    round_.join(10)
    assert [r.discarded for r in results] == [1]
    assert one(pg_dsn, tx_id)["state"] == "discarded"


def test_a_round_that_fails_on_its_connection_makes_a_new_one(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    granted_roles: GrantedRoles,
) -> None:
    """Only a connection psycopg called broken was replaced: one reconnected after a failover
    to a node still read-only (a proxy's old route) failed every round, healthy, until the
    checker was restarted. Staged with a session that fails every round on its own state: its
    role set to one that may only read."""
    endpoint.resolver.default = COMMIT
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created)
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    checker.run_once()  # nothing due yet: its connection made
    assert checker._conn is not None
    checker._conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(granted_roles.reconciler)))
    clock.now = created + timedelta(minutes=2)
    with pytest.raises(Exception, match="permission denied"):
        checker.run_once()
    assert checker.run_once().committed == 1  # on a new connection
    assert one(pg_dsn, tx_id)["state"] == "committed"


def test_a_discard_is_said_and_counted_only_once_its_claim_commits(
    pg_dsn: str,
    endpoint: Endpoint,
    make_checker: Callable[..., Checker],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Logged and counted inside the claim's transaction: a claim that failed after them (its
    connection lost in a failover) said a transaction was discarded that was still prepared,
    and the next round discarded it and counted it again."""
    tx_id, created = prepare(pg_dsn)
    clock = Clock(created + timedelta(hours=72, seconds=1))
    checker = make_checker(settings({GROUP: endpoint_settings(endpoint.url)}), clock)
    before = metric("outbox_checker_discards_total", producer_group=GROUP, limit="max_age")
    real_claim = _claim.claim

    def cut_off(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(_claim, "claim", cut_off)
    with (
        caplog.at_level(logging.WARNING, logger="checker.service"),
        pytest.raises(psycopg.OperationalError),
    ):
        checker.run_once()
    assert one(pg_dsn, tx_id)["state"] == "prepared"
    assert f"discarded tx {tx_id}" not in caplog.text
    assert metric("outbox_checker_discards_total", producer_group=GROUP, limit="max_age") == before
    monkeypatch.setattr(_claim, "claim", real_claim)
    with caplog.at_level(logging.WARNING, logger="checker.service"):
        assert checker.run_once().discarded == 1
    assert caplog.text.count(f"discarded tx {tx_id}") == 1
    assert metric("outbox_checker_discards_total", producer_group=GROUP, limit="max_age") == (
        before + 1
    )
