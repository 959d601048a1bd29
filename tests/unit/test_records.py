"""Validation and serialization of records: pure logic, no database."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

import outbox
from outbox import Record
from outbox._records import (
    check_immunity_interval,
    check_topic,
    default_serializer,
    encode_record,
    require_records,
)
from outbox._txid import new_tx_id


def encode(record: Record, limit: int = 1_048_576) -> object:
    return encode_record(
        record,
        key_serializer=default_serializer,
        value_serializer=default_serializer,
        max_record_bytes=limit,
    )


@pytest.mark.parametrize("topic", ["a", "orders.created", "A-b_c.9", "x" * 249, "..."])
def test_kafka_legal_topics(topic: str) -> None:
    assert check_topic(topic) == topic


@pytest.mark.parametrize("topic", ["", ".", "..", "x" * 250, "a b", "ä", "a/b", 5])
def test_kafka_illegal_topics(topic: object) -> None:
    with pytest.raises(outbox.InvalidTopicError):
        check_topic(topic)


@pytest.mark.parametrize("topic", ["__consumer_offsets", "__transaction_state"])
def test_kafkas_own_topics_are_refused_at_the_call(topic: str) -> None:
    """The broker refuses a client's writes there (InvalidTopicException): taken, the record
    was parked by the relay instead."""
    with pytest.raises(outbox.InvalidTopicError, match="Kafka's own"):
        check_topic(topic)
    assert check_topic("__orders") == "__orders"  # other names with underscores are topics


def test_default_serializer() -> None:
    assert default_serializer(None) is None
    assert default_serializer(b"\x00") == b"\x00"
    assert default_serializer("é") == "é".encode()
    assert default_serializer({"b": [1, 2.5, None]}) == b'{"b":[1,2.5,null]}'
    with pytest.raises(ValueError):
        default_serializer(float("nan"))  # not valid JSON


def test_a_batch_error_names_the_record() -> None:
    with pytest.raises(outbox.InvalidTopicError, match="record #3"):
        encode_record(
            Record("bad topic", "v"),
            key_serializer=default_serializer,
            value_serializer=default_serializer,
            max_record_bytes=10,
            position=3,
        )


def test_size_counts_key_value_and_headers_as_kafka_frames_them() -> None:
    # 4 + 3 + the header: its name and value with a length byte each (2 + 1 + 2 + 1)
    record = Record("t", b"v" * 4, key=b"k" * 3, headers={"hh": b"12"})
    encode(record, limit=13)
    with pytest.raises(outbox.RecordTooLargeError, match="13 bytes"):
        encode(record, limit=12)
    # Names and values alone: 1,000 headers "h" of b"" were 1,000 bytes, not the 3,000 the
    # client counts, and a record under the limit was refused by the relay's client
    many = Record("t", b"", headers=[("h", b"")] * 1000)
    with pytest.raises(outbox.RecordTooLargeError, match="3000 bytes"):
        encode(many, limit=2999)
    long_value = Record("t", b"", headers={"n": b"x" * 64, "z": None})  # 64 takes 2 bytes
    encode(long_value, limit=71)
    with pytest.raises(outbox.RecordTooLargeError, match="71 bytes"):
        encode(long_value, limit=70)  # 1 + 1 + 2 + 64, then 1 + 1 + 1 for the null


def test_serializer_must_return_bytes() -> None:
    with pytest.raises(outbox.SerializationError, match="returned int"):
        encode_record(
            Record("t", "v"),
            key_serializer=default_serializer,
            value_serializer=lambda v: 5,
            max_record_bytes=100,  # type: ignore[arg-type,return-value]
        )


def test_headers_keep_order_and_duplicates() -> None:
    encoded = encode(Record("t", "v", headers=[("a", "1"), ("a", None), ("b", b"\xff")]))
    assert encoded.headers == [["a", "MQ=="], ["a", None], ["b", "/w=="]]  # type: ignore[attr-defined]


def test_tx_ids_are_uuid7_sortable_and_unique() -> None:
    early = new_tx_id(now_ns=1_700_000_000_000_000_000)
    late = new_tx_id(now_ns=1_700_000_000_001_000_000)
    assert uuid.UUID(early).version == 7
    assert early < late
    assert len({new_tx_id() for _ in range(10_000)}) == 10_000


def test_config_validates_at_construction() -> None:
    with pytest.raises(ValueError, match="producer group"):
        outbox.OutboxConfig(producer_group="has space")
    with pytest.raises(ValueError, match="greater than 0"):
        outbox.OutboxConfig(max_record_bytes=0)
    with pytest.raises(ValueError, match="Extra inputs"):
        outbox.OutboxConfig(shema_name="typo")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"producer_group": "has space"}, "producer_group: producer group 'has space'"),
        ({"max_record_bytes": 0}, "max_record_bytes: Input should be greater than 0"),
        ({"shema_name": "typo"}, "shema_name: Extra inputs are not permitted"),
        ({"schema_name": "my-schema"}, "schema_name: 'my-schema' is not a plain identifier"),
        # migrated, CREATE SCHEMA refused it: every publish said to migrate, which never could
        ({"schema_name": "pg_outbox"}, "schema_name: 'pg_outbox' begins with 'pg_'"),
        ({"max_record_bytes": True}, "max_record_bytes: True is not a number of bytes"),
    ],
)
def test_bad_settings_raise_the_librarys_own_error_naming_the_setting(
    settings: dict[str, Any], said: str
) -> None:
    """Every error of the library derives from OutboxError (README), settings' too: pydantic's
    ValidationError came through from Outbox(...), AsyncOutbox(...) and OutboxConfig(...)."""
    for make in (outbox.OutboxConfig, outbox.Outbox, outbox.AsyncOutbox):
        with pytest.raises(outbox.InvalidConfigError) as caught:
            make(**settings)
        assert isinstance(caught.value, outbox.OutboxError)
        assert said in str(caught.value)


def test_a_schema_name_must_leave_room_for_its_notify_channel() -> None:
    """Postgres names hold 63 bytes, and the relay's wake-up channel is the name plus
    '_wakeup': a 57-character schema migrated, then every publish failed."""
    longest = "s" * outbox.MAX_SCHEMA_NAME
    assert len(outbox.wakeup_channel(outbox.OutboxConfig(schema_name=longest).schema_name)) == 63
    with pytest.raises(outbox.InvalidConfigError, match="at most 56 characters"):
        outbox.OutboxConfig(schema_name=longest + "s")


def test_a_first_argument_other_than_a_config_is_refused_when_built() -> None:
    """Outbox("orders") was built, and its first publish failed with a bare AttributeError."""
    for make in (outbox.Outbox, outbox.AsyncOutbox):
        for wrong in ("orders", {"producer_group": "orders"}):
            with pytest.raises(
                outbox.InvalidConfigError,
                match=rf"an OutboxConfig, not {type(wrong).__name__}: give settings by name",
            ):
                make(wrong)  # type: ignore[arg-type]


def test_a_config_and_settings_together_are_refused_not_dropped() -> None:
    for make in (outbox.Outbox, outbox.AsyncOutbox):
        with pytest.raises(outbox.InvalidConfigError, match=r"\(producer_group\), not both"):
            make(outbox.OutboxConfig(), producer_group="orders")
    assert outbox.Outbox(outbox.OutboxConfig(producer_group="orders")).config.producer_group == (
        "orders"
    )


@pytest.mark.parametrize(
    ("record", "says"),
    [
        (Record("t", "v", partition=2**31), "partition must be an int from 0 to 2147483647"),
        (Record("t", "v", headers={"a\x00b": "v"}), "must not contain NUL"),
        (Record("t", "v", headers={"\ud800": "v"}), "header name is not valid Unicode"),
        (Record("t", "v", headers={"a": "\udfff"}), "header value is not valid Unicode"),
    ],
)
def test_what_postgres_would_refuse_is_refused_before_any_sql(record: Record, says: str) -> None:
    """Refused by the database instead, it would abort the caller's whole transaction."""
    with pytest.raises(outbox.InvalidRecordError, match=says):
        encode(record)


@pytest.mark.parametrize(
    ("immunity", "says"),
    [
        (float("inf"), "finite number of seconds"),
        (float("nan"), "finite number of seconds"),
        (10**20, "finite number of seconds"),
        (timedelta(days=366), "at most 365 days"),
        (-1, "must not be negative"),
    ],
)
def test_check_immunity_is_finite_and_bounded(immunity: object, says: str) -> None:
    with pytest.raises(outbox.InvalidRecordError, match=says):
        check_immunity_interval(immunity)
    assert check_immunity_interval(timedelta(days=365)) == timedelta(days=365)


@pytest.mark.parametrize(
    ("headers", "shape"),
    [
        ([("authorization", "Bearer s3cr3t", "x")], "a tuple of 3 items"),
        ([{"key": "authorization", "value": "Bearer s3cr3t"}], "a dict of 2 items"),
        (["Bearer s3cr3t"], "a str of 13 items"),
    ],
)
def test_a_malformed_header_pair_is_described_without_its_value(headers: Any, shape: str) -> None:
    """The pair itself was quoted in the error, and applications log errors: a header's value
    may be a token (the relay never shows one either)."""
    with pytest.raises(outbox.InvalidHeaderError, match="must be a \\(name, value\\) pair") as err:
        encode(Record("t", "v", headers=headers))
    assert "s3cr3t" not in str(err.value)
    assert shape in str(err.value)


def test_an_error_inside_the_callers_generator_is_its_own_not_a_wrong_argument() -> None:
    """A TypeError raised by the generator was reported as "records must be a list", its
    traceback gone."""
    orders = [{"id": 1}]
    with pytest.raises(TypeError, match="unsupported operand"):
        require_records(Record("orders", o, key=o["id"] + "x") for o in orders)  # type: ignore[operator]
    with pytest.raises(
        outbox.OutboxUsageError, match=r"must be a list of outbox\.Record, got a int"
    ):
        require_records(3)  # type: ignore[arg-type]
