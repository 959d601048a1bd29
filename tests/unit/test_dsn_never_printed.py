"""A DSN libpq cannot parse is refused by name, without printing it: libpq's parse errors quote
the token they stumble on (a password) or the whole URI, and every failing round logged that."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import outbox
from outbox import InvalidConfigError
from relay.cli import main
from relay.config import SidecarSettings
from spark._errors import ReconcileConfigError
from spark.config import ReconcileSettings, jdbc_target

UNPARSABLE = [
    ("postgresql://app:Pa%ss_hunter2x@db/app", "a '%' not followed by two hex digits"),
    ("postgresql://app:hunter2x@[127.0.0.1:5432/app", "a '[' of an IPv6 host left open"),
    ("host=db password='hunter2x", "a quoted value left open"),
    ('postgresql://app:hun"ter2x@[db/app', "a '[' of an IPv6 host left open"),  # a '"' in it
    ('postgresql://app:hun"ter%zz2x@db/app', "a '%' not followed by two hex digits"),
    ("host=db password=abc hunter2x", "a word without '='"),  # a password with a space
    # parsed, but the password cut the URI elsewhere: connecting quoted its tail as the host
    ("postgresql://app:hun@ter2x@127.0.0.1/app", "must be percent-encoded"),
    ("postgresql://app:hun/ter2x@db/app", "must be percent-encoded"),
    ("postgresql://app:123/ter2x@db/app", "must be percent-encoded"),  # a number's port
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:secret@db.example/orders%40eu",  # an '@' encoded, in the database
        "postgresql://app:p%40ss%2Fw@db.example:5432/app",  # encoded in the password
        "postgresql://app@h1:5432,h2:5433/app?sslmode=require",
        "postgresql://app@[::1]:5432/app",
        "postgresql:///app?host=%2Fvar%2Frun%2Fpg%40x",
        "host=db password=p@ss/w dbname=app",  # a keyword string takes them as they are
        # libpq's user and password end at '@' or '/' only: these were refused as cut
        "postgresql://app:pa?ss@db.example/app",
        "postgresql://app:pa#ss@db.example:5432/app?sslmode=require",
        "postgresql://app:pa?ss@db.example",
        "postgresql://db.example/app?options=-c%20x%3Dy&application_name=a@b",
    ],
)
def test_valid_dsns_pass(dsn: str) -> None:
    assert SidecarSettings.model_validate({"database": {"dsn": dsn}}).database.dsn


@pytest.mark.parametrize(("dsn", "reason"), UNPARSABLE)
def test_the_sidecars_settings_refuse_it_naming_the_setting(dsn: str, reason: str) -> None:
    with pytest.raises(ValidationError) as caught:
        SidecarSettings.model_validate({"database": {"dsn": dsn}})
    said = str(caught.value)
    assert "database.dsn" in said
    assert reason in said
    assert "2x" not in said


@pytest.mark.parametrize(("dsn", "reason"), UNPARSABLE)
def test_migrate_refuses_it_before_connecting(dsn: str, reason: str) -> None:
    with pytest.raises(InvalidConfigError) as caught:
        outbox.migrate(dsn)
    assert reason in str(caught.value)
    assert "2x" not in str(caught.value)
    assert caught.value.__cause__ is None
    assert caught.value.__context__ is None or caught.value.__suppress_context__


@pytest.mark.parametrize("where", ["--dsn", "OUTBOX_DATABASE_URL", "OUTBOX_DATABASE__DSN"])
def test_commands_refuse_it_naming_where_it_came_from(
    where: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn = UNPARSABLE[0][0]
    argv = ["status"]
    if where == "--dsn":
        argv += ["--dsn", dsn]
    else:
        monkeypatch.setenv(where, dsn)
    for command in (argv, ["migrate", *argv[1:]]):
        try:
            code = main(command)
        except SystemExit as exit_:  # the sidecar's settings unusable: the command exits so
            code, message = 1, str(exit_.code)
        else:
            message = ""
        assert code != 0
        err = capsys.readouterr().err + message
        assert where.lower().replace("__", ".").removeprefix("outbox_") in err.lower()
        assert "a '%' not followed by two hex digits" in err
        assert "2x" not in err


@pytest.mark.parametrize(("dsn", "reason"), UNPARSABLE)
def test_the_reconciliation_refuses_it(dsn: str, reason: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ReconcileSettings.model_validate({"dsn": dsn, "bootstrap_servers": "k:9092"})
    assert reason in str(caught.value)
    assert "2x" not in str(caught.value)
    with pytest.raises(ReconcileConfigError) as refused:
        jdbc_target(dsn)
    assert reason in str(refused.value)
    assert "2x" not in str(refused.value)


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        (
            "postgresql://app:p%40ss%2Fhunter2x@db.example:5432/orders?sslmode=require",
            "host=db.example port=5432 dbname=orders user=app password=********** sslmode=require",
        ),
        (
            "user=app sslpassword=hunter2x dbname=orders host=h1,h2 password='hunter2x y'",
            "host=h1,h2 dbname=orders user=app password=********** sslpassword=**********",
        ),
        ("postgresql:///orders?host=%2Fvar%2Frun%2Fpg", "host=/var/run/pg dbname=orders"),
    ],
)
def test_config_shows_where_the_dsn_connects_and_masks_its_secrets(
    dsn: str, shown: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", dsn)
    monkeypatch.setenv("OUTBOX_CHECKER__ENABLED", "false")
    assert main(["config"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["database"]["dsn"] == shown
    assert "hunter2x" not in printed
