"""The sidecar's image, built from helm/Dockerfile (scripts/image.py), running the containers the
chart renders (their command, arguments, environment, mounts, user and security context) against
the real Postgres and Kafka: the migration hook's, then the sidecar's."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox
from tests.fixtures.helm import render
from tests.fixtures.images import Engine, mounted, until
from tests.fixtures.kafka import consume_all
from tests.fixtures.postgres import _admin, _dsn_for
from tests.fixtures.services import Services
from tests.integration.test_relay_process import free_port, get


@pytest.fixture
def empty_database(services: Services) -> Iterator[str]:
    """A database with no outbox schema: the migration hook's to make."""
    name = f"outbox_image_{uuid.uuid4().hex[:10]}"
    with _admin(services) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield _dsn_for(services.pg_dsn, name)
    with _admin(services) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def test_the_charts_containers_migrate_and_deliver_from_the_image_and_stop_on_sigterm(
    sidecar_image: tuple[Engine, str],
    helm: str,
    empty_database: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    tmp_path: Path,
) -> None:
    engine, image = sidecar_image
    port = free_port()
    values = tmp_path / "values.yaml"
    values.write_text(
        "existingSecret: orders-outbox\n"
        f"httpPort: {port}\n"
        "config: |\n"
        f'  [kafka]\n  bootstrap_servers = "{kafka_bootstrap}"\n'
        '  [relay]\n  shards = 1\n  poll_interval = "PT0.2S"\n  shutdown_grace = "PT10S"\n'
    )
    docs = {d["kind"]: d for d in render(helm, values=values)}
    volumes = {
        "outbox-config": mounted(tmp_path / "config", docs["ConfigMap"]["data"]),
        # the Secret the chart names: one file per secret setting
        "outbox-secrets": mounted(tmp_path / "secrets", {"outbox_database__dsn": empty_database}),
    }

    job = docs["Job"]["spec"]["template"]["spec"]
    (migrate,) = job["containers"]
    migrating = engine.run(image, job, migrate, volumes)
    assert migrating.wait() == 0, migrating.output()

    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (sidecar,) = pod["containers"]
    running = engine.run(image, pod, sidecar, volumes)
    until(lambda: get(port, "/readyz")[0] == 200, 90, "readiness", running)

    topic = topic_factory()
    with psycopg.connect(empty_database) as conn, conn.transaction():
        for i in range(3):
            outbox.publish(conn, topic, f"m{i}")
    until(
        lambda: len(consume_all(kafka_bootstrap, topic, "read_committed")) == 3,
        60,
        "delivery",
        running,
    )
    metrics = get(port, "/metrics")[1].decode()
    assert f'outbox_relay_records_delivered_total{{topic="{topic}"}} 3.0' in metrics

    running.stop(timeout_s=30)  # the image's STOPSIGNAL, SIGTERM, as a kubelet sends
    assert running.wait() == 0, running.output()
    assert "received SIGTERM" in running.output()
    with psycopg.connect(empty_database) as conn:  # shards handed back, not left to expire
        assert conn.execute("SELECT owner FROM outbox.shard_lease").fetchall() == [(None,)]
