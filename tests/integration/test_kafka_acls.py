"""The relay under the broker's ACLs, for real: it logs in on the SASL listener, and a test
denies its principal one right (the broker's StandardAuthorizer; without an ACL all is allowed).
What the unit tests showed with the client's errors faked."""

from __future__ import annotations

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
from tests.fixtures.kafka import TIMEOUT_S, SaslListener, consume_all
from tests.integration.test_relay_delivery import markers, rows, values

pytestmark = pytest.mark.integration

Deny = Callable[[ResourceType, str, AclOperation], None]
_BINDING_FIELDS = (
    "restype", "name", "resource_pattern_type", "principal", "host", "operation",
    "permission_type",
)  # fmt: skip


@pytest.fixture
def deny(kafka_admin: AdminClient, kafka_sasl: SaslListener) -> Iterator[Deny]:
    """Denies the SASL login one operation on a resource (names starting with `name` for a
    transactional id); the ACLs are deleted after the test."""
    made: list[AclBinding] = []

    def add(kind: ResourceType, name: str, operation: AclOperation) -> None:
        pattern = (
            ResourcePatternType.PREFIXED
            if kind == ResourceType.TRANSACTIONAL_ID
            else ResourcePatternType.LITERAL
        )
        binding = AclBinding(
            kind, name, pattern, f"User:{kafka_sasl.username}", "*", operation,
            AclPermissionType.DENY,
        )  # fmt: skip
        for future in kafka_admin.create_acls([binding]).values():
            future.result(timeout=TIMEOUT_S)
        made.append(binding)

    yield add
    if made:
        filters = [AclBindingFilter(*(getattr(b, f) for f in _BINDING_FIELDS)) for b in made]
        for future in kafka_admin.delete_acls(filters).values():
            future.result(timeout=TIMEOUT_S)


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


def test_a_topic_the_relay_may_not_write_parks_its_records_and_the_rest_go_on(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Deny,
) -> None:
    allowed, denied = topic_factory(), topic_factory()
    deny(ResourceType.TOPIC, denied, AclOperation.WRITE)
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
    pg_dsn: str, topic_factory: Callable[..., str], sasl_relay: Callable[..., Relay], deny: Deny
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


def test_an_op_marker_topic_the_relay_may_not_write_stops_it_saying_so(
    pg_dsn: str,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    sasl_relay: Callable[..., Relay],
    deny: Deny,
) -> None:
    topic = topic_factory()
    relay = sasl_relay()
    relay.run_once()  # made its marker topic; nothing to deliver yet
    deny(ResourceType.TOPIC, relay.settings.relay.op_marker_topic, AclOperation.WRITE)
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        outbox.publish(conn, topic, "waits", key="k")
    with pytest.raises(RelayConfigError, match="principal needs WRITE on it"):
        relay.run_once()
    assert [r[1] for r in rows(pg_dsn)] == ["committed"]
    assert consume_all(kafka_bootstrap, topic, "read_committed") == []  # aborted
