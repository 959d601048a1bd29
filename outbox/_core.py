"""The outbox operations, written once for the sync and the async API.

Each operation is a generator that yields `(query, params)` and receives the rows the query returned
(the "sans-IO" style psycopg itself uses), so `_sync.py` and `_async.py` only drive them. All
validation happens before the first yield: a rejected call sends no SQL at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from outbox import sql as queries
from outbox._describe import describe
from outbox._errors import (
    DuplicateTransactionError,
    IllegalTransitionError,
    InvalidConfigError,
    InvalidTxIdError,
    OutboxUsageError,
    UnknownTransactionError,
)
from outbox._records import (
    DEFAULT_MAX_RECORD_BYTES,
    Record,
    Serializer,
    check_producer_group,
    check_stored_tx_id,
    check_tx_id,
    default_serializer,
    encode_record,
)

PER_TRANSACTION_PREFIX = "xid:"  # + the transaction id: the tx id of records given none (SQL)
Rows = list[tuple[Any, ...]]
Query = tuple[bytes, dict[str, Any]]
Operation = Generator[Query, Rows, Any]

_WAKEUP_SUFFIX = "_wakeup"
# Postgres identifiers hold 63 bytes, and the NOTIFY channel is the schema's name plus the suffix:
# a longer name migrated, then every publish failed ("channel name too long").
MAX_SCHEMA_NAME = 63 - len(_WAKEUP_SUFFIX)
_SCHEMA_NAME = re.compile(rf"[a-zA-Z_][a-zA-Z0-9_]{{0,{MAX_SCHEMA_NAME - 1}}}")


class State(StrEnum):
    """States of an outbox record (see the state machine in the design)."""

    PREPARED = "prepared"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    DISCARDED = "discarded"
    DELIVERED = "delivered"
    PARKED = "parked"


def wakeup_channel(schema: str) -> str:
    """The NOTIFY channel the relay listens on for this schema."""
    return f"{schema}{_WAKEUP_SUFFIX}"


def check_schema_name(v: str) -> str:
    """The outbox's schema name, or ValueError saying what is wrong with it."""
    if not _SCHEMA_NAME.fullmatch(v):
        raise ValueError(
            f"{v!r} is not a plain identifier (letters, digits, _) of at most "
            f"{MAX_SCHEMA_NAME} characters: its NOTIFY channel, the name plus "
            f"{_WAKEUP_SUFFIX!r}, must fit Postgres's 63"
        )
    if v.startswith("pg_"):  # CREATE SCHEMA refuses it (PG_ it takes): no migrate could run
        raise ValueError(f"{v!r} begins with 'pg_', which Postgres keeps for its own schemas")
    return v


class OutboxConfig(BaseModel):
    """How an application writes to the outbox. Validated once, when built."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    schema_name: str = Field(
        default="outbox", description="Postgres schema holding the outbox tables."
    )
    producer_group: str = Field(
        default="default",
        description="Names this application to the checker; maps to its endpoint.",
    )
    max_record_bytes: int = Field(
        default=DEFAULT_MAX_RECORD_BYTES,
        gt=0,
        description="Largest key + value + headers accepted.",
    )
    notify: bool = Field(
        default=True, description="NOTIFY the relay at commit so it wakes at once."
    )
    key_serializer: Serializer = default_serializer
    value_serializer: Serializer = default_serializer

    def __init__(self, **settings: Any) -> None:
        try:
            super().__init__(**settings)
        except ValidationError as exc:  # one root for every error of the library
            problems = describe(exc, "settings")
            raise InvalidConfigError(f"invalid outbox settings: {problems}") from exc

    @field_validator("schema_name")
    @classmethod
    def _schema_is_identifier(cls, v: str) -> str:
        return check_schema_name(v)

    @field_validator("producer_group")
    @classmethod
    def _group_is_valid(cls, v: str) -> str:
        return check_producer_group(v)

    @field_validator("max_record_bytes", mode="before")
    @classmethod
    def _bytes_not_a_flag(cls, v: Any) -> Any:
        if isinstance(v, bool):  # True became a limit of 1 byte, refusing every record later
            raise ValueError(f"{v!r} is not a number of bytes")
        return v


def config_of(config: OutboxConfig | None, settings: dict[str, Any]) -> OutboxConfig:
    """Outbox(config) or Outbox(**settings): both at once would drop the settings unseen."""
    if config is None:
        return OutboxConfig(**settings)
    if not isinstance(config, OutboxConfig):
        # else accepted here, and the first call failed with a bare AttributeError
        raise InvalidConfigError(
            f"the first argument is an OutboxConfig, not {type(config).__name__}: give "
            "settings by name (producer_group=..., schema_name=...)"
        )
    if settings:
        raise InvalidConfigError(
            f"give an OutboxConfig or settings ({', '.join(sorted(settings))}), not both: "
            "put the settings in the OutboxConfig"
        )
    return config


@dataclass(frozen=True, slots=True)
class Written:
    """What a publish or prepare wrote: the records' ids in the order given, and their tx id."""

    tx_id: str
    ids: tuple[int, ...]
    producer_group: str


@dataclass(frozen=True, slots=True)
class Transition:
    """The outcome of commit() or rollback().

    `changed` is False when the transaction was already in the asked state (a repeated commit or
    rollback is harmless); `ids` are the records this call moved. `found` (`changed` False):
    the states its records were found in, e.g. delivered and parked after a commit.
    """

    producer_group: str
    tx_id: str
    state: State
    changed: bool
    ids: tuple[int, ...]
    found: tuple[str, ...] = field(default=(), compare=False)


def _ascii_json(obj: Any) -> str:
    """The headers' JSON, ASCII only (\\u escapes), whatever `set_json_dumps` an application
    installed: psycopg sends JSON as UTF-8 bytes in any client encoding, so an orjson-style
    dumps stored a header name like 'café' as 'cafÃ©' on a LATIN1 connection."""
    return json.dumps(obj, ensure_ascii=True)


def insert(
    cfg: OutboxConfig,
    records: Sequence[Record],
    *,
    state: State,
    tx_id: str | None,
    producer_group: str | None,
    check_immunity: timedelta | None = None,
    tx_id_generated: bool = False,
) -> Operation:
    """`tx_id_generated`: the outbox made the tx id just now (new_tx_id), so no other
    transaction can hold it and its reuse is not checked."""
    group = (
        check_producer_group(producer_group) if producer_group is not None else cfg.producer_group
    )
    if tx_id is not None:
        check_tx_id(tx_id)
        if not tx_id_generated and tx_id.startswith(PER_TRANSACTION_PREFIX):
            # One of those given here could be the id a later transaction gets unchecked.
            raise InvalidTxIdError(
                f"tx id {tx_id!r}: ids starting with {PER_TRANSACTION_PREFIX!r} are the ones "
                "the outbox gives each database transaction; leave tx_id unset to get this "
                "transaction's, or give an id of your own"
            )
    encoded = [
        encode_record(
            r,
            key_serializer=cfg.key_serializer,
            value_serializer=cfg.value_serializer,
            max_record_bytes=cfg.max_record_bytes,
            position=i if len(records) > 1 else None,
        )
        for i, r in enumerate(records)
    ]
    schema = cfg.schema_name
    if tx_id is not None and not tx_id_generated:
        # A caller-given tx id belongs to one database transaction only. Checked, locked when
        # free, checked again under the lock: see tx_id_used_elsewhere.
        params = {"producer_group": group, "tx_id": tx_id, "state": state.value}
        for lock in (True, False):
            rows = yield queries.query("tx_id_used_elsewhere", schema), {**params, "lock": lock}
            _refuse_reused_tx_id(group, tx_id, state, *rows[0][:3])
    common = {
        "producer_group": group,
        "tx_id": tx_id,
        "state": state.value,
        "check_immunity": check_immunity,
        "notify": cfg.notify and state is State.COMMITTED,
        "channel": wakeup_channel(schema),
    }
    if len(encoded) == 1:
        one = encoded[0]
        rows = yield (
            queries.query("insert_record", schema),
            {
                **common,
                "topic": one.topic,
                "key": one.key,
                "value": one.value,
                "headers": Jsonb(one.headers, dumps=_ascii_json),
                "partition": one.partition,
            },
        )
    else:
        rows = yield (
            queries.query("insert_records", schema),
            {
                **common,
                "topics": [e.topic for e in encoded],
                "keys": [e.key for e in encoded],
                "values": [e.value for e in encoded],
                "headers": [Jsonb(e.headers, dumps=_ascii_json) for e in encoded],
                "partitions": [e.partition for e in encoded],
            },
        )
    return Written(tx_id=rows[0][1], ids=tuple(r[0] for r in rows), producer_group=group)


# For each target, the states that count as "already there" (a repeat is harmless).
_ALREADY = {
    State.COMMITTED: {State.COMMITTED.value, State.DELIVERED.value, State.PARKED.value},
    State.ROLLED_BACK: {State.ROLLED_BACK.value},
}


def _refuse_reused_tx_id(
    group: str, tx_id: str, state: State, elsewhere: bool, other_kind: bool, isolation: str
) -> None:
    if isolation not in ("read committed", "read uncommitted"):  # the latter runs as the former
        raise OutboxUsageError(
            f"tx id {tx_id!r} given in a {isolation.upper()} transaction: its snapshot "
            "cannot see another transaction that took the same tx id after it began, so "
            "the id cannot be checked for reuse; give a tx id in READ COMMITTED "
            "transactions only, or let the outbox make it (tx_id=None)"
        )
    if elsewhere:
        raise DuplicateTransactionError(
            f"tx id {tx_id!r} of producer group {group!r} is already used by another "
            "database transaction; give each transaction its own tx id",
            producer_group=group,
            tx_id=tx_id,
        )
    if other_kind:
        # rows not prepared, for a prepare: published ones, or prepared ones ended since
        kinds = (
            ("prepared", "published")
            if state is State.COMMITTED
            else ("published or already ended", "prepared")
        )
        raise OutboxUsageError(
            f"tx id {tx_id!r} of producer group {group!r} already holds {kinds[0]} records "
            f"in this transaction; {kinds[1]} ones need a tx id of their own (a commit or "
            "rollback would move the prepared ones and not the others)"
        )


def _record_ids(record_ids: Sequence[int] | None) -> tuple[int, ...]:
    if record_ids is None:
        return ()
    if isinstance(record_ids, str | bytes) or not isinstance(record_ids, Sequence):
        raise OutboxUsageError(f"record_ids must be a sequence of record ids, not {record_ids!r}")
    ids = tuple(record_ids)
    if not ids or any(type(i) is not int or i < 1 for i in ids):
        raise OutboxUsageError(
            f"record_ids must be the transaction's record ids (ints over 0), not {record_ids!r}"
        )
    return ids


def end(
    cfg: OutboxConfig,
    tx_id: str,
    to_state: State,
    producer_group: str | None,
    record_ids: Sequence[int] | None = None,
) -> Operation:
    """Compare-and-set prepared -> committed / rolled_back for every record of the transaction;
    with `record_ids`, only while the tx id holds one of them (not a later transaction's)."""
    group = (
        check_producer_group(producer_group) if producer_group is not None else cfg.producer_group
    )
    check_stored_tx_id(tx_id)
    ids = _record_ids(record_ids)
    params = {
        "producer_group": group,
        "tx_id": tx_id,
        "ids_from": min(ids) if ids else None,
        "ids_to": max(ids) if ids else None,
    }
    schema = cfg.schema_name
    rows = yield (
        queries.query("end_transaction", schema),
        {
            **params,
            "to_state": to_state.value,
            "notify": cfg.notify and to_state is State.COMMITTED,
            "channel": wakeup_channel(schema),
        },
    )
    if rows:
        return Transition(group, tx_id, to_state, changed=True, ids=tuple(r[0] for r in rows))
    states = yield queries.query("transaction_states", schema), params
    current = tuple(str(s) for s, _count in states)
    # Given its records, a prepared one left means end_transaction found none of them in the
    # transaction (else it had moved them all): they are another transaction's. Said as
    # "its records are prepared, and only prepared records can change" before.
    if ids and (not current or State.PREPARED.value in current):
        raise UnknownTransactionError(
            f"tx id {tx_id!r} of producer group {group!r} holds none of records "
            f"{min(ids)}..{max(ids)}: ended and removed already, or never its (a later "
            "transaction may have taken the tx id; this end leaves it alone)",
            producer_group=group,
            tx_id=tx_id,
        )
    if not current:
        raise UnknownTransactionError(
            f"no records of tx id {tx_id!r} in producer group {group!r}: never prepared in "
            "this producer group (a prepare under another one is not found here: pass its "
            "producer_group), its prepare not committed yet, or delivered and removed already",
            producer_group=group,
            tx_id=tx_id,
        )
    if set(current) <= _ALREADY[to_state]:
        return Transition(group, tx_id, to_state, changed=False, ids=(), found=current)
    verb = "commit" if to_state is State.COMMITTED else "roll back"
    why = ""
    if State.DISCARDED.value in current:  # what the application can still do about it
        discarded = (
            ". The checker discarded them, at its maximum checks or prepared age (`outboxctl "
            "records` shows the reason)"
        )
        why = discarded + (
            "; while the relay has not shipped them, `outboxctl rearm` makes them prepared "
            "again, and this end can be made again"
            if to_state is State.COMMITTED
            else ": they go to the dead-letter topic, never to their own, which is what a "
            "rollback wants"
        )
    raise IllegalTransitionError(
        f"cannot {verb} tx id {tx_id!r} of producer group {group!r}: its records are "
        f"{', '.join(current)}, and only prepared records can change{why}",
        producer_group=group,
        tx_id=tx_id,
        current_states=current,
    )
