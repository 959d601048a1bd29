"""Which database a command of `outboxctl` works on: shared by every command that takes `--dsn`."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from pydantic import ValidationError

from outbox._core import OutboxConfig
from outbox._describe import describe
from outbox._dsn import parse_dsn
from outbox._errors import InvalidConfigError, SchemaError
from outbox.migrations import current_version
from relay.config import DatabaseLookupSettings, load_database_settings
from relay.dbconnect import dead_peer_options, own_transaction_mode


def database_settings(config_file: str | None = None) -> tuple[DatabaseLookupSettings | None, str]:
    """The database part of the sidecar's settings, the rest unread (load_database_settings),
    or None and why it could not be read. `config_file`: a command's --config, else
    $OUTBOX_CONFIG_FILE."""
    try:
        return load_database_settings(config_file).database, ""
    except Exception as exc:  # configured wrong: say so if needed
        return None, describe(exc, "settings") if isinstance(exc, ValidationError) else str(exc)


def command_schema(args: argparse.Namespace) -> str:
    """--schema, else the sidecar's setting (--config's file, the environment; whatever gives
    the DSN)."""
    if args.schema is not None:
        # checked as the settings check theirs: else `status --schema a-b` said to migrate a
        # schema `migrate` refuses, and `grants` printed grants for one that cannot exist
        try:
            return OutboxConfig(schema_name=str(args.schema)).schema_name
        except InvalidConfigError as exc:
            raise SystemExit(f"outboxctl: --schema: {exc}") from None
    database, why = database_settings(getattr(args, "config", None))
    if database is None:  # not `outbox` unsaid: the command would work on another outbox
        raise SystemExit(
            f"outboxctl: the sidecar's database settings cannot be read for the schema ({why}); "
            "pass --schema"
        )
    return database.schema_name


def command_dsn(args: argparse.Namespace) -> str:
    """--dsn, else OUTBOX_DATABASE_URL, else the sidecar's own database setting (so that
    `kubectl exec ... -- outboxctl status` works in the sidecar's container as it is). A config
    file's settings that name another database than OUTBOX_DATABASE_URL are refused
    (url_not_another_database)."""
    dsn = args.dsn or os.environ.get("OUTBOX_DATABASE_URL")
    if dsn:
        parse_dsn(str(dsn), "--dsn" if args.dsn else "OUTBOX_DATABASE_URL")
        if not args.dsn:
            url_not_another_database(str(dsn), getattr(args, "config", None))
        return str(dsn)
    database, why = database_settings(getattr(args, "config", None))
    if database is None or database.dsn is None:
        raise SystemExit(
            "outboxctl: no database: pass --dsn, set OUTBOX_DATABASE_URL, or give the sidecar's "
            "setting (OUTBOX_DATABASE__DSN, or the file outbox_database__dsn in "
            f"OUTBOX_SECRETS_DIR){f'; the sidecar settings: {why}' if why else ''}"
        )
    return database.dsn.get_secret_value()


def url_not_another_database(url: str, config_file: str | None) -> None:
    """Refuses OUTBOX_DATABASE_URL where a config file is given (`config_file`, else
    $OUTBOX_CONFIG_FILE) and the settings with it name another database: the variable, left in a
    shell, won over the file's DSN while the file's schema was used, and `migrate --config
    prod.toml` upgraded that schema in another database; a file given by $OUTBOX_CONFIG_FILE
    was not checked at all. Without a file the variable wins over the environment's setting,
    as documented. Another role on the same database is no conflict."""
    named = config_file or os.environ.get("OUTBOX_CONFIG_FILE")
    if not named:
        return
    database, _ = database_settings(named)
    if database is None or database.dsn is None:
        return  # the settings name no database: the variable's is the only one
    configured = database.dsn.get_secret_value()
    if where(configured) != where(url):
        source = "--config" if config_file else "$OUTBOX_CONFIG_FILE"
        raise SystemExit(
            f"outboxctl: the settings of {source} ({named}) name the database "
            f"{where(configured)} and OUTBOX_DATABASE_URL names {where(url)}: pass --dsn, or "
            "unset one of them"
        )


def where(dsn: str) -> str:
    """host:port/dbname of a DSN, as a failure to connect names it: never its password."""
    return _where(conninfo_to_dict(dsn))


def connect(
    args: argparse.Namespace, *, write: bool = True, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A connection for the command, given up after the sidecar's connect timeout (10 s) unless
    the DSN or PGCONNECT_TIMEOUT sets one: without one, a database that took the connection
    and never answered (a failover, a dropped route) left `outboxctl status` hanging for ever.
    Its statements too, once the peer has answered nothing for that long (dead_peer_options).
    A failure names the host and database, never the password. `write=False`: a command that
    only reads, which then runs on a standby too (dbconnect.own_transaction_mode)."""
    dsn = command_dsn(args)
    given = conninfo_to_dict(dsn)
    database, _ = database_settings(getattr(args, "config", None))
    timeout = database.connect_timeout_s if database is not None else 10.0
    if "connect_timeout" not in given and not os.environ.get("PGCONNECT_TIMEOUT"):
        kwargs.setdefault("connect_timeout", max(1, math.ceil(timeout)))  # whole seconds
    # So is a statement on a connection whose peer then went silent (the same failover).
    for name, value in dead_peer_options(dsn, timeout).items():
        kwargs.setdefault(name, value)
    # A command runs each statement a few times at most: preparing gains nothing, and through a
    # pooler in transaction pooling (DatabaseSettings.transaction_pooling) it fails.
    kwargs.setdefault("prepare_threshold", None)
    try:
        conn = psycopg.connect(dsn, **kwargs)
    except psycopg.OperationalError as exc:
        raise psycopg.OperationalError(f"cannot connect to {_where(given)}: {exc}") from exc
    return own_transaction_mode(conn, write=write)  # as the relay and checker run


def _where(given: dict[str, Any]) -> str:
    """host:port/dbname as the DSN or libpq's environment says, a service by its name; what
    neither says is said so, not guessed (libpq's default may be a Unix socket)."""
    if given.get("service") or os.environ.get("PGSERVICE"):
        return f"service {given.get('service') or os.environ.get('PGSERVICE')}"
    host = given.get("host") or os.environ.get("PGHOST") or "the default host"
    port = given.get("port") or os.environ.get("PGPORT") or "the default port"
    dbname = given.get("dbname") or os.environ.get("PGDATABASE") or "the default database"
    return f"{host}:{port}/{dbname}"


def require_schema(conn: psycopg.Connection[Any], schema: str) -> None:
    """What to do about a schema not migrated, rather than the SQL error of its first query
    (for the repair commands that was "run `outboxctl migrate`", which for a mistyped --schema
    makes a second outbox). An older version is read as it is (mid-upgrade, the status matters
    most)."""
    if current_version(conn, schema) is None:
        raise SchemaError(
            f"schema {schema!r} holds no outbox: run `outboxctl migrate --schema {schema}`, or "
            "name the sidecar's schema with --schema"
        )
