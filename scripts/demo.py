"""`make run`: the sidecar end to end on the local stack, with a sample producer and a live view.

1. starts the local Postgres and Kafka (scripts/services.py up), migrates a demo database;
2. starts the sidecar (`outboxctl run`: relay + checker) as a child process, probes on :18080;
3. a sample shop writes orders: each order row and its `orders.created` record in one
   transaction; every fifth order also pays through a "payment service" with a half record
   (send_in_transaction), and some payments answer UNKNOWN so the checker asks the shop's
   check endpoint, which answers from the shop's own table;
4. a read_committed consumer prints a live progress line of what really arrived in Kafka.
Ctrl-C stops everything cleanly: the producer, the sidecar (gracefully), and the local Postgres
and Kafka if this run started them (left running if they ran before, for the tests, say).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox import Record, TransactionStatus, Written
from outbox.checkback import CheckHandler, CheckRequest, generate_secret, serve

ROOT = Path(__file__).resolve().parent.parent
DEMO_DB = "outbox_demo"
TOPICS = ("demo.orders", "demo.payments")
PROBE_PORT = 18080


SERVICES = [sys.executable, str(ROOT / "scripts" / "services.py")]


def services_running() -> bool:
    """Postgres or Kafka runs already (an earlier run's, the tests'): left running after."""
    out = subprocess.run([*SERVICES, "status"], text=True, capture_output=True).stdout
    states = dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)
    return "up" in (states.get("postgres"), states.get("kafka"))


def services() -> dict[str, str]:
    """`services.py up`, its progress shown as it goes (on a fresh machine it installs for
    minutes: a silent wait looked hung); the OUTBOX_ lines it ends with, as a dict. A failure
    is said in a line, after the services' own error, not as a traceback."""
    proc = subprocess.Popen([*SERVICES, "up"], text=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    env: dict[str, str] = {}
    for line in proc.stdout:
        if line.startswith("OUTBOX_"):
            name, value = line.rstrip("\n").split("=", 1)
            env[name] = value
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0:
        raise SystemExit("make run: the local services did not start (their error is above)")
    return env


def demo_database(admin_dsn: str) -> str:
    params = conninfo_to_dict(admin_dsn)
    params["dbname"] = DEMO_DB
    dsn = make_conninfo(**params)  # type: ignore[arg-type]
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        exists = admin.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (DEMO_DB,)
        ).fetchone()
        if exists:
            try:
                outbox.migrate(dsn)
            except outbox.SchemaError as exc:  # migrated by another build; it is only the demo's
                print(f"recreating the demo database {DEMO_DB}: {exc}")
                admin.execute(
                    sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(DEMO_DB))
                )
                exists = None
        if not exists:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DEMO_DB)))
    outbox.migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, total numeric,"
            " paid boolean NOT NULL DEFAULT false, created_at timestamptz DEFAULT now())"
        )
    return dsn


def topics(bootstrap: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = admin.list_topics(timeout=10).topics
    missing = [
        NewTopic(t, num_partitions=3, replication_factor=1) for t in TOPICS if t not in existing
    ]
    for future in admin.create_topics(missing).values() if missing else []:
        future.result(30)


class Shop:
    """The sample application: orders, and payments on another resource."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.outbox = outbox.Outbox(producer_group="demo-shop")
        self.published = 0
        # Orders from here on are this run's: a payment an earlier run left to the checker
        # arrives now, with a new Kafka time, and was counted as if this run had sent it twice.
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM orders").fetchone()
        self.first_order: int = row[0] if row else 1
        self.stop = threading.Event()

    def run(self) -> None:
        rng = random.Random(7)  # noqa: S311 - sample data, not security
        with psycopg.connect(self.dsn) as conn:
            while not self.stop.wait(0.05):
                with conn.transaction():
                    order_id = conn.execute(
                        "INSERT INTO orders (total) VALUES (%s) RETURNING id",
                        (round(rng.uniform(5, 500), 2),),
                    ).fetchone()[0]  # type: ignore[index]
                    self.outbox.publish(conn, "demo.orders", {"order": order_id}, key=str(order_id))
                self.published += 1
                if order_id % 5 == 0:
                    self.pay(conn, order_id, rng)

    def pay(self, conn: psycopg.Connection, order_id: int, rng: random.Random) -> None:
        def payment_service(written: Written) -> TransactionStatus:
            with psycopg.connect(self.dsn) as other:  # "another resource"
                other.execute("UPDATE orders SET paid = true WHERE id = %s", (order_id,))
            # Sometimes the answer is lost: the checker will ask the check endpoint.
            return TransactionStatus.UNKNOWN if rng.random() < 0.3 else TransactionStatus.COMMIT

        record = Record("demo.payments", {"order": order_id, "paid": True}, key=str(order_id))
        self.outbox.send_in_transaction(conn, [record], payment_service, tx_id=f"pay-{order_id}")
        self.published += 1

    def resolve(self, request: CheckRequest) -> TransactionStatus:
        """The check endpoint's resolver: did the payment of this order happen?"""
        order_id = int(request.tx_id.removeprefix("pay-"))
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT paid FROM orders WHERE id = %s", (order_id,)).fetchone()
        if row is None:
            return TransactionStatus.ROLLBACK
        return TransactionStatus.COMMIT if row[0] else TransactionStatus.ROLLBACK


def watch(bootstrap: str, shop: Shop, stop: threading.Event) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-watch-{os.getpid()}",
            # from the start, counting this run's records only: with "latest" the records
            # published while the consumer joins were never counted, and looked lost
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe(list(TOPICS))
    arrived = 0
    latencies: list[float] = []
    started_ms = time.time() * 1000
    half = HalfRecords(shop.dsn)
    try:
        while not stop.is_set():
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                _kind, ts = msg.timestamp()
                if ts < started_ms or _order(msg.value()) < shop.first_order:
                    continue  # an earlier run's
                arrived += 1
                latencies = [*latencies[-199:], time.time() * 1000 - ts]
            p50 = sorted(latencies)[len(latencies) // 2] if latencies else 0.0
            print(
                f"\rpublished {shop.published:6d} | arrived in Kafka {arrived:6d} "
                f"| awaiting check-back {half.count():>4} "
                f"| produce-to-visible p50 {p50:6.1f} ms "
                f"| metrics http://127.0.0.1:{PROBE_PORT}/metrics ",
                end="",
                flush=True,
            )
    except KafkaException as exc:
        print(f"\nconsumer error: {exc}")
    finally:
        consumer.close()
        half.close()


def _order(value: bytes | None) -> int:
    """The order a sample record is about (0: not one of the sample's)."""
    try:
        order = json.loads(value or b"{}").get("order")
    except (ValueError, AttributeError):
        return 0
    return order if isinstance(order, int) else 0


class HalfRecords:
    """How many half records wait for the checker (UNKNOWN answers): the published records
    that have not arrived yet, besides those in flight. Counted once a second."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg.Connection | None = None
        self._last = "?"
        self._at = 0.0

    def count(self) -> str:
        if time.monotonic() - self._at < 1.0:
            return self._last
        self._at = time.monotonic()
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.dsn, autocommit=True)
            row = self._conn.execute(
                "SELECT count(*) FROM outbox.outbox_record WHERE state = 'prepared'"
            ).fetchone()
            self._last = str(row[0]) if row else "?"
        except psycopg.Error:  # the view goes on without it; the next second tries again
            self.close()
            self._last = "?"
        return self._last

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def main() -> int:
    started_here = not services_running()
    try:
        return demo(services())
    finally:
        if started_here:  # as the machine was before: what a run started, it stops
            print("stopping the local Postgres and Kafka this run started")
            subprocess.run([*SERVICES, "down"], stdout=subprocess.DEVNULL)
        else:
            print("the local Postgres and Kafka run on, as before (`scripts/services down`)")


def demo(env: dict[str, str]) -> int:
    dsn = demo_database(env["OUTBOX_TEST_PG_DSN"])
    bootstrap = env["OUTBOX_TEST_KAFKA_BOOTSTRAP"]
    topics(bootstrap)
    shop = Shop(dsn)
    secret = generate_secret()
    endpoint = serve(CheckHandler(shop.resolve, [secret]), host="127.0.0.1", port=0)

    sidecar_env = {
        **os.environ,
        "OUTBOX_DATABASE__DSN": dsn,
        "OUTBOX_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_HTTP__PORT": str(PROBE_PORT),
        "OUTBOX_HTTP__HOST": "127.0.0.1",
        "OUTBOX_LOG_FORMAT": "text",
        "OUTBOX_LOG_LEVEL": "WARNING",
        "OUTBOX_CHECKER": json.dumps(
            {
                "check_immunity": "PT2S",
                "check_interval": "PT2S",
                "endpoints": {"demo-shop": {"url": endpoint.url, "secrets": [secret]}},
            }
        ),
    }
    log = ROOT / ".local" / "demo-sidecar.log"
    print(f"sidecar log: {log}   (Ctrl-C to stop)")
    # A closed terminal or a `kill` stops it all like Ctrl-C: the sidecar is never left behind.
    # SIGINT too: started in the background (`make run &`), it comes ignored, and Python then
    # leaves it so.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.default_int_handler)
    with log.open("ab") as out:
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "run"], env=sidecar_env, stdout=out, stderr=out
        )
    stop = threading.Event()
    threads = [
        threading.Thread(target=shop.run, daemon=True),
        threading.Thread(target=watch, args=(bootstrap, shop, stop), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        while sidecar.poll() is None:
            time.sleep(0.5)
        print(f"\nthe sidecar exited with {sidecar.returncode}: see {log}")
        return 1
    except KeyboardInterrupt:
        print("\nstopping: producer, then the sidecar (graceful), then the consumer")
    finally:
        shop.stop.set()
        if sidecar.poll() is None:
            sidecar.send_signal(signal.SIGTERM)
            try:
                sidecar.wait(60)
            except subprocess.TimeoutExpired:  # never left running behind the demo
                sidecar.kill()
                sidecar.wait()
        stop.set()
        for t in threads:
            t.join(5)
        endpoint.close()
    print(f"sidecar exited with {sidecar.returncode}; published {shop.published} records")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # while the services start: theirs is said above
        sys.exit(130)
