"""`outboxctl` subcommands of the checker.

    outboxctl checker [--config FILE] [--once]      run the checker alone (until SIGTERM/SIGINT)
    outboxctl rearm   --producer-group G --tx-id T [--checks N] [--actor NAME] [--reason TEXT]
    outboxctl resolve --producer-group G --tx-id T (--commit | --rollback)
                      --actor NAME --reason TEXT
    outboxctl redrive (--producer-group G --tx-id T [--id N]... | --topic X)   (--id: one each)
                      --actor NAME --reason TEXT
    outboxctl drop    (--producer-group G --tx-id T [--id N]... | --topic X)
                      --actor NAME --reason TEXT [--dry-run]

`rearm` puts a discarded transaction that the relay has not shipped yet (none of its records:
it ships them a batch and a shard at a time) back to prepared, with
its check count set to N (default 0: a full `max_checks` again), due at once, its maximum
prepared age counted from the re-arm. `resolve` commits or rolls back by hand a prepared
transaction (or a discarded one not shipped yet). `redrive` puts parked records (refused by
the broker for good) back to committed once their cause is fixed, and the relay ships them
again (`--topic`: every record parked for that topic, transaction by transaction). `drop`
removes parked records given up on, once the relay has put their copies on the dead-letter
topic: they are never sent. All four are audited in `audit_log`. The database comes from
`--dsn`, OUTBOX_DATABASE_URL or the sidecar's settings, in that order (for `checker` the other
settings as well).
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from checker._manual import (
    ManualResult,
    drop,
    drop_topic,
    parked_unshipped,
    rearm,
    redrive,
    redrive_topic,
    resolve,
)
from outbox import SchemaError
from outbox.checkback import TransactionStatus
from relay.cli_database import connect, require_schema, url_not_another_database
from relay.records import shown
from relay.signals import StopOnSignals

logger = logging.getLogger(__name__)


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the checker's subcommands on outboxctl's subparsers."""
    p = sub.add_parser(
        "checker", parents=[common], help="run the checker alone (until SIGTERM / SIGINT)"
    )  # --config: outboxctl's common options
    p.add_argument("--once", action="store_true", help="run one round, print what it did, exit")
    p.set_defaults(func=_cmd_checker)

    tx = argparse.ArgumentParser(add_help=False)
    tx.add_argument("--producer-group", required=True, help="the transaction's producer group")
    tx.add_argument("--tx-id", required=True, help="the transaction id")

    p = sub.add_parser(
        "rearm",
        parents=[common, tx],
        help="discarded, not yet shipped transaction: back to prepared, checked again",
    )
    p.add_argument(
        "--checks",
        type=_non_negative,
        default=0,
        metavar="N",
        help="check count to start again from (default 0: max_checks more checks; at or above "
        "the checker's max_checks it is discarded again unasked)",
    )
    p.add_argument("--actor", help="who does this, for the audit log (default: $USER)")
    p.add_argument("--reason", default=None, help="why, for the audit log")
    p.set_defaults(func=_cmd_rearm)

    p = sub.add_parser(
        "resolve",
        parents=[common, tx],
        help="commit or roll back a prepared (or discarded, not yet shipped) transaction by hand",
    )
    decision = p.add_mutually_exclusive_group(required=True)
    decision.add_argument(
        "--commit", dest="decision", action="store_const", const=TransactionStatus.COMMIT
    )
    decision.add_argument(
        "--rollback", dest="decision", action="store_const", const=TransactionStatus.ROLLBACK
    )
    p.add_argument("--actor", required=True, help="who decides, for the audit log")
    p.add_argument("--reason", required=True, help="why, for the audit log")
    p.set_defaults(func=_cmd_resolve)
    _add_redrive(sub, common)


def _add_redrive(sub: Any, common: argparse.ArgumentParser) -> None:
    for name, helped, why in [
        (
            "redrive",
            "parked records (refused by the broker for good), their cause fixed: shipped again",
            "what was fixed, for the audit log",
        ),
        (
            "drop",
            "parked records given up on, their dead-letter copy out: removed, never sent",
            "why they are given up on, for the audit log",
        ),
    ]:
        p = sub.add_parser(name, parents=[common], help=helped)
        p.add_argument("--producer-group", help="the transaction's producer group")
        p.add_argument("--tx-id", help="the transaction id")
        p.add_argument(
            "--topic", help="instead of a transaction: every record parked for this topic"
        )
        p.add_argument(
            "--id",
            dest="ids",
            type=int,
            action="append",
            default=[],
            metavar="N",
            help="only this parked record of the transaction (repeat for more; default: all)",
        )
        p.add_argument("--actor", required=True, help="who does this, for the audit log")
        p.add_argument("--reason", required=True, help=why)
        if name == "drop":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="say which records would be dropped; change nothing",
            )
        p.set_defaults(func=_cmd_parked, dry_run=False)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _print(args: argparse.Namespace, result: ManualResult) -> None:
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    where = f"tx {shown(result.tx_id)} of producer group {result.producer_group}"
    if result.action == "drop" and not result.changed:
        ids = ", ".join(map(str, result.record_ids))
        print(f"{where}: would drop {len(result.record_ids)} parked record(s): {ids} (dry run)")
    elif not result.changed and result.from_state == "parked":
        print(
            f"{where} is already committed, but parked (the broker refused it for good): "
            "once its cause is fixed, `outboxctl redrive` sends it again"
        )
    elif not result.changed:
        print(f"{where} is already {result.to_state}: nothing to do")
    elif result.action == "rearm":
        counted = result.check_count
        print(
            f"{where}: {len(result.record_ids)} record(s) back to prepared, check count "
            f"{counted}, due now (audit #{result.audit_id})"
            + (
                f"; a checker whose max_checks is {counted} or less discards it again unasked"
                if counted
                else ""
            )
        )
    else:
        print(
            f"{where}: {len(result.record_ids)} record(s) {result.from_state} -> "
            f"{result.to_state} (audit #{result.audit_id})"
        )


_Done = TypeVar("_Done")


def _connected(
    args: argparse.Namespace, action: Callable[[psycopg.Connection[Any]], _Done]
) -> _Done | None:
    """`action` on a connection of its own; None once bad input was refused (said on stderr)."""
    try:
        with connect(args, autocommit=True) as conn:
            require_schema(conn, args.schema)
            return action(conn)
    except ValueError as exc:  # bad input: nothing was sent
        print(f"outboxctl {args.command}: {exc}", file=sys.stderr)
        return None


def _manual(
    args: argparse.Namespace, action: Callable[[psycopg.Connection[Any]], ManualResult]
) -> int:
    result = _connected(args, action)
    if result is None:
        return 2
    _print(args, result)
    return 0


def _login() -> str | None:
    """The user's name, None where the uid has none (a container's arbitrary uid)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # KeyError up to Python 3.12, OSError from 3.13
        return None


def _cmd_rearm(args: argparse.Namespace) -> int:
    actor = args.actor or os.environ.get("USER") or _login()
    if actor is None:
        print(
            "outboxctl rearm: --actor: no user name to record (none for this uid)", file=sys.stderr
        )
        return 2
    return _manual(
        args,
        lambda conn: rearm(
            conn,
            args.producer_group,
            args.tx_id,
            actor=actor,
            reason=args.reason,
            check_count=args.checks,
            schema=args.schema,
        ),
    )


def _cmd_resolve(args: argparse.Namespace) -> int:
    return _manual(
        args,
        lambda conn: resolve(
            conn,
            args.producer_group,
            args.tx_id,
            args.decision,
            actor=args.actor,
            reason=args.reason,
            schema=args.schema,
        ),
    )


_OfTopic = Callable[
    [psycopg.Connection[Any], argparse.Namespace, Callable[[ManualResult], None]], Any
]
_ON_PARKED: dict[str, tuple[Callable[..., ManualResult], _OfTopic]] = {
    "redrive": (
        redrive,
        lambda conn, a, say: redrive_topic(
            conn, a.topic, actor=a.actor, reason=a.reason, schema=a.schema, on_redriven=say
        ),
    ),
    "drop": (
        drop,
        lambda conn, a, say: drop_topic(
            conn,
            a.topic,
            actor=a.actor,
            reason=a.reason,
            schema=a.schema,
            on_dropped=say,
            dry_run=a.dry_run,
        ),
    ),
}


def _cmd_parked(args: argparse.Namespace) -> int:
    """redrive and drop: one transaction's parked records, or every one of a topic."""
    name = args.command
    one, of_topic = _ON_PARKED[name]
    one_tx = args.producer_group is not None and args.tx_id is not None
    if args.topic is None and not one_tx:
        print(f"outboxctl {name}: give --producer-group and --tx-id, or --topic", file=sys.stderr)
        return 2
    if args.topic is not None and (args.producer_group or args.tx_id or args.ids):
        print(
            f"outboxctl {name}: --topic goes alone, without --producer-group, --tx-id or --id",
            file=sys.stderr,
        )
        return 2
    more = {"dry_run": True} if args.dry_run else {}  # drop's alone
    if one_tx:
        return _manual(
            args,
            lambda conn: one(
                conn,
                args.producer_group,
                args.tx_id,
                actor=args.actor,
                reason=args.reason,
                record_ids=args.ids,
                schema=args.schema,
                **more,
            ),
        )
    # Each transaction is said as it is done: if one fails (busy, say), those before it are
    # done already, and the operator must see which.
    done: list[ManualResult] = []

    def say(result: ManualResult) -> None:
        done.append(result)
        if not args.json:
            _print(args, result)
            sys.stdout.flush()  # a pipe's buffer held them: a closed reader was found at exit

    results = None
    try:
        results = _connected(args, lambda conn: of_topic(conn, args, say))
    except BrokenPipeError:
        return _output_closed(args, len(done))
    finally:
        if args.json and (done or results is not None):  # on an error, what went before it
            print(json.dumps([r.as_dict() for r in done]))
    if results is None:
        return 2
    if name == "drop":  # the relay's dead-letter copies come first: those waiting stay
        waiting = _connected(args, lambda conn: parked_unshipped(conn, args.topic, args.schema))
        if waiting:
            print(
                f"outboxctl drop: {waiting} record(s) parked for topic {args.topic} wait for "
                "their dead-letter copy (the relay's next round, or a dead-letter topic that "
                "takes nothing): not dropped; run it again once they have one",
                file=sys.stderr,
            )
            return 1  # not done: a script must not take it for done (--json lists only those)
        if not results and not args.json:
            print(f"no record is parked for topic {args.topic}")
    elif not results and not args.json:
        print(f"no record is parked for topic {args.topic}")
    return 0


def _output_closed(args: argparse.Namespace, done: int) -> int:
    """The reader of a topic's run went away (`| head`): the transaction whose line could not
    be written was done, and the run stopped there. Said on stderr: else the operator took the
    lines shown for all that was done, or for all there was."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as relay.cli.main
    if args.dry_run:
        said = (
            f"listing topic {args.topic}'s transactions, not all shown; nothing dropped (dry run)"
        )
    else:
        did = {"redrive": "redriven", "drop": "dropped"}[args.command]
        said = (
            f"{done} transaction(s) of topic {args.topic} {did}, not all of them shown; the "
            "rest are untouched (run it again for them)"
        )
    print(
        f"outboxctl {args.command}: the output was closed: stopped after {said}",
        file=sys.stderr,
    )
    return 1


def _cmd_checker(args: argparse.Namespace) -> int:
    from checker.service import Checker
    from relay import logs
    from relay.config import load_settings

    database: dict[str, Any] = {}
    dsn = args.dsn or os.environ.get("OUTBOX_DATABASE_URL")  # as the other commands take it
    if dsn:
        if not args.dsn:  # and refuse it as they do: it would check another database's rows
            url_not_another_database(dsn, args.config)
        database["dsn"] = dsn
    if args.schema_given:  # else the settings decide
        database["schema_name"] = args.schema
    settings = load_settings(args.config, **({"database": database} if database else {}))
    logs.configure(settings.log_level, settings.log_format)
    if not settings.checker.enabled:
        said = "the checker is disabled (checker.enabled = false)"
        if args.once:  # asked for a round that cannot run: not a success
            print(json.dumps({"disabled": True}) if args.json else f"outboxctl checker: {said}")
            return 1
        print(f"outboxctl checker: {said}")
        return 0
    checker = Checker.from_sidecar_settings(settings)
    if args.once:
        try:
            problem = checker.schema_problem()
            if problem is not None:  # said, rather than the SQL error of the round's first query
                raise SchemaError(problem)
            result = checker.run_once()
        finally:
            checker.stop()
        print(json.dumps(result.as_dict()) if args.json else _summary(result.as_dict()))
        return 0

    stop = threading.Event()
    StopOnSignals(stop, "stopping the checker").install()
    checker.start()
    logger.info("checker started (%d endpoint(s))", len(settings.checker.endpoints))
    while not stop.wait(1.0):
        if not checker.alive():
            logger.error(
                "the checker thread died; exiting"
                if checker.ended_by_itself()
                else f"no check round finished in {checker.stale_after_s():.0f} s; exiting"
            )
            checker.stop(settings.relay.shutdown_grace.total_seconds())
            return 1
    checker.stop(settings.relay.shutdown_grace.total_seconds())
    if checker.running():  # said by the exit status too, as `outboxctl run` says it
        logger.error("the checker did not stop within the grace period")
        return 1
    logger.info("checker stopped")
    return 0


def _summary(result: dict[str, Any]) -> str:
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(result["outcomes"].items())) or "none"
    return (
        f"due {result['due']}, checked {result['checked']} ({outcomes}), "
        f"discarded {result['discarded']}, not sent {result['not_sent']}, "
        f"conflicts {result['conflicts']}"
    )
