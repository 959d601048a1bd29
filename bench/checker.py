"""Checker benchmark (issue: checker): checks per second, and memory independent of backlog.

The endpoint is the real `outbox.checkback.serve(CheckHandler(...))` answering COMMIT, in this
process; everything measured runs in a subprocess of its own, so its RSS is the checker's alone.

1. Throughput, side by side in interleaved rounds over fresh stale prepared transactions:
     http_only  the endpoint round trip alone (sign, POST, verify) on `concurrency` threads:
                the ceiling for the checker against this endpoint
     checker    `Checker.run_once()` rounds until nothing is due: claim (SQL), ask (HTTP),
                apply COMMIT (SQL, NOTIFY)
2. Memory: one subprocess per backlog size (default 10k and 100k stale prepared records, one per
   transaction) works through the backlog (`--work all`) or its first N checks; its peak RSS
   (`ru_maxrss`) and its growth over the RSS before the first round are compared. Goal: the same
   at 100k as at 10k (claims are batches; the age gauges are one aggregate row).
Final line: JSON with the figures and ratios.

    .venv/bin/python -m bench.checker [--rounds 3] [--checks 3000] [--sizes 10000,100000]
                                      [--work all|N] [--concurrency 4] [--batch 200]
"""

from __future__ import annotations

import argparse
import base64
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from bench import _cpu
from bench._args import numbers
from bench._services import scratch_database
from outbox.checkback import CheckHandler, CheckRecord, CheckRequest, TransactionStatus, serve

SECRET = "whsec_" + base64.b64encode(b"bench-checker-secret-32-bytes!!!").decode()
GROUP = "bench"


def seed(dsn: str, n: int) -> None:
    """Exactly `n` stale prepared transactions of one record each, and nothing else."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox.outbox_record, outbox.audit_log")
        conn.execute(
            "INSERT INTO outbox.outbox_record"
            " (producer_group, tx_id, topic, key, value, key_hash, state, created_at)"
            " SELECT %s, 'tx-' || i, 'bench.orders', int4send(i), convert_to(repeat('v', 200),"
            " 'UTF8'), i, 'prepared', now() - interval '1 hour' FROM generate_series(1, %s) i",
            (GROUP, n),
        )
        conn.execute("VACUUM ANALYZE outbox.outbox_record")


def worker_settings(url: str, concurrency: int, batch: int) -> dict[str, Any]:
    return {
        "endpoints": {GROUP: {"url": url, "secrets": [SECRET], "concurrency": concurrency}},
        "batch_size": batch,
        "metrics_interval": "PT0S",  # the age gauges every round: a pass over the whole backlog
    }


# --- the subprocess ------------------------------------------------------------------------


def _peak_rss_kib() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def _http_only(url: str, n: int, concurrency: int) -> dict[str, Any]:
    from checker import EndpointSettings, HttpCheckClient

    client = HttpCheckClient(EndpointSettings.model_validate({"url": url, "secrets": [SECRET]}))
    lock = threading.Lock()
    left = [n]
    outcomes: dict[str, int] = {}

    def run() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
                i = left[0]
            request = CheckRequest(
                producer_group=GROUP,
                tx_id=f"tx-{i}",
                check_count=1,
                first_prepared_at=datetime.now(UTC) - timedelta(hours=1),
                records=[CheckRecord(id=i, topic="bench.orders", key=b"k", headers={})],
            )
            outcome = client.check(request).outcome.value
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    start = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    client.close()
    return {"checks": n, "seconds": seconds, "outcomes": outcomes}


def _checker(dsn: str, url: str, concurrency: int, batch: int, limit: int) -> dict[str, Any]:
    from checker import Checker, CheckerSettings

    settings = CheckerSettings.model_validate(worker_settings(url, concurrency, batch))
    with Checker(settings, dsn) as checker:
        with psycopg.connect(dsn) as conn:  # warm the page cache alike for every size
            conn.execute("SELECT count(*) FROM outbox.outbox_record").fetchone()
        before = _peak_rss_kib()
        checks = rounds = 0
        outcomes: dict[str, int] = {}
        start = time.perf_counter()
        while limit <= 0 or checks < limit:
            result = checker.run_once()
            rounds += 1
            checks += result.checked
            for k, v in result.outcomes.items():
                outcomes[k] = outcomes.get(k, 0) + v
            if result.due == 0:
                break
        seconds = time.perf_counter() - start
    return {
        "checks": checks,
        "rounds": rounds,
        "seconds": seconds,
        "outcomes": outcomes,
        "rss_before_kib": before,
        "peak_rss_kib": _peak_rss_kib(),
    }


def worker(argv: list[str]) -> None:
    mode, dsn, url, concurrency, batch, limit = argv
    if mode == "http_only":
        out = _http_only(url, int(limit), int(concurrency))
    else:
        out = _checker(dsn, url, int(concurrency), int(batch), int(limit))
    print(json.dumps(out))


def run_worker(*args: object) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.checker", "--worker", *map(str, args)],
        check=True,
        text=True,
        capture_output=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- the driver ----------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checks", type=int, default=3000, help="per variant and round")
    parser.add_argument("--sizes", default="10000,100000", help="backlogs for the memory runs")
    parser.add_argument(
        "--work", default="all", help="checks per memory run: all (the whole backlog) or N"
    )
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--batch", type=int, default=200, help="checker batch_size")
    args = parser.parse_args()
    for name in ("rounds", "checks", "concurrency", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    try:
        sizes = numbers(args.sizes, int, "--sizes")
    except ValueError as exc:
        parser.error(str(exc))
    if args.work != "all" and not (args.work.isdecimal() and int(args.work) >= 1):
        parser.error(f"--work must be all or a whole number of at least 1, not {args.work!r}")
    work = 0 if args.work == "all" else int(args.work)  # 0: the whole backlog
    _cpu.warn_if_busy()  # once the arguments are known good

    def commit(_request: CheckRequest) -> TransactionStatus:
        return TransactionStatus.COMMIT

    rates: dict[str, list[float]] = {"http_only": [], "checker": []}
    memory: dict[str, dict[str, Any]] = {}
    with scratch_database() as dsn, serve(CheckHandler(commit, [SECRET])) as endpoint:
        for n in range(args.rounds):
            for variant in rates:
                if variant == "checker":
                    seed(dsn, args.checks)
                out = run_worker(
                    variant, dsn, endpoint.url, args.concurrency, args.batch, args.checks
                )
                assert out["outcomes"] == {"commit": args.checks}, out
                rate = out["checks"] / out["seconds"]
                rates[variant].append(rate)
                print(f"round {n + 1} {variant:9} {rate:8.0f} checks/s", flush=True)
        for size in sizes:
            seed(dsn, size)
            out = run_worker("checker", dsn, endpoint.url, args.concurrency, args.batch, work)
            assert out["outcomes"] == {"commit": out["checks"]}, out
            out["backlog"] = size
            out["rss_growth_kib"] = out["peak_rss_kib"] - out["rss_before_kib"]
            out["checks_per_s"] = round(out["checks"] / out["seconds"])
            memory[str(size)] = out
            print(
                f"backlog {size:>7}: {out['checks']} checks in {out['seconds']:.1f}s "
                f"({out['checks_per_s']}/s), peak RSS {out['peak_rss_kib'] / 1024:.1f} MiB, "
                f"growth {out['rss_growth_kib'] / 1024:.1f} MiB",
                flush=True,
            )

    median = {k: round(statistics.median(v)) for k, v in rates.items()}
    small, large = memory[str(sizes[0])], memory[str(sizes[-1])]
    result = {
        "benchmark": "checker",
        "concurrency": args.concurrency,
        "batch_size": args.batch,
        "median_checks_per_s": median,
        "ratio_checker_vs_http_only": round(median["checker"] / median["http_only"], 3),
        "memory": {
            k: {
                key: v[key]
                for key in (
                    "backlog",
                    "checks",
                    "checks_per_s",
                    "rss_before_kib",
                    "peak_rss_kib",
                    "rss_growth_kib",
                )
            }
            for k, v in memory.items()
        },
        "ratio_peak_rss_large_vs_small": round(large["peak_rss_kib"] / small["peak_rss_kib"], 3),
        "rss_growth_difference_kib": large["rss_growth_kib"] - small["rss_growth_kib"],
        "goal_ratio_peak_rss_large_vs_small": 1.1,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
