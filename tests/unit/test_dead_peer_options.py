"""The TCP options that end a connection to a database gone silent (dbconnect.dead_peer_options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.dbconnect import dead_peer_options


def test_the_wait_bounds_unacknowledged_data_and_idle_keepalives() -> None:
    assert dead_peer_options("host=db dbname=app", 10) == {
        "tcp_user_timeout": 10_000,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 1,
        "keepalives_count": 3,
    }


def test_a_wait_under_a_second_is_one_second_not_none() -> None:
    # libpq's whole seconds: 0 would turn the keepalives' idle time back to the kernel's 2 hours
    options = dead_peer_options("host=db", 0.2)
    assert options["keepalives_idle"] == 1
    assert options["tcp_user_timeout"] == 1000


def test_what_the_dsn_sets_is_left_to_it() -> None:
    """An operator's own values win, in either DSN form, 0 (the kernel's) included."""
    for dsn in (
        "host=db tcp_user_timeout=0 keepalives_idle=60",
        "postgresql://db/app?tcp_user_timeout=0&keepalives_idle=60",
    ):
        options = dead_peer_options(dsn, 10)
        assert "tcp_user_timeout" not in options
        assert "keepalives_idle" not in options
        assert options["keepalives_count"] == 3


def test_what_the_named_service_file_sets_is_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libpq takes explicit options over a service file's: ours overrode an operator's
    `tcp_user_timeout=0` in pg_service.conf."""
    services = tmp_path / "pg_service.conf"
    services.write_text(
        "# the operator's\n[orders]\nhost=db\ntcp_user_timeout=0\nkeepalives_idle=300\n"
        "[other]\nkeepalives_count=9\n"
    )
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    monkeypatch.delenv("PGSERVICE", raising=False)
    options = dead_peer_options("service=orders dbname=app", 10)
    assert set(options) == {"keepalives", "keepalives_interval", "keepalives_count"}
    monkeypatch.setenv("PGSERVICE", "orders")  # named by the environment: the same
    assert set(dead_peer_options("dbname=app", 10)) == set(options)
    monkeypatch.setenv("PGSERVICE", "missing")  # libpq's error when it connects, not ours
    assert len(dead_peer_options("dbname=app", 10)) == 5


def test_a_wait_beyond_what_the_kernel_takes_is_capped() -> None:
    """Above 32767 s, TCP_KEEPIDLE is refused: every connection failed."""
    options = dead_peer_options("host=db", 100_000)
    assert options["keepalives_idle"] == 32767
    assert options["tcp_user_timeout"] == 32_767_000
