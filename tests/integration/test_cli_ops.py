"""`outboxctl` as an operator meets it: which outbox it reads, how it fails, what it prints."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import outbox
from outbox import State
from relay.cli import main
from relay.cli_database import where

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_sidecar_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only what a test sets: not the developer's own OUTBOX_* settings."""
    for name in ("OUTBOX_DATABASE_URL", "OUTBOX_DATABASE__DSN", "OUTBOX_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "secrets").mkdir()
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path / "secrets"))  # empty


@pytest.fixture
def silent_database() -> Iterator[int]:
    """A port that takes connections and never answers: a failover, a route that drops."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes the handshakes; nobody reads
        yield int(listener.getsockname()[1])


def test_the_schema_setting_counts_whatever_gives_the_dsn(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --dsn (or OUTBOX_DATABASE_URL), OUTBOX_DATABASE__SCHEMA_NAME was dropped unsaid, and
    `status` read the `outbox` schema: another outbox than the sidecar's."""
    monkeypatch.setenv("OUTBOX_DATABASE__SCHEMA_NAME", "elsewhere")
    assert main(["status", "--dsn", pg_dsn]) == 1
    assert "schema 'elsewhere' holds no outbox" in capsys.readouterr().err
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_dsn)
    assert main(["migrate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "elsewhere"


@pytest.mark.parametrize(
    "command",
    [
        ["rearm", "--producer-group", "g", "--tx-id", "t"],
        ["resolve", "--producer-group", "g", "--tx-id", "t", "--commit"],
        ["redrive", "--producer-group", "g", "--tx-id", "t"],
        ["drop", "--topic", "t"],
    ],
    ids=lambda c: c[0],
)
def test_a_repair_command_given_a_schema_with_no_outbox_says_so(
    pg_dsn: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --schema: the repair commands said "the outbox tables are missing: run
    `outboxctl migrate`", which made a second, empty outbox; `status` said what was wrong."""
    argv = [*command, "--dsn", pg_dsn, "--schema", "outbx", "--actor", "a", "--reason", "r"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        f"outboxctl {command[0]}: schema 'outbx' holds no outbox: run `outboxctl migrate "
        "--schema outbx`, or name the sidecar's schema with --schema\n"
    )
    with psycopg.connect(pg_dsn) as conn:  # nothing made
        assert conn.execute("SELECT to_regnamespace('outbx')").fetchone() == (None,)


def test_the_inspection_and_repair_commands_take_the_sidecars_config_file(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sidecar ran as `outboxctl run --config sidecar.toml` with its schema in the file;
    `redrive`, `status` and the others took no --config and worked on the `outbox` schema:
    another outbox than the sidecar's."""
    config = tmp_path / "sidecar.toml"
    config.write_text('[database]\nschema_name = "elsewhere_cfg"\n')
    assert main(["status", "--dsn", pg_dsn, "--config", str(config)]) == 1
    assert "schema 'elsewhere_cfg' holds no outbox" in capsys.readouterr().err
    redrive = ["redrive", "--dsn", pg_dsn, "--config", str(config), "--topic", "t"]
    assert main([*redrive, "--actor", "a", "--reason", "r"]) == 1
    assert "schema 'elsewhere_cfg' holds no outbox" in capsys.readouterr().err
    assert main(["status", "--dsn", pg_dsn]) == 0  # without it: the default, `outbox`
    with pytest.raises(SystemExit, match=r"none\.toml does not exist\); pass --schema"):
        main(["status", "--dsn", pg_dsn, "--config", str(tmp_path / "none.toml")])


def test_a_config_file_naming_another_database_than_the_url_variable_is_refused(
    pg_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """OUTBOX_DATABASE_URL, left in a shell, won over the DSN of the file named by --config,
    whose schema was used all the same: `migrate --config prod.toml` made that schema in
    another database, and said only the schema."""
    other = "postgresql://postgres:s3cret@127.0.0.1:1/prod_from_config"
    config = tmp_path / "prod.toml"
    config.write_text(f'[database]\ndsn = "{other}"\nschema_name = "from_config"\n')
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_dsn)
    with pytest.raises(SystemExit) as refused:
        main(["migrate", "--config", str(config)])
    said = str(refused.value.code)
    assert "127.0.0.1:1/prod_from_config" in said
    assert f"OUTBOX_DATABASE_URL names {where(pg_dsn)}" in said
    assert "s3cret" not in said
    assert not schema_exists(pg_dsn, "from_config")
    # --dsn says which: no refusal, and migrate names the database it changed
    assert main(["migrate", "--config", str(config), "--dsn", pg_dsn, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["schema"], report["database"]) == ("from_config", where(pg_dsn))
    # the same database written another way is no conflict
    config.write_text(f'[database]\ndsn = "{pg_dsn}"\nschema_name = "from_config"\n')
    assert main(["migrate", "--config", str(config)]) == 0
    assert f"schema from_config in {where(pg_dsn)}: already at" in capsys.readouterr().out


def test_a_config_file_given_by_its_variable_is_checked_against_the_url_variable_too(
    pg_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Only a --config typed on the command line was checked: with $OUTBOX_CONFIG_FILE (the
    sidecar container's, or a shell's) and OUTBOX_DATABASE_URL naming another database, the
    commands, `outboxctl checker` too, worked there with the file's schema."""
    other = "postgresql://postgres:s3cret@127.0.0.1:1/prod_from_config"
    config = tmp_path / "prod.toml"
    config.write_text(f'[database]\ndsn = "{other}"\nschema_name = "from_config"\n')
    monkeypatch.setenv("OUTBOX_CONFIG_FILE", str(config))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_dsn)
    for argv in (["migrate"], ["checker", "--once", "--json"]):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        said = str(refused.value.code)
        assert f"the settings of $OUTBOX_CONFIG_FILE ({config}) name the database" in said
        assert "127.0.0.1:1/prod_from_config" in said
        assert "s3cret" not in said
    assert not schema_exists(pg_dsn, "from_config")
    # another role on the same database is the same database
    same = make_conninfo(pg_dsn, user="someone_else", password="other")
    config.write_text(f'[database]\ndsn = "{same}"\nschema_name = "from_config"\n')
    assert main(["migrate"]) == 0
    assert schema_exists(pg_dsn, "from_config")
    capsys.readouterr()


def schema_exists(dsn: str, schema: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regnamespace(%s) IS NOT NULL", (schema,)).fetchone()
    return bool(row and row[0])


def test_a_schema_setting_that_cannot_be_read_is_said_not_replaced(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__SCHEMA_NAME", "not an identifier")
    with pytest.raises(SystemExit, match="pass --schema"):
        main(["status", "--dsn", pg_dsn])
    monkeypatch.setenv("OUTBOX_DATABASE__SCHEMA_NAME", "outbox")
    assert main(["status", "--dsn", pg_dsn]) == 0


def test_the_checker_takes_the_database_url_as_the_other_commands_do(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its --help said --dsn defaults to OUTBOX_DATABASE_URL; it failed "database: Field
    required", or with OUTBOX_DATABASE__DSN set as well, worked on that other database."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pg_dsn)
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://postgres@127.0.0.1:1/elsewhere")
    assert main(["checker", "--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["due"] == 0


@pytest.mark.parametrize("command", [["status"], ["records"], ["schema-version"], ["migrate"]])
def test_a_database_that_never_answers_fails_at_the_connect_timeout_naming_it(
    silent_database: int,
    command: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They waited for ever: at 3 a.m., `outboxctl status` printed nothing and never ended."""
    monkeypatch.setenv("OUTBOX_DATABASE__CONNECT_TIMEOUT_S", "1")
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    dsn = f"postgresql://postgres@127.0.0.1:{silent_database}/app"
    result: list[int] = []
    worker = threading.Thread(
        target=lambda: result.append(main([*command, "--dsn", dsn, "--schema", "outbox"])),
        daemon=True,  # a hang stays there, not in pytest
    )
    started = time.monotonic()
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), f"outboxctl {command[0]} waited past 30 s"
    assert result == [1]
    assert time.monotonic() - started < 15
    assert f"cannot connect to 127.0.0.1:{silent_database}/app" in capsys.readouterr().err


def test_a_connection_failure_names_a_service_not_a_guessed_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "cannot connect to localhost:5432/(default)" of `service=nosuch`."""
    assert main(["status", "--dsn", "service=nosuch", "--schema", "outbox"]) == 1
    assert "cannot connect to service nosuch" in capsys.readouterr().err


def test_settings_errors_are_one_line_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "database: Field required" in err
    assert "OUTBOX_DATABASE__DSN" in err
    assert "pydantic.dev" not in err
    assert "SidecarSettings" not in err


@pytest.mark.parametrize("command", [["status"], ["records"]])
def test_a_schema_without_an_outbox_is_said_not_a_sql_error(
    pg_dsn: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--dsn", pg_dsn, "--schema", "nope"]) == 1
    err = capsys.readouterr().err
    assert "run `outboxctl migrate --schema nope`" in err
    assert "LINE 1" not in err


def test_status_lists_every_state_and_writes_iso_times(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A state with no record was left out (states["parked"]: KeyError), and times were
    written as Python's str(), with a space."""
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, "t", "v")
    assert main(["status", "--dsn", pg_dsn, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["states"] == {s.value: int(s is State.COMMITTED) for s in State}
    assert "T" in status["oldest_undelivered"]
    assert main(["status", "--dsn", pg_dsn]) == 0
    out = capsys.readouterr().out
    assert "  parked" in out
    assert "{" not in out  # a table, not a Python dict


def test_status_says_how_old_the_backlog_is_and_which_leases_lapsed(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lease its relay no longer renews (killed, stuck) printed as any other, and the oldest
    commit as a time in the session's zone: an operator had to work out both by hand."""
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            outbox.publish(conn, "t", "v")
            conn.execute(
                "UPDATE outbox.outbox_record SET commit_ts = now() - interval '90 seconds'"
                " WHERE state = 'committed'"
            )
        conn.execute("DELETE FROM outbox.shard_lease")
        conn.execute(
            "INSERT INTO outbox.shard_lease (shard, owner, epoch, lease_until) VALUES"
            " (0, 'gone', 3, now() - interval '1 minute'), (1, 'alive', 4, now() + interval"
            " '1 minute'), (2, NULL, 0, NULL)"
        )
        conn.commit()
    assert main(["status", "--dsn", pg_dsn, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert 90 <= status["oldest_undelivered_age_s"] < 150
    assert [(lease["owner"], lease["expired"]) for lease in status["leases"]] == [
        ("gone", True),
        ("alive", False),
        (None, None),  # never held: nothing to expire
    ]
    assert main(["status", "--dsn", pg_dsn]) == 0
    out = capsys.readouterr().out
    assert re.search(r"oldest undelivered commit: \S+ \S+Z \((9\d|1[0-4]\d) s ago\)", out)
    gone, alive, free = (line for line in out.splitlines() if line.startswith("shard "))
    assert gone.startswith("shard 0: owner gone epoch 3 until ")
    assert "(expired: no relay renews it)" in gone
    assert "expired" not in alive
    assert free.startswith("shard 2: owner - epoch 0 until -;")


def test_a_reader_gone_is_no_traceback() -> None:
    """`outboxctl grants ... | head -1` ended in a BrokenPipeError's traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "grants", "--schema", "outbox", "--writer-role",
         "w", "--relay-role", "r", "--reconciler-role", "c"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # gone before anything was written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert b"Traceback" not in err


def test_grants_refuses_an_empty_role_name(capsys: pytest.CaptureFixture[str]) -> None:
    """It printed GRANT ... TO "", which Postgres refuses."""
    with pytest.raises(SystemExit) as exited:
        main(["grants", "--writer-role", "", "--relay-role", "r", "--reconciler-role", "c"])
    assert exited.value.code == 2
    assert "must not be empty" in capsys.readouterr().err


def test_records_says_when_the_limit_cut_the_list(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [outbox.Record("t", str(i)) for i in range(3)])
    assert main(["records", "--dsn", pg_dsn, "--limit", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(the oldest 2; --limit for more)"
    assert main(["records", "--dsn", pg_dsn, "--limit", "3"]) == 0
    assert "--limit for more" not in capsys.readouterr().out


def test_records_shows_which_discarded_records_the_relay_has_taken_to_ship(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rearm` and `resolve` refuse a discarded record the relay has taken to ship, and the
    listing an operator looks at next showed nothing of it."""
    from tests.fixtures.relay import discarded, taken_to_ship

    taken, left = discarded(pg_dsn, "t", "taken"), discarded(pg_dsn, "t", "left")
    taken_to_ship(pg_dsn, taken.tx_id)  # at 2026-01-02 03:04:05Z
    assert main(["records", "--dsn", pg_dsn, "--state", "discarded"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("(taken by the relay to ship since 2026-01-02 03:04:05Z)")
    assert "taken by the relay" not in lines[1]
    assert main(["records", "--dsn", pg_dsn, "--state", "discarded", "--json"]) == 0
    shown = {r["tx_id"]: r["shipping_since"] for r in json.loads(capsys.readouterr().out)}
    assert shown == {taken.tx_id: "2026-01-02T03:04:05+00:00", left.tx_id: None}


def test_the_reconciliation_on_a_schema_not_migrated_fails_before_spark_starts(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found inside the first micro-batch, after Spark had read the whole horizon from
    Kafka, in Postgres's words alone (found by a review of the job)."""
    from spark import job

    def spark_started(*_: object) -> None:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(job, "build_session", spark_started)
    argv = ["reconcile", "--dsn", pg_dsn, "--schema", "not_migrated", "--bootstrap", "k:9092"]
    argv += ["--topics", "a", "--checkpoint", str(tmp_path / "cp"), "--once"]
    assert main(argv) == 1
    said = capsys.readouterr().err
    assert "schema 'not_migrated' has no reconciliation tables: run `outboxctl migrate`" in said
    role = f"no_ledger_{uuid.uuid4().hex[:8]}"  # roles are the cluster's: one of its own
    with psycopg.connect(pg_dsn) as conn:  # a role that may not read the ledger: said too
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA outbox TO {role}")
    refused = psycopg.conninfo.make_conninfo(pg_dsn, user=role)
    argv[argv.index(pg_dsn)] = refused
    argv[argv.index("not_migrated")] = "outbox"
    try:
        assert main(argv) == 1
        assert "permission denied for table outbox_record" in capsys.readouterr().err
    finally:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
