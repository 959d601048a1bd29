"""Which database a command of `outboxctl` works on: shared by every command that takes `--dsn`."""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from outbox._describe import describe
from outbox._dsn import parse_dsn
from relay.config import DatabaseSettings, load_database_settings


def database_settings() -> tuple[DatabaseSettings | None, str]:
    """The database part of the sidecar's settings, the rest unread (load_database_settings),
    or None and why it could not be read."""
    try:
        return load_database_settings().database, ""
    except Exception as exc:  # not configured here, or configured wrong: say so if needed
        return None, describe(exc, "settings") if isinstance(exc, ValidationError) else str(exc)


def command_dsn(args: argparse.Namespace) -> str:
    """--dsn, else OUTBOX_DATABASE_URL, else the sidecar's own database setting (so that
    `kubectl exec ... -- outboxctl status` works in the sidecar's container as it is)."""
    dsn = args.dsn or os.environ.get("OUTBOX_DATABASE_URL")
    if dsn:
        parse_dsn(str(dsn), "--dsn" if args.dsn else "OUTBOX_DATABASE_URL")
        return str(dsn)
    database, why = database_settings()
    if database is None:
        raise SystemExit(
            "outboxctl: no database: pass --dsn, set OUTBOX_DATABASE_URL, or give the sidecar's "
            "setting (OUTBOX_DATABASE__DSN, or the file outbox_database__dsn in "
            f"OUTBOX_SECRETS_DIR); the sidecar's settings: {why}"
        )
    return database.dsn.get_secret_value()
