"""Op markers: the relay's record of every outbox record it ended (RocketMQ's op messages).

For every record it ends, the relay writes one marker to the op-marker topic in the same Kafka
transaction as the record itself (or its dead-letter copy). A `read_committed` reader of the topic
therefore sees a marker if and only if the record's end is committed, which is what recovery and
reconciliation rely on.

Wire format (version 1), on the op-marker topic:
  partition  shard % op_marker_partitions (recovery reads only the partitions of its shards)
  key        the record id, decimal ASCII
  value      JSON: {"v": 1, "op": "delivered" | "rolled_back" | "discarded" | "parked",
                    "id": int, "tx_id": str, "producer_group": str, "topic": str,
                    "key": base64|null, "shard": int, "partition": int|null, "offset": int|null,
                    "commit_ts": RFC 3339|null, "reason": str|null, "relay": str, "epoch": int}
             `partition` / `offset` are where a delivered record landed on its topic (for a
             discarded or parked record: where its copy landed on the dead-letter topic).
Delivered records carry the headers OUTBOX_ID_HEADER and OUTBOX_TX_ID_HEADER.
"""

from __future__ import annotations

import base64
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

OUTBOX_ID_HEADER = "outbox-id"
OUTBOX_TX_ID_HEADER = "outbox-tx-id"
OUTBOX_PRODUCER_GROUP_HEADER = "outbox-producer-group"
OUTBOX_REASON_HEADER = "outbox-reason"  # on dead-letter copies
OUTBOX_VALUE_OMITTED_HEADER = "outbox-value-omitted"  # a copy too large to carry its value


class Op(StrEnum):
    DELIVERED = "delivered"
    ROLLED_BACK = "rolled_back"
    DISCARDED = "discarded"
    PARKED = "parked"


def _b64decode(value: object) -> object:
    return base64.b64decode(value) if isinstance(value, str) else value


_Base64 = Annotated[
    bytes,
    BeforeValidator(_b64decode),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str),
]


class OpMarker(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    v: Literal[1] = 1
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
    relay: str
    epoch: int

    def encode(self) -> tuple[bytes, bytes]:
        """(key, value) for the op-marker topic."""
        return str(self.id).encode("ascii"), self.model_dump_json().encode()

    @classmethod
    def decode(cls, value: bytes) -> OpMarker:
        return cls.model_validate_json(value)


def marker_partition(shard: int, partitions: int) -> int:
    return shard % partitions
