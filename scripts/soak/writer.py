"""A soak writer process: transactions of outbox records whose per-key commit order is known.

    python -m scripts.soak.writer --name w0 --dsn DSN --seconds 600 --rate 60 --seed 1 --log F

A key's sequence number is taken under the key's row lock in `soak_seq`, held to commit, so per
key the sequence order is the commit order: the order a `read_committed` consumer must see. The
ledger `soak_ledger`, written in the same transaction, is the truth of what committed. The log
(JSON lines, one per transaction) is what the writer saw: committed, rolled_back (on purpose),
aborted (failed before COMMIT was sent: never committed), unknown (COMMIT failed: the ledger
decides).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

import psycopg

from outbox import Outbox, Record
from relay.dbconnect import dead_peer_options
from scripts.soak.checks import WriterTx
from scripts.soak.settings import KEYS, PRODUCER_GROUP, ROOT, Settings, topic_of

INSERT_LEDGER = (
    "INSERT INTO soak_ledger (uid, tx_uid, k, seq, topic, outbox_id, writer)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)


def pick_keys(rnd: random.Random) -> list[str]:
    """1-4 records: most of one key, a quarter over 2-3 keys (so over shards, mostly)."""
    r = rnd.random()
    if r < 0.55:
        return [rnd.choice(KEYS)]
    if r < 0.75:
        return [rnd.choice(KEYS)] * rnd.randint(2, 4)
    keys = rnd.sample(KEYS, rnd.randint(2, 3))
    if rnd.random() < 0.5:
        keys.append(keys[0])  # a key twice, around another
    return keys


def write_one(
    conn: psycopg.Connection[Any], outbox: Outbox, rnd: random.Random, name: str, tx: str
) -> tuple[list[str], bool]:
    """One transaction, left open for the caller to end: (its records' uids, roll it back?)."""
    keys = pick_keys(rnd)
    rollback = rnd.random() < 0.10
    if rnd.random() < 0.3:
        # An xid taken before the key locks: a transaction that waits here on a key another
        # one holds commits after it with the smaller xid (design.md, property 4).
        conn.execute("INSERT INTO soak_business (tx_uid) VALUES (%s)", (tx,))
        time.sleep(rnd.uniform(0.002, 0.03))
    conn.execute(
        "SELECT k FROM soak_seq WHERE k = ANY(%s) ORDER BY k FOR UPDATE",  # key order: no deadlock
        (sorted(set(keys)),),
    )
    uids, records, rows = [], [], []
    for i, key in enumerate(keys):
        row = conn.execute(
            "UPDATE soak_seq SET seq = seq + 1 WHERE k = %s RETURNING seq", (key,)
        ).fetchone()
        assert row is not None
        uid = f"{tx}.{i}"
        value = {"uid": uid, "tx": tx, "k": key, "seq": row[0], "rb": rollback}
        value["pad"] = "x" * rnd.randint(0, 200)
        uids.append(uid)
        records.append(Record(topic_of(key), value, key=key, headers={"soak-uid": uid}))
        rows.append((uid, tx, key, row[0], topic_of(key)))
    if rnd.random() < 0.5:  # both ways in: one statement, or a statement per record
        ids = list(outbox.publish_many(conn, records).ids)
    else:
        ids = [
            outbox.publish(conn, r.topic, r.value, key=r.key, headers=r.headers) for r in records
        ]
    with conn.cursor() as cur:
        ledger = [(*row, oid, name) for row, oid in zip(rows, ids, strict=True)]
        cur.executemany(INSERT_LEDGER, ledger)
    if rnd.random() < 0.2:
        time.sleep(rnd.uniform(0.002, 0.02))  # hold the locks a while
    return uids, rollback


def run(name: str, dsn: str, seconds: float, rate: float, seed: int, log: TextIO) -> dict[str, int]:
    """Write at `rate` transactions a second for `seconds` (and at most that many, plus 20 %)."""

    def note(**entry: Any) -> None:
        log.write(json.dumps({"t": round(time.time(), 3), **entry}) + "\n")

    rnd = random.Random(seed)  # noqa: S311 - a seeded load, not security
    outbox = Outbox(producer_group=PRODUCER_GROUP)
    stats = {"committed": 0, "rolled_back": 0, "aborted": 0, "unknown": 0, "records": 0}
    conn: psycopg.Connection[Any] | None = None
    deadline = time.monotonic() + seconds
    next_at = time.monotonic()
    n = 0
    while time.monotonic() < deadline and n < int(seconds * rate * 1.2) + 10:
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at = max(next_at + 1 / rate, time.monotonic() - 1)  # no burst to catch up
        if conn is None:
            try:
                # timeouts: no wait of the writer outlasts a restart of Postgres by much, nor
                # a partition (an application's connections given the README's TCP options)
                tcp: dict[str, Any] = dead_peer_options(dsn, 5)
                conn = psycopg.connect(
                    dsn,
                    connect_timeout=3,
                    options="-c statement_timeout=30s -c lock_timeout=30s",
                    **tcp,
                )
            except psycopg.Error as exc:
                note(event="connect_failed", err=str(exc)[:200])
                time.sleep(0.5)
                continue
        n += 1
        tx = f"{name}-{n}-{uuid.uuid4().hex[:6]}"
        uids: list[str] = []
        phase = "write"
        try:
            uids, rollback = write_one(conn, outbox, rnd, name, tx)
            if rollback:
                phase, status = "rollback", "rolled_back"
                conn.rollback()
            else:
                phase, status = "commit", "committed"
                conn.commit()
        except Exception as exc:  # a database gone mid-transaction: the soak goes on
            # a failed ROLLBACK still never commits; a failed COMMIT may have committed
            status = {"write": "aborted", "rollback": "rolled_back", "commit": "unknown"}[phase]
            note(event="error", tx=tx, phase=phase, err=f"{type(exc).__name__}: {exc}"[:300])
            try:
                conn.rollback()
            except psycopg.Error:  # the connection is gone: a new one next time
                conn.close()
                conn = None
        stats[status] += 1
        stats["records"] += len(uids) if status == "committed" else 0
        note(tx=tx, status=status, uids=uids)
    if conn is not None:
        conn.close()
    note(event="done", transactions=n, **stats)
    return stats


def spawn(
    settings: Settings, name: str, seconds: float, rate: float, seed: int, rundir: Path
) -> subprocess.Popen[bytes]:
    """A writer process; its log is `writer-NAME.jsonl` in the run's directory."""
    args = ["--name", name, "--dsn", settings.dsn, "--seconds", str(seconds), "--rate", str(rate)]
    args += ["--seed", str(seed), "--log", str(rundir / f"writer-{name}.jsonl")]
    with (rundir / f"writer-{name}.out").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "scripts.soak.writer", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the soak alone; it ends them
        )


def read_log(path: Path) -> list[WriterTx]:
    """The transactions of a writer's log (a line cut short by a kill is skipped)."""
    txs = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "status" in entry:
            txs.append(WriterTx(entry["tx"], entry["status"], tuple(entry["uids"])))
    return txs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--rate", type=float, required=True, help="transactions a second")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    with args.log.open("a", buffering=1) as log:  # a line per transaction, as it happens
        stats = run(args.name, args.dsn, args.seconds, args.rate, args.seed, log)
    print(json.dumps({"writer": args.name, **stats}), flush=True)


if __name__ == "__main__":
    main()
