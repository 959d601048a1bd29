"""Op markers: the relay's record of every outbox record it ended (RocketMQ's op messages).

For every record it ends, the relay writes a marker to the op-marker topic in the same Kafka
transaction as the record itself (or its dead-letter copy). A `read_committed` reader of the topic
therefore sees a marker if and only if the record's end is committed, which is what recovery and
reconciliation rely on.

Like RocketMQ 5's merged op messages, one Kafka message carries the markers of many records: a
Kafka message per record doubled the relay's produce work and the broker's (bench/relay.py).

Wire format (version 2, written), on the op-marker topic:
  partition  shard % op_marker_partitions (recovery reads only the partitions of its shards)
  key        the shard, decimal ASCII
  value      JSON: {"v": 2, "shard": int, "relay": str, "epoch": int, "outbox": str,
                    "markers": [entry, ...]}
             `outbox` names the outbox whose rows the markers end: "<database>/<schema>"
             (absent in markers of relays before it was added). Recovery ignores markers of
             another outbox: two outboxes sharing a marker topic by mistake ended each other's
             rows by id, never sent.
             entry: {"op": "delivered" | "rolled_back" | "discarded" | "parked", "id": int,
                     "tx_id": str, "producer_group": str, "topic": str, "key": base64|null,
                     "partition": int|null, "offset": int|null, "commit_ts": RFC 3339|null,
                     "reason": str|null, "xid": int|null}
             `key` is null for a record without a key and for one whose key is longer than
             MAX_MARKER_KEY_BYTES; `reason` is cut to MAX_MARKER_REASON_CHARS. An entry stays
             small whatever its record: a key near the record size limit would make its marker
             message too large for the topic, and the batch would be aborted round after round.
             `partition` / `offset` are where a delivered record landed on its topic (for a
             discarded or parked record: where its copy landed on the dead-letter topic).
             `commit_ts` and `xid` (the committing Postgres transaction, xid8) are the relay's
             delivery order: by commit time, then xid, then id; the reconciler judges order by
             them (`xid` is absent in markers of relays before it was added).
             A message holds at most `op_marker_message_bytes` of entries (one entry at least).
Version 1 (read, for markers written before): one marker per message, key the record id, value
  one entry with "v": 1, "shard", "relay" and "epoch" in it.
Delivered records carry the headers OUTBOX_ID_HEADER, OUTBOX_TX_ID_HEADER,
OUTBOX_PRODUCER_GROUP_HEADER and OUTBOX_NAME_HEADER (the `outbox` of the markers; absent in
records of relays before it was added).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

OUTBOX_ID_HEADER = "outbox-id"
OUTBOX_TX_ID_HEADER = "outbox-tx-id"
OUTBOX_PRODUCER_GROUP_HEADER = "outbox-producer-group"
# "<database>/<schema>", as marker messages name their outbox: ids are one outbox's own, and
# two outboxes may write one topic
OUTBOX_NAME_HEADER = "outbox-name"
OUTBOX_REASON_HEADER = "outbox-reason"  # on dead-letter copies
OUTBOX_VALUE_OMITTED_HEADER = "outbox-value-omitted"  # a copy too large to carry its value
MARKER_VERSION = 2
MAX_MARKER_KEY_BYTES = 4096
# What a marker message may hold beyond op_marker_message_bytes: one more entry (its key and
# reason are capped, below), the envelope, and Kafka's record overhead.
MARKER_MESSAGE_MARGIN = 32 * 1024
MAX_MARKER_REASON_CHARS = 1024


class Op(StrEnum):
    DELIVERED = "delivered"
    ROLLED_BACK = "rolled_back"
    DISCARDED = "discarded"
    PARKED = "parked"


def _b64decode(value: object) -> object:
    # validate: else "!!!" was the empty key, and matched a row whose key is empty
    return base64.b64decode(value, validate=True) if isinstance(value, str) else value


_Base64 = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str),
]


class OpMarker(BaseModel):
    """One record's marker as read back (either version), validated."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    v: Literal[1, 2] = 1
    op: Op
    id: int
    tx_id: str
    producer_group: str
    topic: str
    key: _Base64 | None = None
    shard: int
    partition: int | None = None
    offset: int | None = None
    commit_ts: datetime | None = None
    reason: str | None = None
    xid: int | None = None
    relay: str
    epoch: int
    outbox: str | None = None  # None: written before markers named their outbox

    def encode(self) -> tuple[bytes, bytes]:
        """(key, value) of this marker alone in version 1 (for tests of what older relays wrote)."""
        return str(self.id).encode("ascii"), self.model_dump_json().encode()


class MarkerFormatError(ValueError):
    """A message on the op-marker topic that is not a marker this relay can read."""


class MarkerTooNew(Exception):
    """A marker message of a newer relay (a later format version, or an op this relay does not
    know) that may be this shard's: skipped as not a relay's, the batch in doubt it ends would
    go again. A recovery that meets one fails until this relay is upgraded (or the newer ones
    rolled back). `outbox`: the outbox the message names, if it names one."""

    def __init__(self, message: str, outbox: str | None) -> None:
        super().__init__(message)
        self.outbox = outbox


def decode_markers(value: bytes, shard: int | None = None) -> list[OpMarker]:
    """The markers of one op-marker message, either version; MarkerFormatError if neither.

    `shard`: only that shard's (shards share marker partitions: a message of another shard's is
    not validated entry by entry, which is most of the cost of reading a partition's history).
    """
    try:
        message = json.loads(value)
        version = message.get("v", 1) if isinstance(message, dict) else None
        if _refuse_newer(message, version, shard):
            return []  # a newer relay's, of another shard
        if version == 1:
            marker = OpMarker.model_validate(message)
            return [marker] if shard is None or marker.shard == shard else []
        if version == MARKER_VERSION:
            envelope = {k: message[k] for k in ("shard", "relay", "epoch")}
            envelope["outbox"] = message.get("outbox")
            theirs = envelope["shard"]
            if shard is not None and isinstance(theirs, int) and theirs != shard:
                return []  # another shard's, not worth validating
            entries = message["markers"]
            markers = [OpMarker.model_validate({**e, **envelope, "v": 2}) for e in entries]
            return markers if shard is None else [m for m in markers if m.shard == shard]
    # pydantic's ValidationError is a ValueError; RecursionError: JSON nested too deep, which a
    # recovery must skip as it skips any other message not a relay's
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise MarkerFormatError(f"not an op marker message: {exc}") from exc
    raise MarkerFormatError(f"op marker message of unknown version {version!r}")


_OPS = frozenset(Op)


def _refuse_newer(message: Any, version: Any, shard: int | None) -> bool:
    """MarkerTooNew for a message a newer relay wrote that may be `shard`'s; True for one that
    names another shard (not this shard's business). What lacks a relay's envelope is left to
    the parse (not a relay's: skipped, as before; refused, any stray JSON would stop a shard).
    Every version keeps `v`, `shard`, `relay`, `epoch` and `outbox` in its envelope."""
    if type(version) is not int or version < 1:
        return False
    if not isinstance(message.get("relay"), str) or type(message.get("epoch")) is not int:
        return False
    outbox = message.get("outbox")
    outbox = outbox if isinstance(outbox, str) else None
    theirs = message.get("shard")
    if shard is not None and type(theirs) is int and theirs != shard:
        return version > MARKER_VERSION
    if version > MARKER_VERSION:
        raise MarkerTooNew(
            f"op marker message of format version {version}, written by a newer relay (this "
            f"one reads up to {MARKER_VERSION})",
            outbox,
        )
    entries = [message] if version == 1 else message.get("markers")
    for entry in entries if isinstance(entries, list) else ():
        op = entry.get("op") if isinstance(entry, dict) else None
        if isinstance(op, str) and op not in _OPS:
            raise MarkerTooNew(
                f"op marker of op {op!r}, written by a newer relay (this one knows "
                f"{', '.join(sorted(_OPS))})",
                outbox,
            )
    return False


@dataclass(slots=True)  # not frozen: built once per record, and frozen ones build 3x slower
class Ended:
    """What the relay itself needs of a marker it wrote: which row ended, how, and where."""

    op: Op
    id: int
    topic: str
    partition: int | None
    offset: int | None


# ASCII only: an entry's length in characters is its length in bytes
_dumps = json.JSONEncoder(separators=(",", ":")).encode
_quote = json.encoder.encode_basestring_ascii  # C: a str as a JSON string, ASCII only


def _key(value: bytes | None) -> str:
    if value is None or len(value) > MAX_MARKER_KEY_BYTES:
        return "null"
    return f'"{base64.b64encode(value).decode("ascii")}"'


def _reason(value: str | None) -> str:
    return "null" if value is None else _quote(value[:MAX_MARKER_REASON_CHARS])


def _number(value: int | None) -> str:
    return "null" if value is None else f"{value:d}"


@lru_cache(maxsize=256)  # a transaction's records share these: built once for all of them
def _names(tx_id: str, producer_group: str, topic: str) -> str:
    return (
        f'"tx_id":{_quote(tx_id)},"producer_group":{_quote(producer_group)},'
        f'"topic":{_quote(topic)},'
    )


@lru_cache(maxsize=256)  # as _names: a transaction's commit time and xid
def _tail(commit_ts: datetime | None, reason: str | None, xid: int | None) -> str:
    # in UTC: a session time zone's offset in seconds (+00:53:28) is not one pydantic reads back
    if commit_ts is not None and commit_ts.tzinfo is not None:
        commit_ts = commit_ts.astimezone(UTC)
    instant = "null" if commit_ts is None else f'"{commit_ts.isoformat()}"'
    return f'"commit_ts":{instant},"reason":{_reason(reason)},"xid":{_number(xid)}}}'


def marker_entry(
    op: Op,
    *,
    id: int,
    tx_id: str,
    producer_group: str,
    topic: str,
    key: bytes | None,
    partition: int | None,
    offset: int | None,
    commit_ts: datetime | None,
    reason: str | None,
    xid: int | None = None,
) -> str:
    """One entry of a version 2 message, as JSON text: what `json` writes for the entry's dict
    (tests/unit/test_relay_markers.py holds them equal), built as text because this runs per
    record on the relay's hot path, where the dict and the encoder cost ~10 µs (a pydantic
    model more). This was still a sixth of the relay thread's time in a drain (py-spy); the
    parts a transaction's records share are built once (_names, _tail), ~10 % less per entry."""
    return (
        f'{{"op":"{op.value}","id":{id:d},{_names(tx_id, producer_group, topic)}'
        f'"key":{_key(key)},"partition":{_number(partition)},"offset":{_number(offset)},'
        f"{_tail(commit_ts, reason, xid)}"
    )


class MarkerBatcher:
    """Collects entries into version 2 messages of at most `max_bytes` of entries each."""

    def __init__(
        self, *, shard: int, relay: str, epoch: int, max_bytes: int, outbox: str | None = None
    ) -> None:
        envelope: dict[str, Any] = {"v": MARKER_VERSION, "shard": shard, "relay": relay}
        envelope["epoch"] = epoch
        if outbox is not None:
            envelope["outbox"] = outbox
        self._head = _dumps(envelope)[:-1] + ',"markers":['
        self.key = str(shard).encode("ascii")
        self.max_bytes = max_bytes
        self._entries: list[str] = []
        self._size = 0

    def add(self, entry: str) -> bytes | None:
        """Add an entry; returns a full message to send, or None while there is room."""
        if self._entries and self._size + len(entry) > self.max_bytes:
            message = self.take()
            self._entries.append(entry)
            self._size = len(entry) + 1
            return message
        self._entries.append(entry)
        self._size += len(entry) + 1
        return None

    def take(self) -> bytes | None:
        """The entries collected so far as one message (None when there are none)."""
        if not self._entries:
            return None
        message = (self._head + ",".join(self._entries) + "]}").encode()
        self._entries, self._size = [], 0
        return message


def marker_messages(
    entries: Iterable[str],
    *,
    shard: int,
    relay: str,
    epoch: int,
    max_bytes: int = 256 * 1024,
    outbox: str | None = None,
) -> list[bytes]:
    """Entries as whole version 2 messages (for writers other than the relay's hot path)."""
    batcher = MarkerBatcher(
        shard=shard, relay=relay, epoch=epoch, max_bytes=max_bytes, outbox=outbox
    )
    messages = [m for m in map(batcher.add, entries) if m is not None]
    last = batcher.take()
    return messages if last is None else [*messages, last]


def outbox_name(database: str, schema: str) -> str:
    """The `outbox` of a marker message: which outbox's rows its markers end."""
    return f"{database}/{schema}"


def marker_partition(shard: int, partitions: int) -> int:
    return shard % partitions
