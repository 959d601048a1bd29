"""The images built from helm/Dockerfile (scripts/image.py), running the containers the chart
renders (their command, arguments, environment, mounts, user and security context) against the
real Postgres and Kafka: the migration hook's and the sidecar's, and the reconciliation's."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox
from relay.service import Relay
from tests.fixtures.helm import ROOT, render
from tests.fixtures.http import free_port, get
from tests.fixtures.images import Engine, mounted, until
from tests.fixtures.kafka import consume_all
from tests.fixtures.postgres import _admin, _dsn_for
from tests.fixtures.services import Services


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
    assert migrating.wait(timeout_s=120) == 0, migrating.output()

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
    counted = f'outbox_relay_records_delivered_total{{topic="{topic}"}} 3.0'
    # counted as the rows end, right after the Kafka commit the consumer saw
    until(lambda: counted in get(port, "/metrics")[1].decode(), 30, "the metric", running)

    running.stop(timeout_s=30)  # the image's STOPSIGNAL, SIGTERM, as a kubelet sends
    assert running.wait(timeout_s=60) == 0, running.output()
    assert "received SIGTERM" in running.output()
    with psycopg.connect(empty_database) as conn:  # shards handed back, not left to expire
        assert conn.execute("SELECT owner FROM outbox.shard_lease").fetchall() == [(None,)]


def test_the_charts_scheduled_reconciliation_runs_once_from_its_image(
    reconcile_image: tuple[Engine, str],
    helm: str,
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Relay],
    tmp_path: Path,
) -> None:
    """The reconcile image's Python, Java and connector jars, with the chart's arguments, its
    Secret's DSN, its read-only root and its two writable mounts (the checkpoint's claim and
    the emptyDir at /tmp): one run over records the real relay delivered, none of them amiss."""
    engine, image = reconcile_image
    orders, markers, dead_letters = topic_factory(), topic_factory(), topic_factory()
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(5):
            outbox.publish(conn, orders, f"order {i}", key=f"k{i}")
    relay = relay_factory(op_marker_topic=markers, delivered_retention="PT1H")
    delivered, deadline = 0, time.monotonic() + 60
    while delivered < 5:  # another test's transaction may hold the xid horizon a moment
        assert time.monotonic() < deadline, f"the relay delivered {delivered} of 5"
        delivered += relay.run_once().delivered

    docs = render(
        helm,
        "existingSecret=orders-outbox",
        "reconcile.enabled=true",
        "reconcile.mode=schedule",
        "reconcile.existingSecret=orders-reconciler",
        f"reconcile.bootstrapServers={kafka_bootstrap}",
        f"reconcile.topics={orders}",
        f"reconcile.markerTopic={markers}",
        f"reconcile.deadLetterTopic={dead_letters}",
        "reconcile.deadline=1s",  # judged at once: Spark's start alone takes longer
        "reconcile.master=local[1]",
    )
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    owner = pod["securityContext"]["fsGroup"]
    volumes = {
        "checkpoint": mounted(tmp_path / "checkpoint", owner=owner),
        "tmp": mounted(tmp_path / "tmp", owner=owner),
    }
    run = engine.run(image, pod, container, volumes, {("orders-reconciler", "dsn"): pg_dsn})
    assert run.wait(timeout_s=300) == 0, run.output()
    said = run.output()
    assert re.search(r"seen\s+5 copies on the topics, 5 op markers, 5 ledger rows", said), said
    assert re.search(r"findings\s+0 ", said), said
    assert any((tmp_path / "checkpoint").iterdir())  # the checkpoint, on the claim


def test_an_image_built_from_the_same_context_is_not_built_again(
    sidecar_image: tuple[Engine, str],
) -> None:
    """`make test` builds the images in the background and the image tests build them again:
    the second build must find the first's image by its context digest, not rebuild it."""
    engine, image = sidecar_image
    before = engine("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "image.py"), "build", "sidecar"],
        check=True,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert f"{image} is built from this context already" in again.stdout
    assert f"IMAGE={image}" in again.stdout.splitlines()
    assert engine("image", "inspect", "--format", "{{.Id}}", image).stdout.strip() == before
