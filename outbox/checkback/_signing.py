"""Standard Webhooks signatures (https://www.standardwebhooks.com) for check-back messages.

Both directions use one scheme: the checker signs its request, the application signs its answer.
Signed content is ``f"{webhook-id}.{webhook-timestamp}.{body}"``; the signature is the base64 of its
HMAC-SHA256, sent as ``v1,<base64>`` in ``webhook-signature`` (several, space-separated, while
secrets rotate).

Errors, grouped by how the receiver reacts::

    CheckbackError
     ├── AuthenticationFailed       -> 401; the message is ignored, nothing is parsed
     │    ├── SignatureMissing
     │    ├── SignatureInvalid
     │    ├── TimestampOutsideTolerance
     │    └── ReplayedMessage
     ├── MalformedRequest           -> 400; authentic but not a check request we understand
     ├── MalformedResponse          -> checker: no answer, check again later
     └── ResponseMismatch           -> checker: no answer (an answer to some other question)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import inspect
import math
import re
import secrets as _secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, TypeAlias

from pydantic import SecretBytes, SecretStr

from outbox._callbacks import is_async
from outbox._errors import InvalidConfigError, OutboxError

HEADER_ID: Final = "webhook-id"
HEADER_TIMESTAMP: Final = "webhook-timestamp"
HEADER_SIGNATURE: Final = "webhook-signature"
DEFAULT_TOLERANCE_S: Final = 300
_ALL_HEADERS: Final = (HEADER_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE)

_SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - the format's prefix, not a secret
_MIN_KEY_BYTES: Final = 16
# No "." in ids: the signed content is dot-separated, so a dot in the id would make it ambiguous.
_ID_RE: Final = re.compile(r"[A-Za-z0-9_\-]{1,256}")
_TIMESTAMP_RE: Final = re.compile(r"[0-9]{1,15}")

#: A secret as ``whsec_<base64>`` text, raw key bytes, or either wrapped by pydantic.
Secret: TypeAlias = str | bytes | SecretStr | SecretBytes


class CheckbackError(OutboxError):
    """Root of every error raised by ``outbox.checkback`` (under the library's ``OutboxError``)."""


class AuthenticationFailed(CheckbackError):
    """The message could not be authenticated; it must be ignored."""

    kind = "authentication_failed"


class SignatureMissing(AuthenticationFailed):
    kind = "signature_missing"


class SignatureInvalid(AuthenticationFailed):
    kind = "signature_invalid"


class TimestampOutsideTolerance(AuthenticationFailed):
    kind = "timestamp_outside_tolerance"


class ReplayedMessage(AuthenticationFailed):
    kind = "replayed_message"


class MalformedRequest(CheckbackError):
    kind = "malformed_request"


class MalformedResponse(CheckbackError):
    kind = "malformed_response"


class ResponseMismatch(CheckbackError):
    kind = "response_mismatch"


def decode_secret(secret: Secret) -> bytes:
    """Key bytes from ``whsec_<base64>`` text or raw bytes. Messages never include the secret."""
    if isinstance(secret, SecretStr | SecretBytes):
        secret = secret.get_secret_value()
    if isinstance(secret, str):
        if not secret.startswith(_SECRET_PREFIX):
            raise InvalidConfigError(
                f"secret text must have the form '{_SECRET_PREFIX}<base64 key>'; "
                "pass raw key material as bytes"
            )
        try:
            key = base64.b64decode(secret.removeprefix(_SECRET_PREFIX), validate=True)
        except binascii.Error:
            raise InvalidConfigError(
                f"secret after '{_SECRET_PREFIX}' is not valid base64"
            ) from None
    else:
        key = bytes(secret)
    if len(key) < _MIN_KEY_BYTES:
        raise InvalidConfigError(
            f"secret key is {len(key)} bytes; at least {_MIN_KEY_BYTES} are required"
        )
    return key


def generate_secret(n_bytes: int = 32) -> str:
    """A new random secret in the ``whsec_<base64>`` form, for configuration files."""
    return _SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(n_bytes)).decode("ascii")


def _signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> bytes:
    content = f"{msg_id}.{timestamp}.".encode() + body
    return hmac.new(key, content, hashlib.sha256).digest()


def _check_id(msg_id: str) -> None:
    if not _ID_RE.fullmatch(msg_id):
        raise ValueError("message id must be 1-256 characters of [A-Za-z0-9_-]")


class Signer:
    """Signs with every secret it is given, one ``v1`` entry each.

    A receiver that has any of them accepts the message, so while a secret rotates the two
    sides may take the new one, and later drop the old one, in either order. Signed with the
    newest alone, an answer from a side that had the new secret first failed at a side that
    did not have it yet, and each such check counted towards ``max_checks``.
    """

    def __init__(self, secrets: Secret | Sequence[Secret], /) -> None:
        if isinstance(secrets, str | bytes | SecretStr | SecretBytes):
            given: list[Secret] = [secrets]
        else:
            given = list(secrets)
        if not given:
            raise InvalidConfigError("a Signer needs at least one secret")
        self._keys = [decode_secret(s) for s in given]

    def sign(self, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
        _check_id(msg_id)
        signatures = " ".join(
            "v1," + base64.b64encode(_signature(key, msg_id, timestamp, body)).decode("ascii")
            for key in self._keys
        )
        return {HEADER_ID: msg_id, HEADER_TIMESTAMP: str(timestamp), HEADER_SIGNATURE: signatures}


class ReplayCache(Protocol):
    """Where a verifier records the ids it accepted.

    A message is acceptable while its timestamp is within ``tolerance_s`` of the receiver's
    clock, so an id must be kept at least ``2 * tolerance_s`` seconds after it was first seen
    (a message stamped ``tolerance_s`` ahead stays acceptable that long). Kept less, a captured
    message can be replayed once its id is forgotten.
    """

    def seen(self, msg_id: str, now: float) -> bool:
        """Record ``msg_id`` and answer whether it had been recorded before (and not expired)."""
        ...


class InMemoryReplayCache:
    """Ids seen in this process, kept ``ttl_s`` seconds, at most ``max_entries`` (oldest evicted).

    ``ttl_s`` defaults to twice the tolerance of the verifier (handler) it is given to; one given
    shorter than that is refused there. With several replicas behind a load balancer, a replay
    can reach a replica that never saw the original: plug in a shared store (e.g. Redis
    ``SET NX EX`` with an expiry of twice the tolerance) implementing ``ReplayCache``.
    Size ``max_entries`` above peak checks/second x ``ttl_s``: an evicted id can be replayed.
    """

    def __init__(self, ttl_s: float | None = None, max_entries: int = 100_000) -> None:
        # not `ttl_s <= 0`: NaN passes that, and a cache of NaN seconds kept nothing
        if (ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s > 0)) or max_entries <= 0:
            raise InvalidConfigError(
                f"ttl_s and max_entries must be positive and finite, got {ttl_s!r} and "
                f"{max_entries!r}"
            )
        self._ttl_given = ttl_s is not None
        self._ttl_s = 2 * DEFAULT_TOLERANCE_S if ttl_s is None else ttl_s
        self._max_entries = max_entries
        self._entries: OrderedDict[str, float] = OrderedDict()  # insertion order = age order
        self._lock = threading.Lock()

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def cover(self, tolerance_s: float) -> None:
        """Keep ids long enough for a verifier of ``tolerance_s``: twice it, at least."""
        needed = 2 * tolerance_s
        with self._lock:
            if self._ttl_s >= needed:
                return
            if self._ttl_given:
                raise InvalidConfigError(
                    f"the replay cache keeps ids {self._ttl_s:g}s, under twice the tolerance "
                    f"({tolerance_s:g}s): a message replayed after {self._ttl_s:g}s would be "
                    f"accepted again; give it ttl_s={needed:g} or more, or leave ttl_s out"
                )
            self._ttl_s = needed

    def seen(self, msg_id: str, now: float) -> bool:
        with self._lock:
            while self._entries:
                oldest_id, first_seen = next(iter(self._entries.items()))
                if now - first_seen <= self._ttl_s:
                    break
                del self._entries[oldest_id]
            if msg_id in self._entries:
                return True
            self._entries[msg_id] = now
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
            return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class Verifier:
    """Checks signature, timestamp window and replay, in that order.

    Replay is checked last so that unauthenticated traffic cannot fill the cache and lock out
    genuine ids. The default cache keeps ids for twice the tolerance: a message stamped up to
    ``tolerance_s`` in the future stays acceptable for ``2 * tolerance_s`` after it was first seen.
    """

    def __init__(
        self,
        secrets: Sequence[Secret],
        *,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        replay_cache: ReplayCache | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(secrets, str | bytes | SecretStr | SecretBytes) or not secrets:
            raise InvalidConfigError("secrets must be a non-empty list of secrets, newest first")
        # not `tolerance_s <= 0`: NaN passed that and turned off the age and replay checks,
        # and inf the age check
        if not (math.isfinite(tolerance_s) and tolerance_s > 0):
            raise InvalidConfigError(
                f"tolerance_s must be positive and finite, got {tolerance_s!r}"
            )
        self._keys = [decode_secret(s) for s in secrets]
        self._tolerance_s = tolerance_s
        if replay_cache is not None and is_async(getattr(replay_cache, "seen", None)):
            # its coroutine, never awaited, is true: every request was refused as replayed
            raise InvalidConfigError(
                f"replay_cache {type(replay_cache).__name__}.seen is a coroutine function; it must "
                "be synchronous (AsyncCheckHandler runs it in a worker thread, so a blocking "
                "client such as redis.Redis fits, an asyncio one does not)"
            )
        # `or` would swap an empty (falsy) cache the caller gave for a new one
        self._replay_cache = InMemoryReplayCache() if replay_cache is None else replay_cache
        if isinstance(self._replay_cache, InMemoryReplayCache):
            self._replay_cache.cover(tolerance_s)
        self._now = now

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        lowered = {k.lower(): v for k, v in headers.items()}
        msg_id, raw_ts, raw_sigs = (lowered.get(h, "").strip() for h in _ALL_HEADERS)
        for name, value in zip(_ALL_HEADERS, (msg_id, raw_ts, raw_sigs), strict=True):
            if not value:
                raise SignatureMissing(f"{name} header is missing or empty")
        if not _ID_RE.fullmatch(msg_id):
            raise SignatureInvalid(f"{HEADER_ID} header must be 1-256 characters of [A-Za-z0-9_-]")
        if not _TIMESTAMP_RE.fullmatch(raw_ts):
            raise SignatureInvalid(f"{HEADER_TIMESTAMP} header must be integer Unix seconds")
        timestamp = int(raw_ts)

        candidates = [_decode_v1(part) for part in raw_sigs.split(" ")]
        given = [sig for sig in candidates if sig is not None]
        if not given:
            raise SignatureInvalid(f"{HEADER_SIGNATURE} header has no well-formed 'v1,<base64>'")
        # Every comparison runs, so timing does not reveal which secret or signature matched.
        matched = False
        for key in self._keys:
            expected = _signature(key, msg_id, timestamp, body)
            for sig in given:
                matched |= hmac.compare_digest(expected, sig)
        if not matched:
            raise SignatureInvalid("no signature matches any configured secret")

        now = self._now()
        if timestamp < now - self._tolerance_s:
            raise TimestampOutsideTolerance(
                f"{HEADER_TIMESTAMP} is {now - timestamp:.0f}s old; "
                f"tolerance is {self._tolerance_s:.0f}s"
            )
        if timestamp > now + self._tolerance_s:
            raise TimestampOutsideTolerance(
                f"{HEADER_TIMESTAMP} is {timestamp - now:.0f}s in the future; "
                f"tolerance is {self._tolerance_s:.0f}s"
            )
        seen: object = self._replay_cache.seen(msg_id, now)  # checked: callers' code
        if inspect.isawaitable(seen):  # a plain function returning one: refused as above
            if inspect.iscoroutine(seen):
                seen.close()
            raise TypeError(
                f"replay_cache {type(self._replay_cache).__name__}.seen returned an "
                "awaitable; it must be synchronous and return a bool"
            )
        if seen:
            raise ReplayedMessage(f"{HEADER_ID} was already used within the tolerance window")


def _decode_v1(part: str) -> bytes | None:
    """Signature bytes of one ``v1,<base64>`` entry; None for other versions or garbage."""
    version, _, encoded = part.partition(",")
    if version != "v1" or not encoded:
        return None
    try:
        return base64.b64decode(encoded, validate=True)
    except ValueError:  # binascii.Error, and plain ValueError for text that is not ASCII
        return None
