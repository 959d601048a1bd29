"""A database failover under the relay: the standby it fails over to is behind the primary.

With asynchronous replication (the common setup: Patroni, CloudNativePG, most managed services)
a promoted standby lacks the primary's last transactions. Among them are the relay's own: rows it
delivered and removed there are back, undelivered, on the new primary. Their op markers are
committed in Kafka, so the relay must end them from those markers, not send them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import outbox
from relay.config import DatabaseSettings, SidecarSettings
from scripts import services as local_services
from tests.fixtures.kafka import consume_all
from tests.fixtures.pg_failover import PgPair
from tests.fixtures.relay import RelayProcess
from tests.integration.test_relay_crashes import (
    FAST,
    assert_exactly_once,
    publish,
    undelivered,
    wait_for,
)


@pytest.fixture
def pair_settings(
    pg_pair: PgPair, relay_settings: Callable[..., SidecarSettings]
) -> Callable[..., SidecarSettings]:
    """Relay settings on the pair, migrated: both nodes in the DSN, as a client of such a
    cluster is given them; the relay takes the writable one."""
    outbox.migrate(pg_pair.primary.dsn)

    def build(connect_timeout_s: float = 10.0, **relay: Any) -> SidecarSettings:
        built = relay_settings(shards=2, **FAST, **relay)
        database = DatabaseSettings(dsn=pg_pair.dsn, connect_timeout_s=connect_timeout_s)
        return built.model_copy(update={"database": database})

    return build


def test_rows_a_promoted_standby_brings_back_are_ended_by_their_markers_not_sent_again(
    pg_pair: PgPair,
    pair_settings: Callable[..., SidecarSettings],
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    primary, standby = pg_pair.primary, pg_pair.standby
    topic = topic_factory(partitions=2)
    settings = pair_settings()

    # A first relay takes the shards and delivers: its leases and marker offsets reach the
    # standby, as in any cluster that has run for a while.
    first = relay_process(settings=settings)
    sent = publish(primary.dsn, topic, transactions=5, per_tx=3, tag="a")
    wait_for(lambda: undelivered(primary.dsn) == 0, 60, "the first records", first)
    assert first.terminate() == 0, first.output()

    # Records the standby receives; then replication stops (the standby falls behind).
    behind = publish(primary.dsn, topic, transactions=5, per_tx=3, tag="b")
    pg_pair.await_replayed()
    pg_pair.cut_replication()
    assert undelivered(standby.dsn) == len(behind)

    # The relay delivers them from the primary: on the standby they stay undelivered. Then
    # records the standby never gets (committed on the primary only: lost by the failover,
    # as asynchronous replication loses them, but delivered already).
    relay = relay_process(settings=settings)
    wait_for(lambda: undelivered(primary.dsn) == 0, 60, "the records the standby has", relay)
    lost = publish(primary.dsn, topic, transactions=3, per_tx=3, tag="c")
    wait_for(lambda: undelivered(primary.dsn) == 0, 60, "the records the standby lacks", relay)
    assert undelivered(standby.dsn) == len(behind)

    pg_pair.fail_over()
    # The relay reconnects to the promoted standby, and ends those rows from their markers.
    wait_for(lambda: undelivered(standby.dsn) == 0, 90, "the rows brought back to end", relay)
    after = publish(standby.dsn, topic, transactions=5, per_tx=3, tag="d")
    wait_for(lambda: undelivered(standby.dsn) == 0, 60, "records after the failover", relay)
    assert relay.terminate() == 0, relay.output()

    assert_exactly_once(
        consume_all(kafka_bootstrap, topic, "read_committed"), sent + behind + lost + after
    )


def test_a_primary_gone_silent_is_given_up_and_the_relay_goes_on_with_the_promoted_standby(
    can_partition: None,
    pg_pair: PgPair,
    pair_settings: Callable[..., SidecarSettings],
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """A host that failed, or a partition, answers nothing: no reset closes the relay's
    connections to it, and a query on one waited for the kernel to give up on the peer
    (about 15 minutes on Linux), delivering nothing meanwhile."""
    primary, standby = pg_pair.primary, pg_pair.standby
    topic = topic_factory(partitions=2)
    relay = relay_process(settings=pair_settings(connect_timeout_s=3))
    sent = publish(primary.dsn, topic, transactions=5, per_tx=3, tag="a")
    wait_for(lambda: undelivered(primary.dsn) == 0, 60, "the first records", relay)
    sent += publish(primary.dsn, topic, transactions=5, per_tx=3, tag="b")  # being delivered
    pg_pair.await_replayed()

    pg_pair.fail_over(unreachable=True)
    sent += publish(standby.dsn, topic, transactions=5, per_tx=3, tag="c")
    # The lease lapses (3 s) and the dead connections are given up (3 s unanswered).
    wait_for(lambda: undelivered(standby.dsn) == 0, 45, "delivery from the new primary", relay)
    assert relay.terminate() == 0, relay.output()
    assert_exactly_once(consume_all(kafka_bootstrap, topic, "read_committed"), sent)


def test_a_stop_while_the_primary_is_silent_keeps_within_its_grace(
    can_partition: None,
    pg_pair: PgPair,
    pair_settings: Callable[..., SidecarSettings],
    relay_process: Callable[..., RelayProcess],
) -> None:
    """The round in flight is cut after connect_timeout_s; handing the shards back then made a
    new connection, which waited as long again on the silent host: 2 x 6 s overran 10 s."""
    settings = pair_settings(connect_timeout_s=6, shutdown_grace="PT10S")
    relay = relay_process(settings=settings)
    wait_for(lambda: "recovered" in relay.output(), 60, "the relay's start", relay)
    assert local_services.partition(pg_pair.primary.port)  # healed by the fixture
    time.sleep(1)  # a round under way, its statement unanswered
    started = time.monotonic()
    relay.proc.terminate()
    # 0: every part stopped within the grace (else the sidecar exits 1); the bound leaves
    # the process's own start and end room on a loaded machine, and 2 x 6 s still fails it
    assert relay.proc.wait(30) == 0, relay.output()
    assert time.monotonic() - started < 15
    assert "could not hand the shards back" in relay.output()
