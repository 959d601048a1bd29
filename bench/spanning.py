"""The relay's drain of small transactions, some of which span shards, by shard count.

A transaction whose records fall in several shards is sent by one of them, and the later
records of its keys in the others wait until it is out (relay/shard.py): with small
transactions and few keys, a shard's round ends at the next such wait. Side by side in one run,
on the same Postgres and broker, with 1 KiB records: for each shard count, the relays drain (a)
a backlog where a share of the transactions span shards and (b) the same backlog's shape with
every transaction inside one shard (the baseline). Transactions hold 1-4 records over 50 keys.
`--relays N` relay processes share the shards, as one sidecar per pod would (one, by default,
owns them all). Once the shards are spread over them they are paused (SIGSTOP) while the
backlog is written, and the rate is timed from their SIGCONT until no row is left. Figures:
records/s of each, and spanning / baseline per shard count (no goal: a measure). Final line:
JSON.

    .venv/bin/python -m bench.spanning [--records 12000] [--shards 1,2,4,6] [--share 0.25]
                                       [--seed 1] [--batch-size N] [--relays 1]
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import psycopg

from bench import _cpu
from bench._args import numbers
from bench._services import ROOT, scratch_database, service_env, sweep_leftover_topics
from bench.relay import (
    BATCH,
    VALUE,
    create_topic,
    delete_made_topics,
    recovered_shards,
    relay_env,
    undelivered,
)
from relay.sharding import shard_of

KEYS = [f"k{i}" for i in range(50)]


def key_shards(dsn: str, shards: int) -> dict[str, int]:
    """Each key's shard, by the key hash filler() writes (not publish()'s, which hashes the
    key's bytes, as bench/relay.py's fill does: any hash spreads the keys alike)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT k, hashtextextended(k, 0) FROM unnest(%s::text[]) AS k", (KEYS,)
        ).fetchall()
    return {key: shard_of(key_hash, shards) for key, key_hash in rows}


def transactions(
    shard_of_key: dict[str, int], count: int, share: float, seed: int
) -> list[list[str]]:
    """Keys of transactions of 1-4 records, `count` records in all. A `share` of those with
    two records or more span shards (when there are several); the others keep to one shard."""
    rng = random.Random(seed)
    by_shard: dict[int, list[str]] = defaultdict(list)
    for key, shard in shard_of_key.items():
        by_shard[shard].append(key)
    made: list[list[str]] = []
    total = 0
    while total < count:
        size = min(rng.randint(1, 4), count - total)
        if size > 1 and len(by_shard) > 1 and rng.random() < share:
            first, second = rng.sample(sorted(by_shard), 2)
            keys = [rng.choice(by_shard[first]), rng.choice(by_shard[second])]
            keys += [rng.choice(KEYS) for _ in range(size - 2)]
        else:
            home = by_shard[rng.choice(sorted(by_shard))]
            keys = [rng.choice(home) for _ in range(size)]
        made.append(keys)
        total += size
    return made


def spans(shard_of_key: dict[str, int], keys: list[str]) -> bool:
    return len({shard_of_key[k] for k in keys}) > 1


def filler(txs: list[list[str]]) -> Callable[[str, str, int], None]:
    """A drain's `fill`: each transaction one INSERT, committed on its own, pipelined."""

    def fill(dsn: str, topic: str, count: int) -> None:
        assert sum(map(len, txs)) == count
        with psycopg.connect(dsn, autocommit=True) as conn, conn.pipeline() as pipeline:
            for n, keys in enumerate(txs):
                conn.execute(
                    """
                    INSERT INTO outbox.outbox_record (producer_group, tx_id, topic, key, value,
                                                      key_hash, state, committed_xid)
                    SELECT 'bench', 'span-' || %(n)s, %(topic)s, convert_to(k, 'UTF8'),
                           %(value)s, hashtextextended(k, 0), 'committed', pg_current_xact_id()
                    FROM unnest(%(keys)s::text[]) WITH ORDINALITY AS t(k, i) ORDER BY i
                    """,
                    {"n": n, "topic": topic, "value": VALUE, "keys": keys},
                )
                pipeline.sync()

    return fill


def drain_shared(
    dsn: str, bootstrap: str, txs: list[list[str]], shards: int, relays: int, batch: int
) -> float:
    """records/s of `relays` relay processes sharing the shards (see the module's docstring)."""
    topic = create_topic(bootstrap)
    env = relay_env(dsn, bootstrap, batch, shards=shards)
    settings = json.loads(env["OUTBOX_RELAY"])
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "relay"],
            env={**env, "OUTBOX_RELAY": json.dumps({**settings, "relay_id": f"bench-{i}"})},
            cwd=ROOT,
        )
        for i in range(relays)
    ]
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:

            def wait(until: Callable[[], bool], what: str) -> None:
                deadline = time.monotonic() + 120
                while not until():
                    if any(p.poll() is not None for p in procs):
                        raise RuntimeError("a relay exited")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{what} not in 120 s")
                    time.sleep(0.05)

            def spread() -> bool:
                held = conn.execute(
                    "SELECT count(DISTINCT owner), count(owner) FROM outbox.shard_lease "
                    "WHERE lease_until > now()"
                ).fetchone()
                # and recovered: a relay stopped in its recovery's init_transactions timed it out
                # at the go, and recovered again inside the timing (bench.relay.drain)
                return held == (min(relays, shards), shards) and (
                    recovered_shards(conn, settings["op_marker_topic"]) == shards
                )

            wait(spread, "the shards spread over the relays")  # a heartbeat or two
            for p in procs:
                p.send_signal(signal.SIGSTOP)
            try:  # well within a lease: the fill takes about a second
                filler(txs)(dsn, topic, sum(map(len, txs)))
            finally:
                started = time.monotonic()
                for p in procs:
                    p.send_signal(signal.SIGCONT)
            wait(lambda: not undelivered(conn), "the drain")
            return sum(map(len, txs)) / (time.monotonic() - started)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=12_000)
    parser.add_argument("--shards", default="1,2,4,6", help="shard counts, comma-separated")
    parser.add_argument(
        "--share", type=float, default=0.25, help="of transactions of 2+ records, those spanning"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=BATCH, help="the relay's batch_size")
    parser.add_argument("--relays", type=int, default=1, help="relay processes sharing the shards")
    args = parser.parse_args()
    try:
        counts = numbers(args.shards, int, "--shards")
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= args.share <= 1:
        parser.error(f"--share must be between 0 and 1, not {args.share}")
    if args.records < 1:
        parser.error(f"--records must be at least 1, not {args.records}")
    if args.relays < 1:
        parser.error(f"--relays must be at least 1, not {args.relays}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, not {args.batch_size}")
    _cpu.warn_if_busy()  # once the arguments are known good
    bootstrap = service_env()["OUTBOX_TEST_KAFKA_BOOTSTRAP"]
    sweep_leftover_topics(bootstrap)
    atexit.register(delete_made_topics, bootstrap)

    results = {}
    for shards in counts:
        rates = {}
        for label, share in (("spanning", args.share), ("baseline", 0.0)):
            with scratch_database() as dsn:
                shard_of_key = key_shards(dsn, shards)
                txs = transactions(shard_of_key, args.records, share, args.seed)
                spanning = sum(spans(shard_of_key, keys) for keys in txs)
                rate = drain_shared(dsn, bootstrap, txs, shards, args.relays, args.batch_size)
            rates[label] = rate
            print(
                f"{shards} shards, {label}: {rate:8.0f}/s ({len(txs)} transactions, "
                f"{spanning} spanning shards)",
                flush=True,
            )
        results[shards] = {
            "spanning_per_s": round(rates["spanning"]),
            "baseline_per_s": round(rates["baseline"]),
            "ratio": round(rates["spanning"] / rates["baseline"], 3),
        }
    print(
        json.dumps(
            {
                "benchmark": "spanning",
                "records": args.records,
                "share_spanning": args.share,
                "batch_size": args.batch_size,
                "relays": args.relays,
                "by_shards": results,
            }
        )
    )


if __name__ == "__main__":
    main()
