"""Commit-to-visible latency by the number of shards.

Side by side in one run, on the same Postgres and broker, with 1 KiB records: for each rate,
each shard count takes the same paced load (bench/relay.py's latency step: from the commit time
Postgres recorded to the poll of a read_committed consumer), one shard being the baseline. One
relay owns every shard, or `--relays N` relay processes share them (as one sidecar per pod
would; the load starts once they are spread evenly). Transactions hold `--per-tx` records
over 100 keys (1, by default: none spans shards). Figures: p50 and p99 in ms and the rate the
writer reached, for each rate and shard count, and each p50 over the one-shard p50 at that rate
(no goal: a measure). Runs alternate between shard counts, so that a slow spell of the machine
hits them alike. Final line: JSON.

    .venv/bin/python -m bench.latency [--shards 1,2,4] [--rates 300,1000] [--seconds 10]
                                      [--per-tx 1] [--repeat 2] [--relays 1]
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
from collections.abc import Sequence

from bench import _cpu
from bench._args import numbers
from bench._services import scratch_database, service_env, sweep_leftover_topics
from bench.relay import Latency, delete_made_topics, latency


def summary(runs: Sequence[Latency]) -> dict[str, float]:
    """The median of each figure over the runs of one rate and shard count."""
    return {
        "p50_ms": round(statistics.median(r.p50_ms for r in runs), 1),
        "p99_ms": round(statistics.median(r.p99_ms for r in runs), 1),
        "written_per_s": round(statistics.median(r.achieved_per_s for r in runs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2,4", help="shard counts, comma-separated")
    parser.add_argument("--rates", default="300,1000", help="records/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10, help="of paced load, each run")
    parser.add_argument("--per-tx", type=int, default=1, help="records per transaction")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each rate and count")
    parser.add_argument("--relays", type=int, default=1, help="relay processes sharing the shards")
    args = parser.parse_args()
    try:
        shard_counts = numbers(args.shards, int, "--shards")
        rates = numbers(args.rates, float, "--rates")
    except ValueError as exc:
        parser.error(str(exc))
    if 1 not in shard_counts:
        shard_counts.insert(0, 1)  # the baseline
    for name in ("seconds", "per_tx", "repeat", "relays"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be above 0, not {getattr(args, name)}")
    _cpu.warn_if_busy()  # once the arguments are known good
    bootstrap = service_env()["OUTBOX_TEST_KAFKA_BOOTSTRAP"]
    sweep_leftover_topics(bootstrap)
    atexit.register(delete_made_topics, bootstrap)

    results: dict[str, dict[str, dict[str, float]]] = {}
    for rate in rates:
        runs: dict[int, list[Latency]] = {n: [] for n in shard_counts}
        for _ in range(args.repeat):
            for shards in shard_counts:
                with scratch_database() as dsn:
                    run = latency(
                        dsn,
                        bootstrap,
                        rate,
                        args.seconds,
                        args.per_tx,
                        shards=shards,
                        relays=args.relays,
                    )
                runs[shards].append(run)
                counted = f"{shards} shard{'s' * (shards > 1)}"
                print(
                    f"{rate:.0f}/s asked, {counted}: p50 {run.p50_ms:.1f} ms, p99 "
                    f"{run.p99_ms:.1f} ms ({run.achieved_per_s:.0f}/s written)",
                    flush=True,
                )
        by_shards = {str(n): summary(r) for n, r in runs.items()}
        baseline = by_shards["1"]["p50_ms"]
        for figures in by_shards.values():
            figures["p50_vs_one_shard"] = round(figures["p50_ms"] / baseline, 2)
        results[f"{rate:g}"] = by_shards
    print(
        json.dumps(
            {
                "benchmark": "latency",
                "seconds": args.seconds,
                "records_per_tx": args.per_tx,
                "repeat": args.repeat,
                "relays": args.relays,
                "by_rate": results,
            }
        )
    )


if __name__ == "__main__":
    main()
