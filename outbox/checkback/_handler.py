"""Framework-neutral check handler: headers and body in, status code, headers and body out.

Order matters: size limit, then signature (401), then parsing (400), so unauthenticated bytes never
reach the JSON parser; then the application's resolver (500 if it fails), then a signed 200.
Only the 200 answer is signed; error bodies are plain JSON ``{"error": kind, "detail": text}``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from outbox._callbacks import call_back, is_async
from outbox._errors import InvalidConfigError

from ._protocol import CheckRequest, TransactionStatus, build_response, parse_request
from ._signing import (
    HEADER_ID,
    AuthenticationFailed,
    MalformedRequest,
    ReplayCache,
    Secret,
    Signer,
    Verifier,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1_048_576

#: Answers from the application's own database: did ``tx_id`` commit? Called again for every check
#: of the same transaction, so it must only read. Answer UNKNOWN while the transaction still runs.
Resolver = Callable[[CheckRequest], TransactionStatus | str]
AsyncResolver = Callable[
    [CheckRequest], Awaitable[TransactionStatus | str] | TransactionStatus | str
]


@dataclass(frozen=True)
class HandlerResult:
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def error_result(
    status_code: int, kind: str, detail: str, extra_headers: Mapping[str, str] | None = None
) -> HandlerResult:
    body = json.dumps({"error": kind, "detail": detail}).encode()
    return HandlerResult(
        status_code, {"content-type": "application/json", **(extra_headers or {})}, body
    )


def too_large_result(limit: int) -> HandlerResult:
    return error_result(413, "payload_too_large", f"body exceeds {limit} bytes")


def _resolver_failed() -> HandlerResult:
    # Generic on purpose: the exception may carry internals (DSNs, SQL); it goes to the log only.
    return error_result(500, "resolver_failed", "the application could not decide; see its log")


class _HandlerBase:
    def __init__(
        self,
        secrets: Sequence[Secret],
        *,
        tolerance_s: float,
        replay_cache: ReplayCache | None,
        now: Callable[[], float],
        max_body_bytes: int,
    ) -> None:
        # not `<= 0` alone: NaN passed it and turned the limit off, and inf as well
        if not (math.isfinite(max_body_bytes) and max_body_bytes > 0):
            raise InvalidConfigError(
                f"max_body_bytes must be positive and finite, got {max_body_bytes!r}"
            )
        # Verifier first: it rejects an empty secret list with a clear message.
        self._verifier = Verifier(
            secrets, tolerance_s=tolerance_s, replay_cache=replay_cache, now=now
        )
        self._signer = Signer(secrets)
        self._now = now
        self.max_body_bytes = max_body_bytes

    def _accept(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[str, CheckRequest] | HandlerResult:
        """The verified request id and request, or the error answer."""
        if len(body) > self.max_body_bytes:
            return too_large_result(self.max_body_bytes)
        # Lower-case once, so the id we echo is exactly the one that was verified.
        headers = {k.lower(): v for k, v in headers.items()}
        try:
            self._verifier.verify(headers, body)
        except AuthenticationFailed as exc:
            logger.warning("check request rejected: %s: %s", exc.kind, exc)
            return error_result(401, exc.kind, str(exc))
        except Exception:
            # A replay store of the application's that failed (a shared cache unreachable):
            # not the checker's fault, and it asks again later. Details to the log only.
            logger.exception("check request not verified: the verification itself failed")
            return error_result(
                503, "verification_unavailable", "the request could not be verified; see its log"
            )
        try:
            request = parse_request(body)
        except MalformedRequest as exc:
            logger.warning("check request rejected: %s: %s", exc.kind, exc)
            return error_result(400, exc.kind, str(exc))
        return headers[HEADER_ID].strip(), request

    def _answer(self, request_id: str, request: CheckRequest, outcome: object) -> HandlerResult:
        status = _to_status(outcome)
        if status is None:
            logger.error(
                "check resolver returned %.100r for tx_id=%s; expected COMMIT, ROLLBACK or UNKNOWN",
                outcome,
                request.tx_id,
            )
            return _resolver_failed()
        headers, body = build_response(
            self._signer, request_id=request_id, tx_id=request.tx_id, status=status, now=self._now
        )
        return HandlerResult(200, headers, body)


def _to_status(outcome: object) -> TransactionStatus | None:
    if isinstance(outcome, TransactionStatus):
        return outcome
    if isinstance(outcome, str):
        try:
            return TransactionStatus(outcome.upper())  # "commit" means what it says
        except ValueError:
            return None
    return None


def _log_resolver_failure(request: CheckRequest) -> None:
    logger.exception(
        "check resolver failed for producer_group=%s tx_id=%s",
        request.producer_group,
        request.tx_id,
    )


class CheckHandler(_HandlerBase):
    """Answers check requests with a synchronous resolver. Thread-safe.

    ``secrets`` are newest first: requests signed with any of them are accepted, answers are
    signed with every one (see ``Signer``). ``replay_cache`` defaults to one in this process
    (see ``InMemoryReplayCache`` for several replicas).
    """

    def __init__(
        self,
        resolver: Resolver,
        secrets: Sequence[Secret],
        *,
        tolerance_s: float = 300,
        replay_cache: ReplayCache | None = None,
        now: Callable[[], float] = time.time,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        super().__init__(
            secrets,
            tolerance_s=tolerance_s,
            replay_cache=replay_cache,
            now=now,
            max_body_bytes=max_body_bytes,
        )
        if not callable(resolver) or is_async(resolver):
            # else every check answered 500, said only in the log, and counted against
            # max_checks: every unresolved transaction was discarded
            raise InvalidConfigError(
                "CheckHandler's resolver must be a plain function of the CheckRequest, got "
                f"{type(resolver).__name__}"
                + (": an async one goes with AsyncCheckHandler" if is_async(resolver) else "")
            )
        self._resolver = resolver

    def handle(self, headers: Mapping[str, str], body: bytes) -> HandlerResult:
        accepted = self._accept(headers, body)
        if isinstance(accepted, HandlerResult):
            return accepted
        request_id, request = accepted
        try:
            outcome: object = self._resolver(request)
        except Exception:
            _log_resolver_failure(request)
            return _resolver_failed()
        if inspect.isawaitable(outcome):
            if inspect.iscoroutine(outcome):
                outcome.close()  # never awaited: close it so Python does not warn later
            logger.error("check resolver is async; use AsyncCheckHandler")
            return _resolver_failed()
        return self._answer(request_id, request, outcome)


class AsyncCheckHandler(_HandlerBase):
    """Like ``CheckHandler`` but ``await handler.handle(...)``; the resolver may be async or not
    (a sync one runs in a worker thread, so that it does not stall the event loop). So does the
    verification when ``replay_cache`` is given: a shared store answers over the network."""

    def __init__(
        self,
        resolver: AsyncResolver,
        secrets: Sequence[Secret],
        *,
        tolerance_s: float = 300,
        replay_cache: ReplayCache | None = None,
        now: Callable[[], float] = time.time,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        super().__init__(
            secrets,
            tolerance_s=tolerance_s,
            replay_cache=replay_cache,
            now=now,
            max_body_bytes=max_body_bytes,
        )
        if not callable(resolver):
            raise InvalidConfigError(
                "AsyncCheckHandler's resolver must be a function (async or not) of the "
                f"CheckRequest, got {type(resolver).__name__}"
            )
        self._resolver = resolver
        self._verify_in_thread = replay_cache is not None

    async def handle(self, headers: Mapping[str, str], body: bytes) -> HandlerResult:
        if self._verify_in_thread:
            accepted = await asyncio.to_thread(self._accept, headers, body)
        else:
            accepted = self._accept(headers, body)
        if isinstance(accepted, HandlerResult):
            return accepted
        request_id, request = accepted
        try:
            outcome: object = await call_back(self._resolver, request)
        except Exception:
            _log_resolver_failure(request)
            return _resolver_failed()
        return self._answer(request_id, request, outcome)
