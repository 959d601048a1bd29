"""Check-back wire protocol, version 1: the bodies, and signing/verifying them on each side.

The checker POSTs a signed ``CheckRequest`` about one transaction; the application answers a signed
``CheckResponse`` whose ``request_id`` echoes the request's ``webhook-id``, so an answer captured
from one check cannot be replayed as the answer to another. ``openapi.yaml`` is the same contract
for applications written in other languages.
"""

from __future__ import annotations

import base64
import binascii
import enum
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Annotated, Final, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
)

from outbox._describe import describe

from ._signing import (
    HEADER_ID,
    MalformedRequest,
    MalformedResponse,
    ResponseMismatch,
    Signer,
    Verifier,
)

PROTOCOL_VERSION: Final = 1


class TransactionStatus(enum.StrEnum):
    """The application's verdict on a local transaction (RocketMQ's LocalTransactionState)."""

    COMMIT = "COMMIT"
    """The local transaction committed: the records become ``committed`` and are delivered."""
    ROLLBACK = "ROLLBACK"
    """It rolled back (or never happened): the records become ``rolled_back``, never delivered."""
    UNKNOWN = "UNKNOWN"
    """Not decided yet (still running?): the checker asks again later, with backoff."""


def _from_base64(value: object) -> object:
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ValueError("must be standard base64") from None
    return value


# Record keys are arbitrary bytes; on the wire they are standard base64 (not pydantic's
# Base64Bytes, whose encoder inserts newlines every 76 characters).
_B64Bytes = Annotated[
    bytes,
    BeforeValidator(_from_base64),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str),
]

# strict: a wire protocol should not guess ("3" is not 3); extra="ignore": newer checkers may add
# fields without breaking older handlers.
_WIRE = ConfigDict(strict=True, extra="ignore", frozen=True)


class CheckRecord(BaseModel):
    """One prepared record of the transaction, so the resolver can tell what it is about."""

    model_config = _WIRE

    id: int = Field(description="The record's id in the outbox table.")
    topic: str = Field(description="The Kafka topic the record is meant for.")
    key: _B64Bytes | None = Field(description="The Kafka key, standard base64; null if none.")
    headers: dict[str, str] = Field(description="The record's Kafka headers.")


class CheckRequest(BaseModel):
    """What the checker asks: did the local transaction ``tx_id`` commit?"""

    model_config = _WIRE

    protocol: Literal[1] = PROTOCOL_VERSION
    producer_group: str = Field(min_length=1)
    tx_id: str = Field(min_length=1)
    check_count: int = Field(ge=1, description="1 on the first check, then 2, 3, ...")
    first_prepared_at: AwareDatetime = Field(description="When the first record was prepared.")
    records: list[CheckRecord] = Field(
        description="The first records of the transaction, by id: as many as the checker's "
        "request_max_records and request_max_bytes allow (see record_count)."
    )
    record_count: int | None = Field(
        default=None,
        ge=0,
        description="How many records the transaction has, those left out of `records` too; "
        "null from checkers that did not say.",
    )


class CheckResponse(BaseModel):
    """What the application answers."""

    model_config = _WIRE

    protocol: Literal[1] = PROTOCOL_VERSION
    tx_id: str = Field(min_length=1)
    request_id: str = Field(min_length=1, description="The request's webhook-id, echoed.")
    status: TransactionStatus


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def parse_request(body: bytes) -> CheckRequest:
    try:
        return CheckRequest.model_validate_json(body)
    except ValidationError as exc:
        raise MalformedRequest(describe(exc, "body")) from None


def _signed_json(
    signer: Signer, model: BaseModel, now: Callable[[], float]
) -> tuple[dict[str, str], bytes]:
    body = model.model_dump_json().encode()
    headers = signer.sign(new_message_id(), int(now()), body)
    headers["content-type"] = "application/json"
    return headers, body


def build_request(
    signer: Signer, request: CheckRequest, *, now: Callable[[], float] = time.time
) -> tuple[dict[str, str], bytes]:
    """Headers and body of a signed check request, with a fresh ``webhook-id``.

    Use a new call (a new id) for every attempt, retries included: the handler rejects an id it
    has already seen.
    """
    return _signed_json(signer, request, now)


def build_response(
    signer: Signer,
    *,
    request_id: str,
    tx_id: str,
    status: TransactionStatus,
    now: Callable[[], float] = time.time,
) -> tuple[dict[str, str], bytes]:
    """Headers and body of a signed answer to the request whose ``webhook-id`` is ``request_id``."""
    answer = CheckResponse(tx_id=tx_id, request_id=request_id, status=status)
    return _signed_json(signer, answer, now)


def verify_response(
    verifier: Verifier,
    request_id: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tx_id: str,
) -> CheckResponse:
    """Authenticate and parse a 200 answer; check it answers this request about this ``tx_id``.

    Raises ``AuthenticationFailed``, ``MalformedResponse`` or ``ResponseMismatch``: in every case
    the caller must act as if there were no answer. Non-200 answers are not signed; don't pass them.
    """
    verifier.verify(headers, body)
    try:
        answer = CheckResponse.model_validate_json(body)
    except ValidationError as exc:
        raise MalformedResponse(describe(exc, "body")) from None
    if answer.request_id != request_id:
        raise ResponseMismatch(
            f"response answers request {answer.request_id!r}, not {request_id!r} "
            f"(the {HEADER_ID} that was sent)"
        )
    if answer.tx_id != tx_id:
        raise ResponseMismatch(f"response is about tx_id {answer.tx_id!r}, not {tx_id!r}")
    return answer


def length_over(declared: str, limit: int) -> bool:
    """A Content-Length of ASCII digits over `limit`, told without int() of it all: Python
    refuses to convert more than 4,300 digits (ValueError), which a client or endpoint chooses."""
    digits = declared.lstrip("0")
    return len(digits) > len(str(limit)) or (digits != "" and int(digits) > limit)
