"""`outboxctl`: the command line of the outbox sidecar.

Subcommands are added by the parts that own them (migrations now; relay, checker, reconciliation
as they arrive). The database comes from `--dsn`, the OUTBOX_DATABASE_URL environment variable,
or the sidecar's own settings (OUTBOX_DATABASE__DSN, its secrets directory, its config file); the
schema from `--schema`, else the sidecar's settings, else `outbox`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import version

import psycopg
from pydantic import ValidationError

from checker import cli as checker_cli
from outbox import OutboxError, State, migrate
from outbox import sql as outbox_sql
from outbox._describe import describe
from outbox.migrations import (
    CHECKER_SCHEMA_VERSION,
    RELAY_SCHEMA_VERSION,
    current_version,
    latest_version,
    schema_problem,
)
from relay import logs, sidecar
from relay.cli_database import command_dsn, command_schema, connect, require_schema, where
from relay.config import SettingsUnreadable, SidecarSettings, load_settings
from relay.http import ProbeServerUnavailable
from relay.kafka import ProducerMisconfigured
from relay.records import check_filters, list_records, shown
from relay.status import outbox_status
from spark._errors import ReconcileConfigError
from spark.findings import check_options, read_findings


def _cmd_migrate(args: argparse.Namespace) -> int:
    with connect(args) as conn:
        report = migrate(conn, schema=args.schema)
    # which database, said: the one command that changes a schema
    database = where(command_dsn(args))
    if args.json:
        print(
            json.dumps(
                {
                    "schema": report.schema,
                    "database": database,
                    "applied": report.applied,
                    "version": report.version,
                }
            )
        )
    elif report.applied:
        print(
            f"schema {report.schema} in {database}: applied {list(report.applied)}, now at "
            f"{report.version}"
        )
    else:
        print(f"schema {report.schema} in {database}: already at {report.version}, nothing to do")
    return 0


def _cmd_schema_version(args: argparse.Namespace) -> int:
    """Exit 0 when this build's relay and checker can run on the schema: at the version they
    need or newer (migrations only add; a gate that wanted the exact number blocked the older
    pods of a rolling upgrade once the newer ones had migrated)."""
    with connect(args, write=False) as conn:
        at = current_version(conn, args.schema)
        problem = schema_problem(
            conn, args.schema, max(RELAY_SCHEMA_VERSION, CHECKER_SCHEMA_VERSION)
        )
    latest = latest_version()
    if args.json:
        print(
            json.dumps({"schema": args.schema, "version": at, "latest": latest, "problem": problem})
        )
    else:
        note = ""
        if problem is None and at is not None and at != latest:
            note = (
                " (newer: this build runs on it)"
                if at > latest
                else " (older: this build's relay and checker run on it; `outboxctl migrate` "
                "brings it up to date)"
            )
        shown = at if at is not None else "nothing (not migrated)"
        print(f"schema {args.schema}: at {shown}, library knows {latest}{note}")
        if problem:
            print(problem)
    return 0 if problem is None else 1


def _cmd_grants(args: argparse.Namespace) -> int:
    grants = outbox_sql.grants_sql(
        args.schema, args.writer_role, args.relay_role, args.reconciler_role
    )
    text = grants.as_string(None)
    if args.json:
        print(json.dumps({"schema": args.schema, "sql": text}))
    else:
        print(text)
    return 0


def _settings(args: argparse.Namespace) -> SidecarSettings:
    return load_settings(args.config)


def _cmd_run(args: argparse.Namespace) -> int:
    return sidecar.run(_settings(args), only=args.only)


def _cmd_config(args: argparse.Namespace) -> int:
    """The effective settings, secrets masked; refused as the sidecar would refuse them."""
    settings = _settings(args)
    sidecar.check_settings(settings)
    print(settings.model_dump_json(indent=2))
    return 0


def _json_default(value: object) -> str:
    """Times as ISO 8601 (as `findings --json` writes them), anything else as text."""
    return value.isoformat() if isinstance(value, datetime) else str(value)


def _utc(t: datetime) -> str:
    """As records and findings print times: UTC, not the session's zone."""
    return f"{t.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}"


def _cmd_status(args: argparse.Namespace) -> int:
    with connect(args, write=False) as conn:
        require_schema(conn, args.schema)
        status = outbox_status(conn, args.schema)
    # every state, 0 too: a script reading states["parked"] got a KeyError when none was
    status["states"] = {state.value: status["states"].get(state.value, 0) for state in State}
    if args.json:
        print(json.dumps(status, default=_json_default))
        return 0
    print("records by state:")
    for state, count in status["states"].items():
        print(f"  {state:12} {count:>10}")
    oldest = status["oldest_undelivered"]
    print(
        "oldest undelivered commit: "
        + (f"{_utc(oldest)} ({status['oldest_undelivered_age_s']:.0f} s ago)" if oldest else "-")
    )
    print(f"relays alive: {', '.join(status['relays']) or 'none'}")
    for lease in status["leases"]:
        markers = (
            "none yet"
            if lease["marker_partition"] is None
            else f"{lease['marker_topic'] or '(topic not recorded)'}:{lease['marker_partition']} "
            f"from offset {lease['marker_offset']}, by {lease['transactional_id'] or '-'}"
        )
        until = lease["lease_until"]
        held = f"until {_utc(until)}" if until else "until -"
        if until and lease["expired"]:
            held += " (expired: no relay renews it)"
        print(
            f"shard {lease['shard']}: owner {lease['owner'] or '-'} epoch {lease['epoch']} "
            f"{held}; markers {markers}"
        )
    return 0


def _cmd_records(args: argparse.Namespace) -> int:
    # Bad options said as such (2) before any connection: after it, a bad --limit with the
    # database away said "connection refused" (1), and a bad DSN was a usage error here alone.
    try:
        check_filters(args.state, args.limit)
    except ValueError as exc:
        print(f"outboxctl records: {exc}", file=sys.stderr)
        return 2
    with connect(args, write=False) as conn:
        require_schema(conn, args.schema)
        found = list_records(
            conn,
            args.schema,
            state=args.state,
            producer_group=args.producer_group,
            tx_id=args.tx_id,
            topic=args.topic,
            limit=args.limit + 1,  # one more than asked, to say whether the list was cut
        )
    cut, found = len(found) > args.limit, found[: args.limit]
    if args.json:
        print(json.dumps([r.as_dict() for r in found], default=_json_default))
        if cut:  # on stderr: the JSON stays the list it was, and a script is told all the same
            print(
                f"outboxctl records: the oldest {args.limit} only; --limit for more",
                file=sys.stderr,
            )
        return 0
    for r in found:
        reason = f"  {shown(r.reason)}" if r.reason else ""
        if r.shipping_since is not None:
            reason += f"  (taken by the relay to ship since {_utc(r.shipping_since)})"
        created = r.created_at.astimezone(UTC)  # not the session's zone, unnamed
        print(
            f"{r.id:>10}  {r.state:11} {r.producer_group}/{shown(r.tx_id)}  {r.topic}  "
            f"key {r.key_text()}  {r.value_bytes or 0} B  {created:%Y-%m-%d %H:%M:%SZ}{reason}"
        )
    if not found:
        print("no records")
    elif cut:
        print(f"(the oldest {args.limit}; --limit for more)")
    return 0


def _cmd_reconcile(args: argparse.Namespace) -> int:
    try:  # PySpark is an optional extra (not in the sidecar's image): import late
        from spark.job import main as reconcile_main
    except ModuleNotFoundError as exc:
        # py4j comes with PySpark, and the job imports it first
        if (exc.name or "").partition(".")[0] not in ("pyspark", "py4j"):
            raise
        raise SystemExit(
            "outboxctl reconcile: PySpark is not installed: "
            "pip install 'kafka-outbox-sidecar[spark]' (or run it with spark-submit)"
        ) from None
    from spark._errors import ReconcileError  # with the job: PySpark is there by now

    try:
        return reconcile_main(args.job_args)
    except (ReconcileError, psycopg.Error) as exc:  # said as `python -m spark.job` says them
        print(f"outboxctl reconcile: {exc}", file=sys.stderr)
        return 1


def _cmd_findings(args: argparse.Namespace) -> int:
    try:  # as records: bad options said before any connection, and as such
        check_options(args.kind or None, args.limit)
    except ValueError as exc:
        print(f"outboxctl findings: {exc}", file=sys.stderr)
        return 2
    dsn = command_dsn(args)
    try:
        found = read_findings(
            dsn,
            args.schema,
            kinds=args.kind or None,
            limit=args.limit + 1,  # one more than asked, to say whether the list was cut
            since=args.since,
        )
    except ReconcileConfigError as exc:  # the schema, not the input: not a usage error
        print(f"outboxctl findings: {exc}", file=sys.stderr)
        return 1
    cut, found = len(found) > args.limit, found[: args.limit]
    if args.json:
        print(json.dumps([f.as_dict() for f in found], default=str))
        if cut:  # on stderr: the JSON stays the list it was
            print(
                f"outboxctl findings: the newest {args.limit} only; --limit for more",
                file=sys.stderr,
            )
        return 0
    for f in found:
        at = f"{f.kafka_partition}:{f.kafka_offset}" if f.kafka_partition is not None else "-"
        tx = f"{f.producer_group or '-'}/{shown(f.tx_id) if f.tx_id is not None else '-'}"
        # found first and last: one no judgement finds again any more is old news
        print(
            f"{f.event_time.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}  {f.kind:15} {f.topic}  "
            f"id {f.outbox_id}  {tx}  at {at}  found "
            f"{f.detected_at.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}, last "
            f"{f.last_seen_at.astimezone(UTC):%Y-%m-%d %H:%M:%SZ}"
        )
    if not found:
        print("no findings")
    elif cut:
        print(f"(the newest {args.limit}; --limit for more)")
    return 0


def _since(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _role(name: str) -> str:
    """A role name as `grants` quotes it: Postgres refuses an empty one, and a NUL."""
    if not name or "\x00" in name:
        raise argparse.ArgumentTypeError("a role name must not be empty or hold a NUL")
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outboxctl", description="Kafka transactional outbox sidecar: run and inspect it."
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version('kafka-outbox-sidecar')}"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn",
        help="Postgres connection string (default: $OUTBOX_DATABASE_URL, else the sidecar's)",
    )
    common.add_argument(
        "--schema", help="schema of the outbox tables (default: the sidecar's, else outbox)"
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    # as `run --config` reads it: the sidecar's schema (and DSN) from where the sidecar has them
    common.add_argument(
        "--config",
        help="the sidecar's TOML config file (default: $OUTBOX_CONFIG_FILE; env vars override "
        "it): --schema and --dsn default to its database settings",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("migrate", parents=[common], help="create or upgrade the outbox schema")
    p.set_defaults(func=_cmd_migrate)
    p = sub.add_parser("schema-version", parents=[common], help="show the schema's version")
    p.set_defaults(func=_cmd_schema_version)
    p = sub.add_parser(
        "grants", parents=[common], help="print least-privilege GRANTs for your roles"
    )
    for flag, whose in [
        ("--writer-role", "the application's role"),
        ("--relay-role", "the sidecar's role"),
        ("--reconciler-role", "the Spark reconciliation's role"),
    ]:
        p.add_argument(flag, required=True, type=_role, help=whose)
    p.set_defaults(func=_cmd_grants)

    config = argparse.ArgumentParser(add_help=False)
    config.add_argument(
        "--config", help="TOML config file (default: $OUTBOX_CONFIG_FILE; env vars override it)"
    )
    p = sub.add_parser("run", parents=[config], help="run the sidecar: relay and checker")
    p.add_argument("--only", choices=["relay", "checker"], help="run one part only")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("relay", parents=[config], help="run the relay alone")
    p.set_defaults(func=_cmd_run, only="relay")
    p = sub.add_parser("config", parents=[config], help="print the effective settings")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("status", parents=[common], help="records by state, relays and leases")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser(
        "records",
        parents=[common],
        help="list records (no values) by state, producer group, tx id or topic",
    )
    p.add_argument("--state", help="e.g. parked, committed, prepared, discarded")
    p.add_argument("--producer-group")
    p.add_argument("--tx-id")
    p.add_argument("--topic")
    p.add_argument("--limit", type=int, default=100, help="at most this many, oldest first")
    p.set_defaults(func=_cmd_records)

    p = sub.add_parser(
        "reconcile",
        help="run the Spark reconciliation (arguments as python -m spark.job; --help there)",
        add_help=False,
    )
    p.add_argument("job_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_reconcile)
    p = sub.add_parser("findings", parents=[common], help="list reconciliation findings")
    p.add_argument("--kind", action="append", help="only this kind (repeatable)")
    p.add_argument("--limit", type=int, default=100, help="at most this many, newest first")
    p.add_argument(
        "--since",
        type=_since,
        help="only those found since then (ISO 8601; a time without a zone is UTC)",
    )
    p.set_defaults(func=_cmd_findings)

    checker_cli.add_commands(sub, common)
    return parser


_SERVING = frozenset({"run", "relay", "checker"})  # the long-running commands


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["reconcile"]:  # the job parses its own arguments, --help included
        return _cmd_reconcile(argparse.Namespace(job_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # The sidecar's processes log as their settings say, even the failure to read them.
    serving = args.command in _SERVING
    if serving:
        logs.configure_from_environment()
    if "schema" in args:
        args.schema_given = args.schema is not None  # `checker --config` reads its own settings
        # A serving command given no --schema reads all its settings anyway: a failure to read
        # them is its own to say (logged as the sidecar logs, naming what is wrong), not
        # "cannot be read for the schema; pass --schema", in plain text.
        if args.schema_given or not serving:
            args.schema = command_schema(args)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`outboxctl records | head`): nothing more to say, and no
        # traceback. Python's recipe: the interpreter's last flush of stdout must not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (
        OutboxError,
        psycopg.Error,
        ValidationError,
        FileNotFoundError,
        SettingsUnreadable,
        ProducerMisconfigured,
        ProbeServerUnavailable,
    ) as exc:
        said = _settings_error(exc) if isinstance(exc, ValidationError) else str(exc)
        if serving:
            logging.getLogger("outbox").critical("outboxctl %s: %s", args.command, said)
        else:
            print(f"outboxctl {args.command}: {said}", file=sys.stderr)
        return 1


def _settings_error(exc: ValidationError) -> str:
    """One line naming each bad setting, not pydantic's dump of our classes and its links; a
    missing database names where the DSN goes."""
    said = f"settings: {describe(exc, '')}"  # an error of no field names its settings itself
    if any(err["loc"][:1] == ("database",) and err["type"] == "missing" for err in exc.errors()):
        said += (
            " (set OUTBOX_DATABASE__DSN, or the secret file outbox_database__dsn, or "
            "[database] dsn in the config file)"
        )
    return said


if __name__ == "__main__":
    sys.exit(main())
