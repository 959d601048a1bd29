"""`outboxctl rearm | resolve | redrive | checker` against the real Postgres (and a real
check endpoint)."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import outbox
from checker import Checker, CheckerSettings, ManualResult, rearm
from outbox.checkback import CheckHandler, CheckRequest, TransactionStatus, serve
from outbox.migrations import latest_version
from relay.cli import main

SECRET = "whsec_" + base64.b64encode(b"c" * 32).decode()
GROUP = "billing"


def prepare(dsn: str, *, check_immunity: float | None = None) -> str:
    with psycopg.connect(dsn) as conn, conn.transaction():
        written = outbox.prepare(
            conn, "billing.charged", {"id": 1}, producer_group=GROUP, check_immunity=check_immunity
        )
    return written.tx_id


def discard(dsn: str, tx_id: str) -> None:
    """Discarded by a checker at max age (so: with a reason, audited, not shipped)."""
    s = CheckerSettings(endpoints={})
    with Checker(s, dsn, clock=lambda: datetime.now(UTC) + timedelta(hours=73)) as checker:
        assert checker.run_once().discarded >= 1
    assert state(dsn, tx_id) == "discarded"


def state(dsn: str, tx_id: str) -> str:
    with psycopg.connect(dsn) as conn:
        found = {
            r[0]
            for r in conn.execute(
                "SELECT state FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,)
            )
        }
    assert len(found) == 1
    return found.pop()


def last_audit(dsn: str, tx_id: str) -> tuple[str, str, dict[str, object]]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT actor, action, detail FROM outbox.audit_log WHERE tx_id = %s"
            " ORDER BY id DESC LIMIT 1",
            (tx_id,),
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_rearm_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    tx_id = prepare(pg_dsn)
    discard(pg_dsn, tx_id)
    argv = ["rearm", "--dsn", pg_dsn, "--producer-group", GROUP, "--tx-id", tx_id]
    code = main([*argv, "--checks", "3", "--actor", "carol", "--reason", "fixed", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["action"], printed["to_state"], printed["check_count"]) == (
        "rearm",
        "prepared",
        3,
    )
    assert state(pg_dsn, tx_id) == "prepared"
    assert last_audit(pg_dsn, tx_id)[:2] == ("carol", "rearm")

    # again: it is prepared now, so there is nothing to re-arm
    assert main([*argv, "--actor", "carol"]) == 1
    err = capsys.readouterr().err
    assert "cannot re-arm" in err
    assert "prepared" in err


def test_rearm_without_an_actor_where_the_uid_has_no_name_says_to_give_one(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's arbitrary uid has no passwd entry: getpass raised a bare KeyError."""
    tx_id = prepare(pg_dsn)
    discard(pg_dsn, tx_id)
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("LOGNAME", raising=False)
    monkeypatch.delenv("LNAME", raising=False)
    monkeypatch.delenv("USERNAME", raising=False)
    monkeypatch.setattr("os.getuid", lambda: 2_000_000_017)  # no passwd entry
    argv = ["rearm", "--dsn", pg_dsn, "--producer-group", GROUP, "--tx-id", tx_id]
    assert main(argv) == 2
    assert "--actor: no user name to record" in capsys.readouterr().err
    assert state(pg_dsn, tx_id) == "discarded"


def test_rearm_is_due_by_the_databases_clock_not_the_operators_host(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checker schedules by the database's clock: a re-arm stamped by a host 40 minutes
    behind was past a 30-minute maximum age at once, and discarded again unasked."""
    import checker._manual

    class Behind(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) - timedelta(minutes=40)

    monkeypatch.setattr(checker._manual, "datetime", Behind, raising=False)
    tx_id = prepare(pg_dsn)
    discard(pg_dsn, tx_id)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        result = rearm(conn, GROUP, tx_id, actor="carol")
        db_now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    assert result.next_check_at is not None
    assert abs(result.next_check_at - db_now) < timedelta(minutes=1)


def test_rearm_with_checks_says_which_max_checks_discard_it_again(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for checks, warned in (("3", True), ("0", False)):
        tx_id = prepare(pg_dsn)
        discard(pg_dsn, tx_id)
        argv = ["rearm", "--dsn", pg_dsn, "--producer-group", GROUP, "--tx-id", tx_id]
        assert main([*argv, "--checks", checks, "--actor", "carol"]) == 0
        out = capsys.readouterr().out
        assert f"check count {checks}, due now" in out
        warning = "a checker whose max_checks is 3 or less discards it again unasked"
        assert (warning in out) is warned


def parked(
    dsn: str, topic: str = "billing.charged", second_topic: str | None = None
) -> tuple[str, str, int, int]:
    """A transaction of two records as the relay leaves them parked (reason, marker out)."""
    topics = (topic, second_topic or topic)
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            written = outbox.publish_many(
                conn, [outbox.Record(t, n, key="k") for n, t in enumerate(topics)]
            )
        conn.execute(
            "UPDATE outbox.outbox_record SET state = 'parked', ended_at = now(),"
            " reason = 'refused by the broker: Broker: Topic authorization failed'"
            " WHERE tx_id = %s",
            (written.tx_id,),
        )
        conn.commit()
    first, second = written.ids
    return written.producer_group, written.tx_id, first, second


def test_resolve_commit_of_a_parked_transaction_points_to_redrive(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parked records count as committed, and the answer was "already committed: nothing to
    do", exit 0, to an operator trying to get them out."""
    group, tx_id, _, _ = parked(pg_dsn)
    argv = ["resolve", "--dsn", pg_dsn, "--producer-group", group, "--tx-id", tx_id, "--commit"]
    assert main([*argv, "--actor", "dave", "--reason", "paid"]) == 0
    out = capsys.readouterr().out
    assert "already committed, but parked" in out
    assert "`outboxctl redrive` sends it again" in out
    assert state(pg_dsn, tx_id) == "parked"


def test_redrive_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    group, tx_id, first, second = parked(pg_dsn)
    argv = ["redrive", "--dsn", pg_dsn, "--producer-group", group, "--tx-id", tx_id]
    who = ["--actor", "erin", "--reason", "ACL granted"]
    assert main([*argv, "--id", str(second + 1), *who]) == 1  # not one of its records
    assert f"record(s) [{second + 1}] are not among its parked ones" in capsys.readouterr().err
    assert state(pg_dsn, tx_id) == "parked"  # nothing changed

    xids = "SELECT committed_xid::text::bigint FROM outbox.outbox_record WHERE id = %s"
    with psycopg.connect(pg_dsn) as conn:
        (xid_before,) = conn.execute(xids, (first,)).fetchone()  # type: ignore[misc]
    assert main([*argv, "--id", str(first), *who, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["action"], printed["record_ids"], printed["to_state"]) == (
        "redrive",
        [first],
        "committed",
    )
    with psycopg.connect(pg_dsn) as conn:
        got = conn.execute(
            "SELECT id, state, reason, ended_at IS NULL, committed_xid IS NOT NULL"
            " FROM outbox.outbox_record WHERE tx_id = %s ORDER BY id",
            (tx_id,),
        ).fetchall()
        (xid_after,) = conn.execute(xids, (first,)).fetchone()  # type: ignore[misc]
    assert got[0] == (first, "committed", None, True, True)
    assert xid_after > xid_before  # as if committed now: after what the relay has seen
    assert got[1][:2] == (second, "parked")
    actor, action, detail = last_audit(pg_dsn, tx_id)
    assert (actor, action, detail["record_ids"]) == ("erin", "redrive", [first])
    assert "authorization" in str(detail["parked_for"])

    assert main([*argv, *who]) == 0  # the rest of the transaction's parked records
    assert "1 record(s) parked -> committed" in capsys.readouterr().out
    assert main([*argv, *who]) == 1  # nothing parked is left
    assert "none of its records is parked (they are committed)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an audited action says who and why
        main(["redrive", "--dsn", pg_dsn, "--producer-group", group, "--tx-id", tx_id])
    assert "--actor" in capsys.readouterr().err


def test_redrive_of_a_topic_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every record parked for one topic (once it exists, say), transaction by transaction."""
    _, first_tx, *_ = parked(pg_dsn, "billing.missing")
    _, second_tx, *_ = parked(pg_dsn, "billing.missing")
    _, other_tx, *_ = parked(pg_dsn, "billing.other")
    _, mixed_tx, mixed_missing, mixed_other = parked(pg_dsn, "billing.missing", "billing.other")
    argv = ["redrive", "--dsn", pg_dsn, "--actor", "erin", "--reason", "topic created"]
    assert main([*argv, "--topic", "billing.missing", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert [(d["tx_id"], len(d["record_ids"])) for d in done] == [
        (first_tx, 2),
        (second_tx, 2),
        (mixed_tx, 1),
    ]
    assert done[2]["record_ids"] == [mixed_missing]  # its record of the other topic stays
    with psycopg.connect(pg_dsn) as conn:
        (still,) = conn.execute(
            "SELECT state FROM outbox.outbox_record WHERE id = %s", (mixed_other,)
        ).fetchone()  # type: ignore[misc]
    assert still == "parked"
    assert (state(pg_dsn, first_tx), state(pg_dsn, second_tx)) == ("committed", "committed")
    assert state(pg_dsn, other_tx) == "parked"
    assert last_audit(pg_dsn, second_tx)[:2] == ("erin", "redrive")  # one audit row a transaction
    assert main([*argv, "--topic", "billing.missing"]) == 0
    assert capsys.readouterr().out == "no record is parked for topic billing.missing\n"
    assert main([*argv, "--topic", "billing.other", "--tx-id", other_tx]) == 2
    assert "--topic goes alone" in capsys.readouterr().err
    assert main(argv) == 2
    assert "give --producer-group and --tx-id, or --topic" in capsys.readouterr().err
    assert main([*argv, "--topic", "billing other"]) == 2  # no record can have it
    assert "topic 'billing other' is invalid" in capsys.readouterr().err
    assert state(pg_dsn, other_tx) == "parked"


def rows_of(dsn: str, tx_id: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (int(r[0]), str(r[1]))
            for r in conn.execute(
                "SELECT id, state FROM outbox.outbox_record WHERE tx_id = %s ORDER BY id",
                (tx_id,),
            )
        ]


def not_shipped_yet(dsn: str, record_id: int) -> None:
    """Parked, its dead-letter copy and op marker not out yet (the relay's next round's)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE outbox.outbox_record SET ended_at = NULL WHERE id = %s", (record_id,))


def test_drop_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Parked records given up on: removed once their dead-letter copy is out, audited; they
    stayed for good before (the archive's trim keeps parked rows)."""
    group, tx_id, first, second = parked(pg_dsn)
    not_shipped_yet(pg_dsn, second)
    argv = ["drop", "--dsn", pg_dsn, "--producer-group", group, "--tx-id", tx_id]
    who = ["--actor", "erin", "--reason", "topic retired"]
    assert main([*argv, *who]) == 1  # all of them: one is not on the dead-letter topic yet
    assert f"record(s) [{second}] are not on the dead-letter topic yet" in capsys.readouterr().err
    assert main([*argv, "--id", str(second + 1), *who]) == 1
    assert f"record(s) [{second + 1}] are not among its parked ones" in capsys.readouterr().err
    assert rows_of(pg_dsn, tx_id) == [(first, "parked"), (second, "parked")]  # nothing changed

    assert main([*argv, "--id", str(first), *who, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["action"], printed["record_ids"], printed["to_state"]) == (
        "drop",
        [first],
        "dropped",
    )
    assert rows_of(pg_dsn, tx_id) == [(second, "parked")]
    actor, action, detail = last_audit(pg_dsn, tx_id)
    assert (actor, action, detail["record_ids"]) == ("erin", "drop", [first])
    assert detail["topics"] == {str(first): "billing.charged"}
    assert "authorization" in str(detail["parked_for"])
    assert detail["value_bytes"] == {str(first): 1}  # the value's size: it went with the row

    with psycopg.connect(pg_dsn) as conn:  # the relay ships its copy
        conn.execute("UPDATE outbox.outbox_record SET ended_at = now() WHERE id = %s", (second,))
    assert main([*argv, *who]) == 0
    assert "1 record(s) parked -> dropped" in capsys.readouterr().out
    assert rows_of(pg_dsn, tx_id) == []
    assert main([*argv, *who]) == 1  # nothing is left
    assert "no records of tx id" in capsys.readouterr().err


def test_drop_of_a_topic_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every record parked for a topic whose dead-letter copy is out, transaction by
    transaction; those the relay has not shipped yet, and other topics' records, stay."""
    group, first_tx, *first_ids = parked(pg_dsn, "billing.retired")
    _, partly_tx, shipped, waiting = parked(pg_dsn, "billing.retired")
    not_shipped_yet(pg_dsn, waiting)
    _, other_tx, *_ = parked(pg_dsn, "billing.other")
    _, mixed_tx, mixed_retired, mixed_other = parked(pg_dsn, "billing.retired", "billing.other")
    argv = ["drop", "--dsn", pg_dsn, "--actor", "erin", "--reason", "topic retired"]
    # says, changes nothing; 1: one record waits for its copy, not droppable yet
    assert main([*argv, "--topic", "billing.retired", "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert f"tx {first_tx} of producer group {group}: would drop 2 parked record(s)" in out
    assert (
        f"tx {partly_tx} of producer group {group}: would drop 1 parked record(s): {shipped} "
        in out
    )
    assert "1 record(s) parked for topic billing.retired wait for their dead-letter copy" in err
    assert rows_of(pg_dsn, first_tx) == [(i, "parked") for i in first_ids]
    assert main([*argv, "--topic", "billing.retired", "--json"]) == 1  # not all: the one waits
    done = json.loads(capsys.readouterr().out)
    assert [(d["tx_id"], d["record_ids"]) for d in done] == [
        (first_tx, first_ids),
        (partly_tx, [shipped]),
        (mixed_tx, [mixed_retired]),
    ]
    assert rows_of(pg_dsn, first_tx) == []
    assert rows_of(pg_dsn, partly_tx) == [(waiting, "parked")]
    assert rows_of(pg_dsn, mixed_tx) == [(mixed_other, "parked")]
    assert state(pg_dsn, other_tx) == "parked"
    assert main([*argv, "--topic", "billing.retired"]) == 1  # only the one not shipped is left
    out, err = capsys.readouterr()
    assert out == ""
    assert "1 record(s) parked for topic billing.retired wait for their dead-letter copy" in err
    assert rows_of(pg_dsn, partly_tx) == [(waiting, "parked")]
    with psycopg.connect(pg_dsn) as conn:  # its copy is out now
        conn.execute("UPDATE outbox.outbox_record SET ended_at = now() WHERE id = %s", (waiting,))
    assert main([*argv, "--topic", "billing.retired"]) == 0  # all done
    assert rows_of(pg_dsn, partly_tx) == []
    assert main([*argv, "--topic", "billing.other", "--id", "1"]) == 2
    assert "outboxctl drop: --topic goes alone" in capsys.readouterr().err


def test_records_lists_what_is_asked_without_values(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    group, tx_id, first, second = parked(pg_dsn)
    prepared_tx = prepare(pg_dsn)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        binary = outbox.publish(conn, "billing.charged", b"\x00secret", key=b"\xff\x01")

    def records(*argv: str) -> list[dict[str, object]]:
        assert main(["records", "--dsn", pg_dsn, "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    found = records("--state", "parked", "--producer-group", group, "--tx-id", tx_id)
    assert [r["id"] for r in found] == [first, second]
    assert all(r["reason"] and "value" not in r for r in found)
    assert [r["value_bytes"] for r in found] == [1, 1]  # the JSON values 1 and 2
    assert [r["tx_id"] for r in records("--state", "prepared", "--producer-group", GROUP)] == [
        prepared_tx
    ]
    assert len(records("--tx-id", tx_id, "--limit", "1")) == 1
    # cut: a script reading the JSON is told on stderr (it counted 1 of 2 unaware)
    assert main(["records", "--dsn", pg_dsn, "--json", "--tx-id", tx_id, "--limit", "1"]) == 0
    cut = capsys.readouterr()
    assert len(json.loads(cut.out)) == 1
    assert "the oldest 1 only; --limit for more" in cut.err
    assert main(["records", "--dsn", pg_dsn, "--json", "--tx-id", tx_id, "--limit", "2"]) == 0
    assert capsys.readouterr().err == ""

    assert main(["records", "--dsn", pg_dsn, "--tx-id", tx_id]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2
    assert all("parked" in line and "Topic authorization failed" in line for line in table)
    # in UTC, said so, whatever the session's time zone (it printed that zone's wall time)
    kathmandu = make_conninfo(pg_dsn, options="-c TimeZone=Asia/Kathmandu")
    assert main(["records", "--dsn", kathmandu, "--tx-id", tx_id]) == 0
    assert capsys.readouterr().out.splitlines() == table
    with psycopg.connect(pg_dsn) as conn:
        created = conn.execute(
            "SELECT min(created_at) FROM outbox.outbox_record WHERE tx_id = %s", (tx_id,)
        ).fetchone()[0]  # type: ignore[index]
    assert f"{created.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z" in table[0]
    assert (
        main(["records", "--dsn", pg_dsn, "--topic", "billing.charged", "--state", "committed"])
        == 0
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[0] == str(binary))
    assert "key base64:/wE=" in line
    assert "secret" not in line
    assert main(["records", "--dsn", pg_dsn, "--producer-group", "nobody"]) == 0
    assert capsys.readouterr().out == "no records\n"
    assert main(["records", "--dsn", pg_dsn, "--state", "lost"]) == 2
    assert "state must be one of prepared, committed" in capsys.readouterr().err


def test_resolve_by_command(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    tx_id = prepare(pg_dsn)
    argv = ["resolve", "--dsn", pg_dsn, "--producer-group", GROUP, "--tx-id", tx_id]
    assert main([*argv, "--rollback", "--actor", "dave", "--reason", "refunded"]) == 0
    assert "prepared -> rolled_back" in capsys.readouterr().out
    assert state(pg_dsn, tx_id) == "rolled_back"
    actor, action, detail = last_audit(pg_dsn, tx_id)
    assert (actor, action, detail["decision"], detail["reason"]) == (
        "dave",
        "resolve",
        "ROLLBACK",
        "refunded",
    )
    assert main([*argv, "--commit", "--actor", "dave", "--reason", "oops"]) == 1
    assert "cannot commit" in capsys.readouterr().err
    assert main([*argv, "--commit", "--actor", "dave", "--reason", "  "]) == 2
    assert state(pg_dsn, tx_id) == "rolled_back"
    with pytest.raises(SystemExit):  # --commit or --rollback is required
        main([*argv, "--actor", "dave", "--reason", "x"])


@pytest.fixture
def root_logging() -> Iterator[None]:
    """`outboxctl checker` configures logging for its process; give pytest its handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def checker_config(tmp_path: Path, dsn: str, url: str, relay: str = "", endpoint: str = "") -> Path:
    """A sidecar's TOML file with the checker's endpoint for GROUP at `url`."""
    config = tmp_path / "sidecar.toml"
    config.write_text(
        f"""
log_format = "text"

[database]
dsn = "{dsn}"

[relay]
{relay}

[checker.endpoints.{GROUP}]
url = "{url}"
secrets = ["{SECRET}"]
{endpoint}
"""
    )
    return config


def test_checker_once_from_a_config_file(
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    root_logging: None,
) -> None:
    asked: list[str] = []

    def resolver(request: CheckRequest) -> TransactionStatus:
        asked.append(request.tx_id)
        return TransactionStatus.COMMIT

    tx_id = prepare(pg_dsn, check_immunity=0)
    with serve(CheckHandler(resolver, [SECRET])) as server:
        config = checker_config(tmp_path, pg_dsn, server.url)
        monkeypatch.setenv("OUTBOX_CONFIG_FILE", str(config))  # restored after the test
        assert main(["checker", "--config", str(config), "--once", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outcomes"] == {"commit": 1}
    assert asked == [tx_id]
    assert state(pg_dsn, tx_id) == "committed"


def test_a_checker_still_in_its_round_after_the_grace_exits_1(
    pg_dsn: str, tmp_path: Path, root_logging: None
) -> None:
    """`outboxctl checker` exited 0 after SIGTERM with a round still asking an endpoint past
    shutdown_grace, as after a clean stop; `outboxctl run --only checker` exited 1."""
    asked, release = threading.Event(), threading.Event()

    def stuck(_request: CheckRequest) -> TransactionStatus:
        asked.set()
        release.wait(30)
        return TransactionStatus.COMMIT

    prepare(pg_dsn, check_immunity=0)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def terminate_while_asked() -> None:
        if asked.wait(60):
            os.kill(os.getpid(), signal.SIGTERM)

    with serve(CheckHandler(stuck, [SECRET])) as server:
        config = checker_config(
            tmp_path,
            pg_dsn,
            server.url,
            relay='shutdown_grace = "PT1S"',
            endpoint='timeout = "PT20S"',
        )
        threading.Thread(target=terminate_while_asked, daemon=True).start()
        try:
            status = main(["checker", "--config", str(config)])
        finally:
            release.set()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    assert asked.is_set()
    assert status == 1


def test_checker_schema_option_wins_over_the_config_file_even_when_it_says_outbox(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--schema outbox` was taken for the option's default, and the file's schema won."""
    config = tmp_path / "sidecar.toml"
    config.write_text(f'[database]\ndsn = "{pg_dsn}"\nschema_name = "not_migrated"\n')
    assert main(["checker", "--config", str(config), "--once", "--json"]) == 1
    assert "not_migrated" in capsys.readouterr().err
    assert main(["checker", "--config", str(config), "--once", "--json", "--schema", "outbox"]) == 0
    assert json.loads(capsys.readouterr().out)["due"] == 0


def test_outboxctl_finds_the_database_where_the_sidecar_does(
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In the sidecar's container (`kubectl exec ... -- outboxctl status`) the DSN is a mounted
    secret file, not --dsn."""
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    monkeypatch.delenv("OUTBOX_DATABASE__DSN", raising=False)
    monkeypatch.delenv("OUTBOX_CONFIG_FILE", raising=False)
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="outbox_database__dsn in OUTBOX_SECRETS_DIR"):
        main(["status", "--json"])
    (tmp_path / "outbox_database__dsn").write_text(pg_dsn)
    assert main(["status", "--json"]) == 0
    assert "states" in json.loads(capsys.readouterr().out)
    # the repair commands too (they said "no database" where status worked)
    assert main(["rearm", "--producer-group", "g", "--tx-id", "no-such-tx", "--actor", "a"]) == 1
    assert "no-such-tx" in capsys.readouterr().err  # asked the database, which has none
    # and its schema: the sidecar's, not a default it does not use
    monkeypatch.setenv("OUTBOX_DATABASE__SCHEMA_NAME", "elsewhere")
    assert main(["schema-version", "--json"]) == 1  # that schema is not migrated
    report = json.loads(capsys.readouterr().out)
    assert (report["schema"], report["version"], report["latest"]) == (
        "elsewhere",
        None,
        latest_version(),
    )
    assert "run `outboxctl migrate --schema elsewhere`" in report["problem"]


def test_migrate_in_the_charts_hook_finds_the_database_beside_a_checker_secret(
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The migration Job mounts the Secret alone (its hook runs before the ConfigMap exists).
    A checker endpoint's signing secret there, without the endpoint's url from the config,
    failed the whole sidecar's settings: "no database", and every install or upgrade."""
    for name in ("OUTBOX_DATABASE_URL", "OUTBOX_DATABASE__DSN", "OUTBOX_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    (tmp_path / f"outbox_checker__endpoints__{GROUP}__secrets").write_text(f'["{SECRET}"]')
    with pytest.raises(SystemExit, match=r"no database.*outbox_database__dsn"):  # what is missing
        main(["migrate", "--schema", "hooked"])
    (tmp_path / "outbox_database__dsn").write_text(pg_dsn)
    assert main(["migrate", "--schema", "hooked"]) == 0
    assert "hooked" in capsys.readouterr().out


@pytest.mark.parametrize("as_json", [False, True])
def test_redrive_of_a_topic_stopped_by_a_busy_transaction_says_which_went_before(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    """Another session holds the second transaction's rows (a checker claiming them, say): the
    command stops there, and the operator sees that the first one is redriven already."""
    _, first_tx, *_ = parked(pg_dsn, "billing.missing")
    _, busy_tx, *_ = parked(pg_dsn, "billing.missing")
    argv = ["redrive", "--dsn", pg_dsn, "--topic", "billing.missing", "--actor", "erin"]
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(
            "SELECT id FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (busy_tx,)
        )
        code = main([*argv, "--reason", "topic created", *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert code == 1
    assert busy_tx in err
    if as_json:
        assert [d["tx_id"] for d in json.loads(out)] == [first_tx]
    else:
        assert out.startswith(f"tx {first_tx} of producer group")
        assert busy_tx not in out
    assert (state(pg_dsn, first_tx), state(pg_dsn, busy_tx)) == ("committed", "parked")


@pytest.mark.parametrize("command", [["redrive"], ["drop"], ["drop", "--dry-run"]], ids=" ".join)
def test_a_topics_run_whose_reader_went_away_stops_and_says_so(
    pg_dsn: str, command: list[str]
) -> None:
    """`outboxctl redrive --topic X | head -1`: it stopped at the first line it could not
    write, exit 1, and said nothing; the operator took the line shown for all that was done.
    Each line goes out as its transaction is done, so the stop comes at the next one."""
    (_, first, *_), (_, second, *_), (_, third, *_) = (
        parked(pg_dsn, "billing.missing") for _ in range(3)
    )
    holder = psycopg.connect(pg_dsn)
    holder.execute("SELECT id FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (second,))
    argv = ["--dsn", pg_dsn, "--topic", "billing.missing", "--actor", "erin", "--reason", "r"]
    with subprocess.Popen(
        [sys.executable, "-m", "relay.cli", *command, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        try:
            assert proc.stdout.readline().startswith(f"tx {first} of producer group")
            proc.stdout.close()  # the reader goes away while the second one waits for its lock
            holder.close()
            err = proc.stderr.read()
            assert proc.wait(30) == 1
        finally:
            holder.close()
            if proc.poll() is None:
                proc.kill()
    done = {"redrive": "redriven", "drop": "dropped"}[command[0]]
    if "--dry-run" in command:
        said = "stopped after listing topic billing.missing's transactions, not all shown; "
        assert f"{said}nothing dropped (dry run)" in err
    else:
        assert f"stopped after 2 transaction(s) of topic billing.missing {done}" in err
    assert "Traceback" not in err
    left = (
        "parked" if "--dry-run" in command else {"redrive": "committed", "drop": None}[command[0]]
    )
    for tx_id in (first, second):
        assert {s for _, s in rows_of(pg_dsn, tx_id)} == ({left} if left else set())
    assert state(pg_dsn, third) == "parked"  # untouched


def test_records_parked_for_a_kafka_internal_topic_are_dropped_by_topic_not_redriven(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library refuses Kafka's own topics for new records; a row written before that (or
    by another writer) names one, and `--topic` refused it: out of reach of `drop --topic`."""
    _, tx_id, *_ = parked(pg_dsn, "billing.missing")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE outbox.outbox_record SET topic = '__consumer_offsets' WHERE tx_id = %s",
            (tx_id,),
        )
    argv = ["--dsn", pg_dsn, "--topic", "__consumer_offsets", "--actor", "erin", "--reason", "r"]
    assert main(["redrive", *argv]) == 2  # the broker takes nothing there: parked again
    assert "`outboxctl drop --topic` removes them" in capsys.readouterr().err
    assert state(pg_dsn, tx_id) == "parked"
    assert main(["drop", *argv]) == 0
    assert capsys.readouterr().out.startswith(f"tx {tx_id} of producer group")
    assert rows_of(pg_dsn, tx_id) == []


def test_a_topics_run_shows_a_stored_tx_id_with_its_control_characters_escaped(
    pg_dsn: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A tx id written by another writer (SQL) with a terminal escape or a newline in it: said
    as it was, it could fake lines of the run's output, and of its log."""
    _, tx_id, *_ = parked(pg_dsn, "billing.missing")
    odd = "a\nb\x1b[2J"
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("UPDATE outbox.outbox_record SET tx_id = %s WHERE tx_id = %s", (odd, tx_id))
    argv = ["--dsn", pg_dsn, "--topic", "billing.missing", "--actor", "erin", "--reason", "r"]
    with caplog.at_level(logging.INFO, logger="checker._manual"):
        assert main(["redrive", *argv]) == 0
    logged = [r.getMessage() for r in caplog.records if r.name == "checker._manual"]
    assert logged
    assert all("a\\nb\\x1b[2J" in m and "\x1b" not in m for m in logged)
    out = capsys.readouterr().out
    assert out.startswith("tx a\\nb\\x1b[2J of producer group")
    assert out.count("\n") == 1
    assert "\x1b" not in out
    assert state(pg_dsn, odd) == "committed"


def test_redrive_of_a_topic_waits_out_a_moments_lock_and_passes_one_redriven_meanwhile(
    pg_dsn: str,
) -> None:
    """The relay locks parked rows for a moment while it parks or ends them, and another
    operator may redrive one: either stopped the whole topic's run with exit 1."""
    from checker import redrive, redrive_topic

    (group, first, *_), (_, busy, *_), (_, taken, *_), (_, gone, *_) = (
        parked(pg_dsn, "billing.missing") for _ in range(4)
    )
    fix = {"actor": "erin", "reason": "topic created"}
    other = psycopg.connect(pg_dsn, autocommit=True)

    def another_operator(result: ManualResult) -> None:
        if result.tx_id != first:
            return
        # read in this run's page already, redriven before it reaches them; one delivered
        # and gone already
        redrive(other, group, taken, **fix)
        redrive(other, group, gone, **fix)
        other.execute("DELETE FROM outbox.outbox_record WHERE tx_id = %s", (gone,))

    holder = psycopg.connect(pg_dsn)
    holder.execute("SELECT id FROM outbox.outbox_record WHERE tx_id = %s FOR UPDATE", (busy,))
    release = threading.Timer(0.3, holder.close)  # the relay's moment
    release.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            done = redrive_topic(conn, "billing.missing", **fix, on_redriven=another_operator)
    finally:
        release.join()
        other.close()
    assert [r.tx_id for r in done] == [first, busy]
    assert {state(pg_dsn, tx) for tx in (first, busy, taken)} == {"committed"}


def test_redrive_of_a_topic_reads_page_after_page_and_never_redrives_a_record_twice(
    pg_dsn: str,
) -> None:
    """It stopped after the first 1000 transactions, and said nothing. Records the relay
    parks again while it runs (the cause is not fixed) are left for the next run."""
    from checker import redrive_topic

    txs = [parked(pg_dsn, "billing.missing")[1] for _ in range(5)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        def parked_again(result: ManualResult) -> None:  # as the relay would, at once
            conn.execute(
                "UPDATE outbox.outbox_record SET state = 'parked', reason = 'again'"
                " WHERE tx_id = %s",
                (result.tx_id,),
            )

        fix = {"actor": "erin", "reason": "topic created"}
        done = redrive_topic(conn, "billing.missing", **fix, page=2, on_redriven=parked_again)
        assert [r.tx_id for r in done] == txs  # every page, each transaction once
        assert [r.tx_id for r in redrive_topic(conn, "billing.missing", **fix, limit=3)] == txs[:3]
    assert [state(pg_dsn, tx) for tx in txs] == ["committed"] * 3 + ["parked"] * 2


def test_a_transaction_parked_again_in_part_is_not_redriven_twice_by_one_run(
    pg_dsn: str,
) -> None:
    """The relay parks only its later record again (the earlier one went out): the
    transaction's first parked record is then past the page, and it came again on the next."""
    from checker import redrive_topic

    txs = [parked(pg_dsn, "billing.partly")[1] for _ in range(3)]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:

        def later_parked_again(result: ManualResult) -> None:
            conn.execute(
                "UPDATE outbox.outbox_record SET state = 'parked', reason = 'again'"
                " WHERE id = (SELECT max(id) FROM outbox.outbox_record WHERE tx_id = %s)",
                (result.tx_id,),
            )

        fix = {"actor": "erin", "reason": "topic created"}
        done = redrive_topic(conn, "billing.partly", **fix, page=1, on_redriven=later_parked_again)
    assert [r.tx_id for r in done] == txs
    assert [last_audit(pg_dsn, tx)[1] for tx in txs] == ["redrive"] * 3
    with psycopg.connect(pg_dsn) as conn:
        audited = conn.execute(
            "SELECT count(*) FROM outbox.audit_log WHERE tx_id = ANY(%s)", (txs,)
        ).fetchone()
    assert audited == (3,)


def test_parked_records_are_read_from_their_own_index_not_the_whole_table(pg_dsn: str) -> None:
    """`redrive --topic`, `drop --topic` and `records --state parked` on an outbox that keeps
    an archive of delivered rows: only the parked ones are read (migration 0005), not every
    row."""
    from outbox.sql import query

    parked(pg_dsn, "billing.missing")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            """
            INSERT INTO outbox.outbox_record
                (producer_group, tx_id, topic, key, value, key_hash, state, committed_xid,
                 ended_at, kafka_partition, kafka_offset)
            SELECT 'archive', 'tx-' || g, 'billing.missing', NULL, '1', 0, 'delivered',
                   pg_current_xact_id(), now(), 0, g
            FROM generate_series(1, 20000) AS g
            """
        )
        conn.commit()
        conn.execute("ANALYZE outbox.outbox_record")
        asked = [
            *(
                (
                    "checker_parked_of_topic",  # redrive's, and drop's: only those shipped
                    {"topic": "billing.missing", "after": 0, "limit": 1000, "shipped_only": only},
                )
                for only in (False, True)
            ),
            (
                "cli_records",
                {"state": "parked", "producer_group": None, "tx_id": None, "topic": None,
                 "limit": 50},
            ),
        ]  # fmt: skip
        for name, params in asked:
            plan = conn.execute(
                b"EXPLAIN (ANALYZE, FORMAT JSON) " + query(name, "outbox"), params
            ).fetchone()[0]  # type: ignore[index]
            text = json.dumps(plan)
            assert "outbox_record_parked_idx" in text, name
            assert "Seq Scan" not in text, name
            assert conn.execute(query(name, "outbox"), params).fetchall(), name  # it finds them


def test_a_transactions_latest_audit_entry_is_read_from_its_index(pg_dsn: str) -> None:
    """rearm, resolve and redrive look up the transaction's latest audit entry (migration 0006):
    from an index, not by reading every entry the audit retention keeps."""
    from outbox.sql import query

    tx_id = prepare(pg_dsn)
    discard(pg_dsn, tx_id)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            """
            INSERT INTO outbox.audit_log (actor, action, producer_group, tx_id)
            SELECT 'checker:old', 'discard', 'other', 'tx-' || g
            FROM generate_series(1, 20000) AS g
            """
        )
        conn.commit()
        conn.execute("ANALYZE outbox.audit_log")
        params = {"producer_group": GROUP, "tx_id": tx_id}
        plan = conn.execute(
            b"EXPLAIN (ANALYZE, FORMAT JSON) " + query("checker_discarded_ids", "outbox"), params
        ).fetchone()[0]  # type: ignore[index]
        text = json.dumps(plan)
        assert "audit_log_tx_idx" in text
        assert "Seq Scan" not in text
        [(ids,)] = conn.execute(query("checker_discarded_ids", "outbox"), params).fetchall()
    assert ids  # it finds the discard's record ids


def test_findings_of_a_schema_without_the_reconciliation_tables_is_no_usage_error(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 says the command line was wrong; a schema not migrated is a failure (1)."""
    assert main(["findings", "--dsn", pg_dsn, "--schema", "not_migrated"]) == 1
    assert "has no reconciliation tables: run `outboxctl migrate`" in capsys.readouterr().err
    assert main(["findings", "--dsn", pg_dsn, "--kind", "lost"]) == 2  # the input: still 2
    assert "unknown finding kinds" in capsys.readouterr().err


def test_findings_say_whose_they_are_when_found_and_when_the_list_was_cut(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the transaction an operator cannot go on to redrive or resolve; without when it
    was found last, a finding no judgement finds any more looked current; a list cut at
    --limit was not said to be one."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM outbox.reconciliation_finding")
        for n, days_ago in enumerate([3, 2, 1]):
            conn.execute(
                "INSERT INTO outbox.reconciliation_finding (kind, topic, outbox_id, "
                "producer_group, tx_id, event_time, detected_at, last_seen_at, detected_in)"
                " VALUES ('missing', 'billing.charged', %s, 'billing', %s,"
                " now() - make_interval(days => %s), now() - make_interval(days => %s),"
                " now() - make_interval(days => %s), 'tick')",
                (100 + n, f"tx-{n}", days_ago, days_ago, days_ago),
            )
    assert main(["findings", "--dsn", pg_dsn, "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[-1] == "(the newest 2; --limit for more)"
    assert "id 102  billing/tx-2  at -  found " in lines[0]  # the newest first
    assert ", last " in lines[0]
    assert main(["findings", "--dsn", pg_dsn, "--limit", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [f["tx_id"] for f in json.loads(out)] == ["tx-2", "tx-1"]
    assert "the newest 2 only" in err
    assert main(["findings", "--dsn", pg_dsn, "--limit", "3", "--json"]) == 0
    assert capsys.readouterr().err == ""  # all of them: nothing cut
    since = (datetime.now(UTC) - timedelta(days=2, hours=1)).replace(tzinfo=None).isoformat()
    assert main(["findings", "--dsn", pg_dsn, "--since", since, "--json"]) == 0  # UTC
    assert [f["tx_id"] for f in json.loads(capsys.readouterr().out)] == ["tx-2", "tx-1"]
    with pytest.raises(SystemExit):
        main(["findings", "--dsn", pg_dsn, "--since", "yesterday"])
    assert "'yesterday' is not an ISO 8601 time" in capsys.readouterr().err


def test_redrive_of_a_topic_on_a_connection_not_in_autocommit_commits_each_as_it_says(
    pg_dsn: str,
) -> None:
    """Its first page's read began a transaction, and every redrive joined it as a savepoint:
    each reported done, none committed; the connection closed without a commit (lost, or a
    caller that did not know to commit), every one was undone."""
    from checker import redrive_topic

    txs = [parked(pg_dsn, "billing.missing")[1] for _ in range(2)]
    reported: list[str] = []
    conn = psycopg.connect(pg_dsn)  # autocommit off, psycopg's default
    try:
        redrive_topic(
            conn, "billing.missing", actor="erin", reason="topic created",
            on_redriven=lambda result: reported.append(result.tx_id),
        )  # fmt: skip
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        conn.close()  # no commit
    assert reported == txs
    assert [state(pg_dsn, tx) for tx in txs] == ["committed", "committed"]
