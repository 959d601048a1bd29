"""A Kafka commit the broker does not answer for a while (the broker's process stopped with
SIGSTOP, as a long GC pause or a frozen VM would): the relay keeps its leases through it, and a
stop within its grace does not wait it out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import relay.service
from relay import _failpoints
from relay.kafka import ShardProducer
from relay.service import Relay
from scripts import services as local_services
from tests.fixtures.kafka import consume_all
from tests.fixtures.services import Services
from tests.integration.test_relay_crashes import assert_exactly_once, publish, undelivered


@pytest.fixture
def broker_pid(services: Services) -> int:
    if services.source != "script":  # scripts/services.py pauses only the broker it started
        pytest.skip(f"the broker is not ours to pause (it comes from {services.source})")
    pid = local_services.kafka_pid()
    assert pid is not None, "scripts/services.py started no broker"
    return pid


@contextlib.contextmanager
def broker_pausing(broker_pid: int) -> Iterator[Callable[[], None]]:
    """A pause() that stops the broker (once); resumed on leaving, and by a watchdog of its own
    30 s later should this process die first (scripts/services.py `up` resumes a stopped broker
    too). Never paused once the block is left."""
    lock = threading.Lock()
    over = False
    watchdog: list[subprocess.Popen[bytes]] = []

    def pause() -> None:
        with lock:
            if over or watchdog:
                return
            watchdog.append(
                subprocess.Popen(
                    ["sh", "-c", f"sleep 30; kill -CONT {broker_pid}"],
                    start_new_session=True,  # outlives a killed test run
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            os.kill(broker_pid, signal.SIGSTOP)

    try:
        yield pause
    finally:
        with lock:
            over = True
        os.kill(broker_pid, signal.SIGCONT)
        for dog in watchdog:
            dog.kill()
            dog.wait()


@contextlib.contextmanager
def paused_after_produce(
    monkeypatch: pytest.MonkeyPatch, broker_pid: int, at: str = _failpoints.AFTER_PRODUCE
) -> Iterator[threading.Event]:
    """The broker stopped once a batch is produced, before its commit (broker_pausing); or
    at another failpoint of the batch (`at`), the event set once it is reached."""
    produced = threading.Event()
    hit = _failpoints.hit
    with broker_pausing(broker_pid) as pause:

        def pause_there(name: str) -> None:
            if name == at and not produced.is_set():
                pause()
                produced.set()
            hit(name)

        monkeypatch.setattr(_failpoints, "hit", pause_there)
        yield produced


def lease_owners(dsn: str) -> list[str | None]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT owner FROM outbox.shard_lease")]


def owner_and_rival(relay_factory: Callable[..., Relay]) -> tuple[Relay, Relay]:
    """Two relays of the same outbox, topics and prefix, of 3 s leases: the owner holds the
    shard, set up while the broker answers; the rival is a member with no shard, which takes
    it only once the owner's lease and membership expire."""
    timing: dict[str, Any] = {
        "lease_duration": "PT3S",
        "heartbeat_interval": "PT1S",
        "poll_interval": "PT0.2S",
    }
    owner = relay_factory(relay_id="owner", **timing)
    assert owner.run_once().shards == 1
    rival = relay_factory(relay_id="rival", **timing)
    assert rival.run_once().shards == 0
    return owner, rival


def owners_for(dsn: str, seconds: float = 5) -> set[str | None]:
    """Who held the lease over `seconds` (5: past the lease, within the broker's session
    timeout of 9 s)."""
    seen: set[str | None] = set()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        seen.update(lease_owners(dsn))
        time.sleep(0.2)
    return seen


def delivered_by_the_owner(dsn: str, bootstrap: str, topic: str, expected: Any) -> None:
    """Once the broker is back, the owner's batch goes through, once, and it keeps the shard."""
    until = time.monotonic() + 60
    while undelivered(dsn):
        assert time.monotonic() < until, f"{undelivered(dsn)} records still undelivered"
        time.sleep(0.1)
    assert lease_owners(dsn) == ["owner"]
    assert_exactly_once(consume_all(bootstrap, topic, "read_committed"), expected)


def drained(relay: Relay, dsn: str, timeout_s: float = 60) -> None:
    until = time.monotonic() + timeout_s
    while undelivered(dsn):
        assert time.monotonic() < until, f"{undelivered(dsn)} records still undelivered"
        relay.run_once()


def test_a_stop_during_a_commit_the_broker_does_not_answer_keeps_within_its_grace(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Relay],
    monkeypatch: pytest.MonkeyPatch,
    broker_pid: int,
) -> None:
    """The commit was waited for up to kafka_transaction_timeout (60 s) whatever the stop said:
    a SIGTERM in a Kafka incident overran the grace, the process exited 1, and the shards were
    not handed back (the other relays waited for their leases to expire)."""
    topic = topic_factory()
    relay = relay_factory(lease_duration="PT3S", poll_interval="PT0.2S")
    assert relay.run_once().shards == 1  # recovered before the broker stops
    expected = publish(pg_dsn, topic, transactions=2, per_tx=2)
    with paused_after_produce(monkeypatch, broker_pid) as produced:
        relay.start()
        assert produced.wait(30), "no batch was produced"
        began = time.monotonic()
        relay.stop(timeout=10)  # the commit is given up 8 s before the end (STOP_RESERVE_S)
        took = time.monotonic() - began
        assert not relay.running(), f"still committing after {took:.1f}s"
    assert took < 8, took
    assert lease_owners(pg_dsn) == [None]  # handed back, not left to expire
    heir = relay_factory(relay.settings)
    drained(heir, pg_dsn)
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), expected)


def test_a_commit_longer_than_the_lease_keeps_the_shard(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Relay],
    monkeypatch: pytest.MonkeyPatch,
    broker_pid: int,
) -> None:
    """The leases were renewed before a commit, not during it: a commit longer than the lease
    lost them all, another relay took the shard and fenced the batch, and the next owner met
    the same slow broker."""
    owner, rival = owner_and_rival(relay_factory)
    topic = topic_factory()
    expected = publish(pg_dsn, topic, transactions=2, per_tx=2)
    with paused_after_produce(monkeypatch, broker_pid) as produced:
        owner.start()
        assert produced.wait(30), "no batch was produced"
        rival.start()
        seen = owners_for(pg_dsn)
    assert seen == {"owner"}
    delivered_by_the_owner(pg_dsn, kafka_bootstrap, topic, expected)


def test_a_recovery_whose_producer_init_the_broker_does_not_answer_keeps_the_leases(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Relay],
    monkeypatch: pytest.MonkeyPatch,
    broker_pid: int,
) -> None:
    """A recovery's producer init (up to kafka_transaction_timeout) renewed no lease: in a
    Kafka incident every lease of the relay lapsed, another relay took the shards, and the
    init, ending, fenced that one's producer (found by a review of the Kafka error handling)."""
    # A heartbeat's look at the marker topic's id waits up to 2 s on the paused broker: with
    # the test's 3 s lease, one in the pause left the next renewal at the lease's end.
    monkeypatch.setattr(relay.service, "MARKER_TOPIC_CHECK_S", 3600.0)
    owner, rival = owner_and_rival(relay_factory)
    topic = topic_factory()
    expected = publish(pg_dsn, topic, transactions=2, per_tx=2)
    init = ShardProducer.init
    initing = threading.Event()
    with broker_pausing(broker_pid) as pause:

        def paused_init(producer: ShardProducer, *args: Any, **kwargs: Any) -> None:
            if not initing.is_set():
                initing.set()
                pause()
            init(producer, *args, **kwargs)

        monkeypatch.setattr(ShardProducer, "init", paused_init)
        for worker in owner.workers.values():
            worker.needs_recovery = True  # as after a commit whose outcome is unknown
        owner.start()
        assert initing.wait(30), "no recovery began"
        rival.start()
        seen = owners_for(pg_dsn)
    assert seen == {"owner"}
    delivered_by_the_owner(pg_dsn, kafka_bootstrap, topic, expected)


def test_a_record_that_goes_alone_keeps_the_leases_while_the_broker_does_not_answer(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_factory: Callable[..., Relay],
    monkeypatch: pytest.MonkeyPatch,
    broker_pid: int,
) -> None:
    """A record that goes alone (one refused with its batch as too large for the broker) waited
    for its batch in one flush, up to kafka_transaction_timeout, renewing no lease: another
    relay took the shard meanwhile and fenced the batch."""
    owner, rival = owner_and_rival(relay_factory)
    topic = topic_factory()
    expected = publish(pg_dsn, topic, transactions=2, per_tx=2)
    with psycopg.connect(pg_dsn) as conn:
        first = conn.execute("SELECT min(id) FROM outbox.outbox_record").fetchone()
    assert first is not None
    owner.workers[0]._alone.add(first[0])  # as after the broker refused its batch
    with paused_after_produce(monkeypatch, broker_pid, at=_failpoints.BEFORE_PRODUCE) as paused:
        owner.start()
        assert paused.wait(30), "no batch was claimed"
        rival.start()
        seen = owners_for(pg_dsn)
    assert seen == {"owner"}
    delivered_by_the_owner(pg_dsn, kafka_bootstrap, topic, expected)
