"""The relay under the broker's ACLs, for real: it logs in on the SASL listener, and a test
denies its principal one right (the broker's StandardAuthorizer; without an ACL all is allowed).
What the unit tests showed with the client's errors faked."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

import outbox
from outbox import Record
from relay.config import SidecarSettings
from relay.service import Relay, RelayConfigError
from relay.shard import DeadLetterUnwritable
from tests.fixtures.kafka import TIMEOUT_S, SaslListener, consume_all
from tests.fixtures.relay import TAKEN_SINCE, discarded, shipping_since, taken_to_ship
from tests.integration.test_relay_delivery import markers, rearm_or_resolve, rows, values

pytestmark = pytest.mark.integration

_BINDING_FIELDS = (
    "restype", "name", "resource_pattern_type", "principal", "host", "operation",
    "permission_type",
)  # fmt: skip


class Acls:
    """Denies the SASL login one operation on a resource (names starting with `name` for a
    transactional id or a group), or with `allow=True` allows it. Once a resource has an
    ACL, the login may do there only what one allows."""

    def __init__(self, admin: AdminClient, principal: str) -> None:
        self.admin, self.principal = admin, principal
        self.made: list[AclBinding] = []

    def __call__(
        self, kind: ResourceType, name: str, operation: AclOperation, allow: bool = False
    ) -> None:
        prefixed = kind in (ResourceType.TRANSACTIONAL_ID, ResourceType.GROUP)
        pattern = ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL
        permission = AclPermissionType.ALLOW if allow else AclPermissionType.DENY
        binding = AclBinding(kind, name, pattern, self.principal, "*", operation, permission)
        for future in self.admin.create_acls([binding]).values():
            future.result(timeout=TIMEOUT_S)
        self.made.append(binding)
        self._await(binding, present=True)

    def clear(self) -> None:
        """Deletes every ACL made."""
        if self.made:
            for future in self.admin.delete_acls([_filter(b) for b in self.made]).values():
                future.result(timeout=TIMEOUT_S)
            for binding in self.made:
                self._await(binding, present=False)
        self.made.clear()

    def _await(self, binding: AclBinding, *, present: bool) -> None:
        """Until the broker's authorizer, which answers DescribeAcls, has the change: the
        request's future is done once the controller has it, and a broker under load applies
        it after."""
        deadline = time.monotonic() + TIMEOUT_S
        while (binding in self.admin.describe_acls(_filter(binding)).result(TIMEOUT_S)) != present:
            assert time.monotonic() < deadline, f"the broker did not apply {binding}"
            time.sleep(0.05)


def _filter(binding: AclBinding) -> AclBindingFilter:
    return AclBindingFilter(*(getattr(binding, f) for f in _BINDING_FIELDS))


@pytest.fixture
def deny(kafka_admin: AdminClient, kafka_sasl: SaslListener) -> Iterator[Acls]:
    """ACLs for the SASL login, deleted after the test."""
    acls = Acls(kafka_admin, f"User:{kafka_sasl.username}")
    yield acls
    acls.clear()


@pytest.fixture
def sasl_relay(
    relay_settings: Callable[..., SidecarSettings],
    relay_factory: Callable[..., Relay],
    kafka_sasl: SaslListener,
) -> Callable[..., Relay]:
    """A relay logged in on the SASL listener, as a principal ACLs can hold."""

    def make(**relay: Any) -> Relay:
        settings = relay_settings(**relay)
        login = {k.replace(".", "_"): v for k, v in kafka_sasl.librdkafka().items()}
        return relay_factory(settings.model_copy(update={"kafka": type(settings.kafka)(**login)}))

    return make


def revoke_write(deny: Acls, topic: str, revoked: str = "write") -> None:
    """WRITE taken away: with `revoked="all"` a bare DENY, which hides the topic too (once a
    resource has an ACL the login needs one allowing DESCRIBE); else the topic still seen,
    what an operator revoking WRITE alone gets."""
    deny(ResourceType.TOPIC, topic, AclOperation.WRITE)
    if revoked != "all":
        for operation in (AclOperation.DESCRIBE, AclOperation.READ):
            deny(ResourceType.TOPIC, topic, operation, allow=True)


@pytest.mark.parametrize("revoked", ["all", "write"])
def test_a_topic_the_relay_may_not_write_parks_its_records_and_the_rest_go_on(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
    revoked: str,
) -> None:
    """A bare DENY hides the topic too (its metadata refused), which the relay parked as
    "does not exist". With WRITE alone revoked the client failed the whole transaction as the
    topic joined it (every report purged, the abort fatal): one such record held every record
    of its shard back, nothing parked, probes green, for as long as the ACL stayed."""
    allowed, denied = topic_factory(), topic_factory()
    revoke_write(deny, denied, revoked)
    with psycopg.connect(pg_dsn) as conn:
        for record in (
            Record(allowed, "before", key="a"),
            Record(denied, "not allowed", key="b"),
            Record(allowed, "after", key="a"),
        ):  # a transaction each
            with conn.transaction():
                outbox.publish_many(conn, [record])
    relay = sasl_relay()
    first = relay.run_once()
    assert (first.delivered, first.parked) == (2, 1)
    assert values(consume_all(kafka_bootstrap, allowed, "read_committed")) == [b"before", b"after"]
    (parked,) = [r for r in rows(pg_dsn) if r[1] == "parked"]
    assert parked[2] == (
        f"refused by the broker: Topic authorization failed for {denied!r}: the relay's "
        "principal needs DESCRIBE and WRITE on it"
    )
    second = relay.run_once()  # its dead-letter copy and op marker
    assert second.ended == 1
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert [m.value() for m in dead] == [b"not allowed"]
    assert [m.id for m in markers(kafka_bootstrap, relay) if m.op.value == "parked"] == [parked[0]]
    assert consume_all(kafka_bootstrap, denied, "read_committed") == []


def test_transactional_ids_the_relay_may_not_use_stop_it_saying_which_right(
    pg_dsn: str, topic_factory: Callable[..., str], sasl_relay: Callable[..., Relay], deny: Acls
) -> None:
    relay = sasl_relay()
    deny(
        ResourceType.TRANSACTIONAL_ID,
        relay.settings.relay.transactional_id_prefix,
        AclOperation.WRITE,
    )
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic_factory(), "waits", key="k")
    with pytest.raises(RelayConfigError, match="needs WRITE and DESCRIBE on its transactional"):
        relay.run_once()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]  # nothing lost: it waits


@pytest.mark.parametrize("revoked", ["all", "write"])
def test_an_op_marker_topic_the_relay_may_not_write_stops_it_saying_so(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
    revoked: str,
) -> None:
    """With WRITE alone revoked the relay neither stopped nor said why ("the op markers were
    not sent"), every batch failing."""
    topic = topic_factory()
    relay = sasl_relay()
    relay.run_once()  # made its marker topic; nothing to deliver yet
    revoke_write(deny, relay.settings.relay.op_marker_topic, revoked)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "waits", key="k")
    with pytest.raises(RelayConfigError, match="principal needs WRITE on it"):
        relay.run_once()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []  # aborted


def test_a_dead_letter_topic_it_may_not_write_holds_only_the_copies_back(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
) -> None:
    """The README's promise for a dead-letter topic that takes nothing (the rows needing a copy
    wait; the rest goes on) held only for a bare DENY: with WRITE alone revoked every batch
    failed, said as INVALID_TXN_STATE."""
    topic = topic_factory()
    relay = sasl_relay()
    relay.run_once()  # made its topics
    revoke_write(deny, relay.settings.relay.dead_letter_topic)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [Record("no.such.topic.acl", "poison", key="p")])
    assert relay.run_once().parked == 1
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish_many(conn, [Record(topic, "goes on", key="k")])
    with pytest.raises(DeadLetterUnwritable, match=r"takes no copies \(Topic authorization"):
        relay.run_once()
    (worker,) = relay.workers.values()
    worker.retry_at = 0.0  # the shard's backoff: the test goes again at once
    assert relay.run_once().delivered == 1  # the copy waits; the others go
    assert values(consume_all(kafka_bootstrap, topic, "read_committed")) == [b"goes on"]
    (parked,) = [r for r in rows(pg_dsn) if r[1] == "parked"]
    assert not parked[3]  # not ended: its copy and marker wait for the topic
    deny.clear()  # WRITE given back: the copy goes at the next try, without a restart
    worker.retry_at = worker._dead_letter_blocked_until = 0.0
    assert relay.run_once().ended == 1
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert [m.value() for m in dead] == [b"poison"]


def test_a_discarded_record_a_refusing_dead_letter_topic_kept_is_left_to_operators(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
) -> None:
    """Marked as taken to ship before the dead-letter topic refused its copy (WRITE revoked),
    the row stayed marked after the batch was aborted: re-arm and resolve were refused, "taken
    by the relay to ship", for as long as the topic refused, though nothing shipped it."""
    topic = topic_factory()
    relay = sasl_relay()
    relay.run_once()  # made its topics
    revoke_write(deny, relay.settings.relay.dead_letter_topic)
    written = discarded(pg_dsn, topic, "wanted after all")
    with pytest.raises(DeadLetterUnwritable, match=r"takes no copies \(Topic authorization"):
        relay.run_once()
    (worker,) = relay.workers.values()
    worker.retry_at = 0.0  # the shard's backoff: the test goes again at once
    assert relay.run_once().ended == 0  # its recovery, and a claim that leaves the row
    assert rearm_or_resolve(pg_dsn, "rearm", written.tx_id) == "done"
    deny.clear()
    worker.retry_at = worker._dead_letter_blocked_until = 0.0
    assert relay.run_once().ended == 0  # prepared again: nothing to ship
    dead = consume_all(kafka_bootstrap, relay.settings.relay.dead_letter_topic, "read_committed")
    assert dead == []
    assert [r[1] for r in rows(pg_dsn)] == ["prepared"]


def test_a_shards_first_recovery_leaves_the_marks_it_cannot_check(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
) -> None:
    """A first recovery reads no markers (shard_lease emptied by an operator, say): a discarded
    row's mark may stand for copies a relay sent before, and is left to the rows' shipping, not
    taken off for re-arms (a later recovery, which reads the markers, takes it off)."""
    topic = topic_factory()
    written = discarded(pg_dsn, topic, "maybe sent")
    taken_to_ship(pg_dsn, written.tx_id)  # by a relay, before the lease rows went
    relay = sasl_relay()
    revoke_write(deny, relay.settings.relay.dead_letter_topic)  # the shipping goes no further
    with pytest.raises(DeadLetterUnwritable):
        relay.run_once()
    assert "taken by the relay to ship" in rearm_or_resolve(pg_dsn, "rearm", written.tx_id)
    assert shipping_since(pg_dsn, written.tx_id) == TAKEN_SINCE  # kept: not unmarked, nor anew


def _a_batch_in_doubt(relay: Relay, pg_dsn: str, topic: str, value: str) -> None:
    """A batch committed in Kafka whose rows were not ended (the end's connection cut): the
    next round recovers, and only the op markers say it went."""
    (worker,) = relay.workers.values()
    end = worker._end_batch

    def cut(*_: Any, **__: Any) -> None:
        raise psycopg.OperationalError("the connection was cut (test)")

    worker._end_batch = cut  # type: ignore[method-assign]
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, value, key="k")
    with pytest.raises(Exception, match="the connection was cut"):
        relay.run_once()
    worker._end_batch = end  # type: ignore[method-assign]
    assert worker.needs_recovery
    worker.retry_at = 0.0  # the shard's backoff: the test goes again at once


def test_a_recovery_needs_no_acl_on_its_consumer_group(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
) -> None:
    """The recovery's consumer is named a group (Python's client requires one) but reads by
    assignment and commits nothing. With its group refused, the refused look-up of the group's
    coordinator came in at random against the read: some recoveries stopped the relay for
    an ACL they did not need, others went on. Each of these reads the markers back."""
    topic = topic_factory()
    prefix = f"no-group-acl-{uuid.uuid4().hex[:8]}-"
    deny(ResourceType.GROUP, prefix, AclOperation.ALL)
    relay = sasl_relay(recovery_group_prefix=prefix)
    relay.run_once()
    for i in range(3):
        _a_batch_in_doubt(relay, pg_dsn, topic, f"in doubt {i}")
        relay.run_once()  # recovers: the markers end the row, which does not go again
        assert rows(pg_dsn) == []
    got = values(consume_all(kafka_bootstrap, topic, "read_committed"))
    assert got == [f"in doubt {i}".encode() for i in range(3)]


def test_a_recovery_the_acls_keep_from_reading_the_markers_stops_it_naming_them(
    pg_dsn: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Acls,
) -> None:
    """Without READ on the op-marker topic the shard failed every round after a batch in
    doubt, probes green, and nothing said which ACL."""
    topic = topic_factory()
    relay = sasl_relay()
    relay.run_once()
    _a_batch_in_doubt(relay, pg_dsn, topic, "in doubt")
    markers_topic = relay.settings.relay.op_marker_topic
    deny(ResourceType.TOPIC, markers_topic, AclOperation.ALL, allow=True)
    deny(ResourceType.TOPIC, markers_topic, AclOperation.READ)  # only READ taken away
    with pytest.raises(RelayConfigError, match=f"needs READ on {markers_topic}"):
        relay.run_once()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]  # not ended, and not sent again


def test_an_op_marker_topic_whose_settings_it_may_not_read_is_said_with_the_acl(
    sasl_relay: Callable[..., Relay],
    deny: Acls,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without DESCRIBE_CONFIGS the start's check of the marker topic's retention and
    cleanup policy is skipped; the warning now says so and which ACL it needs."""
    relay = sasl_relay()
    markers = relay.settings.relay.op_marker_topic
    deny(ResourceType.TOPIC, markers, AclOperation.ALL, allow=True)
    deny(ResourceType.TOPIC, markers, AclOperation.DESCRIBE_CONFIGS)
    relay.run_once()  # sets up: makes the topic, then checks it
    said = [r.getMessage() for r in caplog.records if "configuration of topic" in r.getMessage()]
    assert said == [
        f"could not read the configuration of topic {markers}, so it is not checked: Topic "
        "authorization failed. (the relay's principal needs DESCRIBE_CONFIGS on it)"
    ]
