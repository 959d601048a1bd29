"""Chaos soak of the relay: writers commit records while relays are killed, paused and
restarted and the broker and Postgres restart and crash; then the topics are read with
`read_committed` and checked against what committed (scripts/soak/checks.py).

    python -m scripts.soak [--minutes 10] [--seed N] [--writers 2] [--rate 60] [--harsh]
                           [--keep-stack]

The soak runs its own stack (Postgres 127.0.0.1:56432, Kafka 127.0.0.1:60092, controller 60093,
data under .local/soak), started with `scripts/services.py up` and stopped at the end unless
--keep-stack; the developer's stack is never touched. Its database and topics are made anew each
run. The run writes for --minutes with chaos in all but the last 30 s, then drains the outbox
with two relays, stops them with SIGTERM, reads and checks. The run's directory
.local/soak/runs/<time>/ keeps chaos.log, relay-*.log, writer-*.jsonl and findings.json. A
seed repeats the writers' transactions and the chaos' choices, not their timing: a rerun is alike,
not the same.

The last line printed is the summary, as JSON. Exit code: 0 clean, 1 any violation, 2 the soak
itself failed, 130 interrupted. A kept stack stops with:
    OUTBOX_LOCAL_DIR=.local/soak OUTBOX_PG_PORT=56432 OUTBOX_KAFKA_PORT=60092 \\
        OUTBOX_KAFKA_CONTROLLER_PORT=60093 scripts/services down
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import psycopg

from scripts.soak import checks, database, stack, topics, writer
from scripts.soak.chaos import HARSH, PLAN, Chaos
from scripts.soak.settings import Settings

QUIET_S = 30  # no chaos at the end of the load: the stack is up when the drain begins
MAX_EVENTS = 150  # a bound, not a goal: 10 minutes of --harsh gaps make ~50
DRAIN_RELAYS = 2
DRAIN_TIMEOUT_S = 600
WRITER_OVERRUN_S = 120  # past the load, a writer that has not ended is stopped


class RunLog:
    """chaos.log, and the same lines on stdout."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def __call__(self, msg: str) -> None:
        line = f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {msg}"
        self.file.write(line + "\n")
        print(line, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=10, help="of load (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument("--writers", type=int, default=2, help="writer processes (default 2)")
    parser.add_argument("--rate", type=float, default=60, help="transactions/s per writer")
    parser.add_argument(
        "--harsh", action="store_true", help="blackouts, more broker kills and Postgres crashes"
    )
    parser.add_argument("--keep-stack", action="store_true", help="leave the stack running")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.writers < 1 or args.rate <= 0:
        parser.error("--minutes, --writers and --rate must be positive")
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    return args


def drain(chaos: Chaos, settings: Settings, log: Callable[[str], None]) -> bool:
    """Wait until no row is left to deliver, a relay kept running; False after the timeout."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        chaos.reap()
        chaos.keep_one()
        try:
            states = database.outbox_states(settings)
        except psycopg.Error as exc:
            log(f"drain: outbox not readable: {exc}")
        else:
            if not states.get("committed") and not states.get("prepared"):
                return True
        time.sleep(2)
    return False


def observe(settings: Settings, rundir: Path) -> checks.Observed:
    """What the run left behind, read from the database, the writers' logs and the topics."""
    read = topics.read(settings)
    return checks.Observed(
        ledger=database.ledger(settings),
        writer_txs=[t for p in sorted(rundir.glob("writer-*.jsonl")) for t in writer.read_log(p)],
        delivered=read.delivered,
        markers=read.markers,
        outbox_name=settings.outbox_name,
        rows_left=database.outbox_states(settings),
        dead_letters=read.dead_letters,
        unread=read.unread,
    )


def soak(
    args: argparse.Namespace,
    settings: Settings,
    chaos: Chaos,
    writers: list[subprocess.Popen[bytes]],
    log: RunLog,
) -> dict[str, Any]:
    """The run itself; its summary. Stopping what it started (`chaos`' relays, `writers`, the
    stack) is the caller's, so that an exception or Ctrl-C stops them too."""
    log(f"stack up: {stack.up(settings)}")
    database.create(settings)
    topics.create(settings)
    for _ in range(3):
        chaos.start_relay("initial")
    time.sleep(5)  # the relays take their shards before the load begins
    load_s = args.minutes * 60
    load_end = time.monotonic() + load_s
    for i in range(args.writers):
        name = f"w{i}"
        seed = args.seed * 10 + i
        writers.append(writer.spawn(settings, name, load_s, args.rate, seed, chaos.rundir))
        log(f"START writer {name} pid {writers[-1].pid}")
    chaos.run(max(0.0, load_s - QUIET_S), MAX_EVENTS)
    chaos.settle(DRAIN_RELAYS)
    chaos.tend(
        lambda: all(p.poll() is not None for p in writers),
        load_end + WRITER_OVERRUN_S - time.monotonic(),
    )
    for proc in writers:
        if proc.poll() is None:
            log(f"writer pid {proc.pid} overran the load: SIGKILL")
            proc.kill()
            proc.wait(10)
    log("writers done")
    t0 = time.monotonic()
    drained = drain(chaos, settings, log)
    drain_s = time.monotonic() - t0
    log(f"drain {'done' if drained else 'NOT done'} in {drain_s:.1f}s")
    chaos.stop()
    log("relays stopped; reading the topics")
    observed = observe(settings, chaos.rundir)
    findings = checks.check(observed)
    stats = checks.stats(observed)
    summary = {
        "soak": "violations" if findings else "clean",
        "violations": sum(f.count for f in findings),
        "kinds": sorted({f.kind for f in findings}),
        "events": chaos.events,
        "records": stats["records"],
        "delivered": stats["delivered"],
        "transactions": stats["transactions"],
        "xid_inversions": stats["xid_inversions"],
        "drain_s": round(drain_s, 1),
        "chaos": dict(chaos.counts),
    }
    report = {
        "summary": summary,
        "violations": [dataclasses.asdict(f) for f in findings],
        "stats": stats,
        "args": vars(args),
    }
    with (chaos.rundir / "findings.json").open("w") as f:
        json.dump(report, f, indent=1, default=str)
    for finding in findings:
        log(f"VIOLATION {finding.kind}: {finding.count}, e.g. {finding.sample[:3]}")
    return summary


def _interrupt(signum: int, _frame: object) -> NoReturn:
    raise KeyboardInterrupt  # a SIGTERM stops the soak as Ctrl-C does: cleaning up


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    settings = Settings()
    rundir = settings.local_dir / "runs" / datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    rundir.mkdir(parents=True)
    log = RunLog(rundir / "chaos.log")
    signal.signal(signal.SIGTERM, _interrupt)
    plan = HARSH if args.harsh else PLAN
    rnd = random.Random(args.seed)  # noqa: S311 - seeded chaos, not security
    chaos = Chaos(settings, plan, rnd, rundir, log)
    log(f"soak begins: {vars(args)}, run directory {rundir}")
    started = time.monotonic()
    writers: list[subprocess.Popen[bytes]] = []
    summary: dict[str, Any] = {}
    rc = 2
    try:
        summary = soak(args, settings, chaos, writers, log)
        rc = 1 if summary["violations"] else 0
    except KeyboardInterrupt:
        log("interrupted: stopping what the soak started")
        summary, rc = {"soak": "interrupted"}, 130
    except Exception as exc:
        log(f"the soak failed: {traceback.format_exc()}")
        summary = {"soak": "failed", "error": repr(exc)[:500]}
    finally:
        for proc in writers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        chaos.kill_all()
        if args.keep_stack:
            log("stack kept running (--keep-stack)")
        else:
            try:
                log(f"stack down: {stack.down(settings)}")
            except Exception as exc:
                log(f"stack down failed: {exc!r}")
                summary["stack_down_failed"] = repr(exc)[:300]
                rc = max(rc, 2)
    summary = {
        **summary,
        "run": str(rundir),
        "seed": args.seed,
        "harsh": args.harsh,
        "minutes": args.minutes,
        "duration_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
