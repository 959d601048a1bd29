"""Records as the caller gives them, and their validation into what the database stores.

Everything here runs before any SQL is sent: a record that fails never touches the database, and
the caller's transaction stays usable.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBytes,
    StrictInt,
    StrictStr,
)
from pydantic import ValidationError as PydanticValidationError

from outbox._errors import (
    InvalidHeaderError,
    InvalidProducerGroupError,
    InvalidRecordError,
    InvalidTopicError,
    InvalidTxIdError,
    OutboxUsageError,
    RecordTooLargeError,
    SerializationError,
)

HeaderValue = bytes | str | None
Headers = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]]
Serializer = Callable[[Any], bytes | None]

# Kafka's own rules (kafka.common.internals.Topic): legal characters, at most 249 of them.
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
# kafka.common.internals.Topic's internal topics, and KRaft's metadata log.
_KAFKA_INTERNAL_TOPICS = frozenset(
    {"__consumer_offsets", "__transaction_state", "__cluster_metadata"}
)
_PRODUCER_GROUP = re.compile(r"[a-zA-Z0-9._-]{1,128}")
_TX_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
# The relay adds these to every record it delivers; a caller must not forge them.
RESERVED_HEADER_PREFIX = "outbox-"
MAX_CHECK_IMMUNITY = timedelta(days=365)
MAX_PARTITION = 2**31 - 1  # Kafka's partitions are int32, and so is the column
# What Kafka takes by default: librdkafka's message.max.bytes (1,000,000; the Java clients and
# the broker take ~1 MiB) less room for the headers the relay adds (~470 bytes at most) and the
# record's framing. At 1 MiB, records the relay's client refuses were accepted, then parked.
DEFAULT_MAX_RECORD_BYTES = 1_000_000 - 1_024


@dataclass(frozen=True, slots=True)
class Record:
    """One record for `publish_many` / `prepare_many`.

    `value` and `key` may be bytes (sent as they are), str (UTF-8), None (a null value is a Kafka
    tombstone) or anything the serializer accepts (JSON by default). Header values are bytes, str
    (UTF-8) or None; names repeat as Kafka allows. `partition` pins the Kafka partition.
    """

    topic: str
    value: Any
    key: Any = None
    headers: Headers | None = None
    partition: int | None = None


def check_topic(topic: object) -> str:
    if not isinstance(topic, str):
        raise InvalidTopicError(f"topic must be a str, got {type(topic).__name__}")
    if topic in (".", ".."):
        raise InvalidTopicError(f"topic {topic!r} is not allowed by Kafka")
    if topic in _KAFKA_INTERNAL_TOPICS:  # the broker refuses a client's writes there: parked
        raise InvalidTopicError(f"topic {topic!r} is Kafka's own, not for records")
    if not _TOPIC.fullmatch(topic):
        raise InvalidTopicError(
            f"topic {topic[:60]!r} is invalid: Kafka allows 1 to 249 characters of "
            "[a-zA-Z0-9._-]" + (f" (it has {len(topic)})" if len(topic) > 249 else "")
        )
    return topic


def kafka_internal(topic: str) -> bool:
    """One of Kafka's own topics, which the broker keeps a client's records from."""
    return topic in _KAFKA_INTERNAL_TOPICS


def check_stored_topic(topic: object) -> str:
    """A topic to find records by (redrive, drop): any the table takes. Kafka's own topics are
    refused for new records only: a row written before that, or by another writer, may name
    one, and was out of reach of `drop --topic`."""
    if isinstance(topic, str) and kafka_internal(topic):
        return topic
    return check_topic(topic)


def check_producer_group(group: object) -> str:
    if not isinstance(group, str) or not _PRODUCER_GROUP.fullmatch(group):
        raise InvalidProducerGroupError(
            f"producer group {group!r} is invalid: use 1 to 128 characters of [a-zA-Z0-9._-]"
        )
    return group


def _not_a_str(tx_id: object) -> None:
    """A publish's or prepare's result given whole for its tx id (`commit(conn, written)`):
    said as what it is, with what to pass, rather than as a tx id of the wrong length."""
    inner = getattr(tx_id, "tx_id", None)
    if not isinstance(tx_id, str) and isinstance(inner, str):
        kind, name = type(tx_id).__name__, type(tx_id).__name__.lower()
        group = getattr(tx_id, "producer_group", None)
        raise InvalidTxIdError(
            f"tx id must be a str, not a {kind}: pass its tx_id ({inner!r}), as "
            f"`{name}.tx_id`"
            + (
                f", and its producer group ({group!r}), as `producer_group={name}.producer_group`"
                if isinstance(group, str)
                else ""
            )
        )


def check_tx_id(tx_id: object) -> str:
    _not_a_str(tx_id)
    if not isinstance(tx_id, str) or not _TX_ID.fullmatch(tx_id):
        raise InvalidTxIdError(
            f"tx id {tx_id!r} is invalid: use 1 to 128 printable ASCII characters, no spaces"
        )
    return tx_id


def check_stored_tx_id(tx_id: object) -> str:
    """A tx id to look up and end (commit, rollback, resolve, rearm): what the table takes, 1
    to 128 characters. Another writer may have stored one that check_tx_id refuses for new
    records; the checker's COMMIT for it was never applied, and it could not be resolved."""
    _not_a_str(tx_id)
    if not isinstance(tx_id, str) or not 1 <= len(tx_id) <= 128:
        raise InvalidTxIdError(f"tx id {tx_id!r} is invalid: use 1 to 128 characters")
    # What no row can hold: Postgres text takes no NUL, and a lone surrogate is no UTF-8 (a
    # "database failed" error, or a bare UnicodeEncodeError, said it before)
    if "\x00" in tx_id or (not tx_id.isascii() and not _encodes(tx_id)):
        raise InvalidTxIdError(
            f"tx id {tx_id!r} is invalid: no stored tx id holds a NUL or a lone surrogate"
        )
    return tx_id


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_immunity_interval(immunity: object) -> timedelta | None:
    if immunity is None:
        return None
    if isinstance(immunity, bool) or not isinstance(immunity, timedelta | int | float):
        raise InvalidRecordError(
            f"check_immunity must be a timedelta or seconds, got {type(immunity).__name__}"
        )
    try:
        value = immunity if isinstance(immunity, timedelta) else timedelta(seconds=immunity)
    except (OverflowError, ValueError):  # inf, nan, or past timedelta's range
        raise InvalidRecordError(
            f"check_immunity must be a finite number of seconds, at most "
            f"{MAX_CHECK_IMMUNITY.days} days, got {immunity!r}"
        ) from None
    if value < timedelta(0):
        raise InvalidRecordError(f"check_immunity must not be negative, got {value}")
    if value > MAX_CHECK_IMMUNITY:
        # the checker adds it to the record's time: past Postgres' range it failed every scan
        raise InvalidRecordError(
            f"check_immunity must be at most {MAX_CHECK_IMMUNITY.days} days, got {value}"
        )
    return value


def default_serializer(obj: Any) -> bytes | None:
    """bytes as they are, str as UTF-8, None as null, anything else as compact JSON."""
    if obj is None or isinstance(obj, bytes):
        return obj
    if isinstance(obj, bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, str):
        return obj.encode()
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _utf8(text: str, what: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"{what} is not valid Unicode: {exc.reason} at {exc.start}") from None
    return text


def _header_name(name: str) -> str:
    if not name:
        raise ValueError("header name must not be empty")
    if "\x00" in name:
        raise ValueError("header name must not contain NUL (the stored JSON cannot hold it)")
    _utf8(name, "header name")
    if name.lower().startswith(RESERVED_HEADER_PREFIX):
        raise ValueError(f"header name {name!r} is reserved: the relay sets outbox-* headers")
    return name


def _header_value(value: bytes | str | None) -> bytes | str | None:
    return _utf8(value, "header value") if isinstance(value, str) else value


class _Header(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: Annotated[StrictStr, AfterValidator(_header_name)]
    value: Annotated[StrictBytes | StrictStr | None, AfterValidator(_header_value)]


class _HeaderList(BaseModel):
    items: list[_Header]


class _Placement(BaseModel):
    partition: Annotated[StrictInt, Field(ge=0, le=MAX_PARTITION)] | None


def _headers_to_rows(headers: Headers | None) -> list[list[str | None]]:
    """Validated headers as the stored JSON: [[name, base64 value or null], ...]."""
    given: object = headers  # checked at run time: callers may pass anything
    if given is None:
        return []
    if isinstance(given, Mapping):
        pairs: list[Any] = list(given.items())
    elif isinstance(given, Sequence) and not isinstance(given, str | bytes):
        pairs = list(given)
    else:
        raise InvalidHeaderError(
            f"headers must be a mapping or a sequence of (name, value) pairs, "
            f"got {type(given).__name__}"
        )
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            # its type and length only: a header's value may be a token, and errors are logged
            shape = f" of {len(pair)} items" if isinstance(pair, Sequence | Mapping) else ""
            raise InvalidHeaderError(
                f"header #{i} must be a (name, value) pair, got a {type(pair).__name__}{shape}"
            )
    try:
        parsed = _HeaderList.model_validate({"items": [{"name": n, "value": v} for n, v in pairs]})
    except PydanticValidationError as exc:
        err = exc.errors()[0]
        index, field = err["loc"][1], err["loc"][2]
        name, value = pairs[int(index)]
        # pydantic names the union's last member only ("Input should be a valid bytes")
        msg = (
            f"must be bytes, str or None, got {type(value).__name__}"
            if field == "value" and not isinstance(value, bytes | str | None)
            else err["msg"]
        )
        raise InvalidHeaderError(f"header #{index} ({name!r}): {field}: {msg}") from None
    rows: list[list[str | None]] = []
    for h in parsed.items:
        raw = h.value.encode() if isinstance(h.value, str) else h.value
        rows.append([h.name, None if raw is None else base64.b64encode(raw).decode("ascii")])
    return rows


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[list[str | None]]
    partition: int | None


def encode_record(
    record: Record,
    *,
    key_serializer: Serializer,
    value_serializer: Serializer,
    max_record_bytes: int,
    position: int | None = None,
) -> EncodedRecord:
    """Validate and serialize one record; the errors say which record of a batch is wrong."""
    where = "" if position is None else f"record #{position}: "
    try:
        topic = check_topic(record.topic)
        try:
            partition = _Placement(partition=record.partition).partition
        except PydanticValidationError:
            raise InvalidRecordError(
                f"partition must be an int from 0 to {MAX_PARTITION} or None, "
                f"got {record.partition!r}"
            ) from None
        headers = _headers_to_rows(record.headers)
        key = _serialize("key", record.key, key_serializer)
        value = _serialize("value", record.value, value_serializer)
    except InvalidRecordError as exc:
        raise type(exc)(f"{where}{exc}") from exc.__cause__
    size = len(key or b"") + len(value or b"") + _headers_size(record.headers)
    if size > max_record_bytes:
        raise RecordTooLargeError(
            f"{where}record for topic {topic!r} is {size} bytes (key + value + headers as "
            "Kafka frames them), "
            f"over the limit of {max_record_bytes} bytes"
        )
    return EncodedRecord(topic, key, value, headers, partition)


def _serialize(what: str, obj: Any, serializer: Serializer) -> bytes | None:
    try:
        data = serializer(obj)
    except Exception as exc:
        raise SerializationError(
            f"{what} of type {type(obj).__name__} could not be serialized: {exc}"
        ) from exc
    if data is not None and not isinstance(data, bytes):
        raise SerializationError(
            f"the {what} serializer returned {type(data).__name__}, expected bytes or None"
        )
    return data


def _headers_size(headers: Headers | None) -> int:
    """As Kafka frames them (what the client's message.max.bytes counts): each name and value
    with its length as a zigzag varint (a null value's is -1). Names and values alone let many
    small headers pass the limit, and the client then refused the record."""
    if not headers:
        return 0
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    total = 0
    for name, value in pairs:
        encoded = name.encode()
        total += _varint_size(len(encoded)) + len(encoded)
        if value is None:
            total += _varint_size(-1)
        else:
            data = value.encode() if isinstance(value, str) else value
            total += _varint_size(len(data)) + len(data)
    return total


def _varint_size(n: int) -> int:
    """Bytes of n as a zigzag varint (Kafka's record format)."""
    zigzag = (n << 1) ^ (n >> 63)
    return max(1, (zigzag.bit_length() + 6) // 7)


def require_records(records: Iterable[Record]) -> list[Record]:
    """The records as a list: a generator read here once was empty when the INSERT read it."""
    if isinstance(records, Record):
        raise OutboxUsageError("a single Record given: pass a list of records")
    try:
        each = iter(records)
    except TypeError:
        raise OutboxUsageError(
            f"records must be a list of outbox.Record, got a {type(records).__name__}"
        ) from None
    given = list(each)  # outside the try: a generator's own error is the caller's to see
    if not given:
        raise OutboxUsageError("no records given: a batch needs at least one record")
    for i, record in enumerate(given):
        if not isinstance(record, Record):
            raise OutboxUsageError(
                f"record #{i} is a {type(record).__name__}, expected outbox.Record"
            )
    return given
