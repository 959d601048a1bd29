"""The check handler, the protocol helpers, the ASGI app and the OpenAPI contract."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import pytest

from outbox import InvalidConfigError, OutboxError
from outbox.checkback import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    AsyncCheckHandler,
    CheckHandler,
    CheckRecord,
    CheckRequest,
    CheckResponse,
    HandlerResult,
    MalformedResponse,
    ReplayedMessage,
    ResponseMismatch,
    SignatureInvalid,
    Signer,
    TransactionStatus,
    Verifier,
    asgi_app,
    build_request,
    build_response,
    generate_secret,
    serve,
    verify_response,
)

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Resolver:
    """Records what it was asked and answers a fixed outcome."""

    def __init__(self, outcome: object = TransactionStatus.COMMIT) -> None:
        self.outcome = outcome
        self.asked: list[CheckRequest] = []

    def __call__(self, request: CheckRequest) -> Any:
        self.asked.append(request)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def make_request(tx_id: str = "tx-1") -> CheckRequest:
    return CheckRequest(
        producer_group="orders",
        tx_id=tx_id,
        check_count=3,
        first_prepared_at=datetime(2024, 5, 1, 12, 0, tzinfo=UTC),
        records=[
            CheckRecord(id=7, topic="orders.created", key=b"\x00k", headers={"h": "v"}),
            CheckRecord(id=8, topic="orders.created", key=None, headers={}),
        ],
    )


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def resolver() -> Resolver:
    return Resolver()


@pytest.fixture
def handler(resolver: Resolver, clock: Clock) -> CheckHandler:
    return CheckHandler(resolver, [NEW, OLD], now=clock)


def signed(body: bytes, *, secret: str = NEW, msg_id: str = "msg_req1") -> dict[str, str]:
    return Signer(secret).sign(msg_id, int(T0), body)


def error_of(result: HandlerResult) -> dict[str, str]:
    assert HEADER_SIGNATURE not in result.headers  # error answers are never signed
    assert result.headers["content-type"] == "application/json"
    parsed: dict[str, str] = json.loads(result.body)
    return parsed


# --- handler ---


def test_good_request_gets_a_signed_answer(
    handler: CheckHandler, resolver: Resolver, clock: Clock
) -> None:
    request = make_request()
    headers, body = build_request(Signer(NEW), request, now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 200
    assert resolver.asked == [request]
    answer = verify_response(
        Verifier([NEW], now=clock), headers[HEADER_ID], result.headers, result.body, tx_id="tx-1"
    )
    assert answer == CheckResponse(
        tx_id="tx-1", request_id=headers[HEADER_ID], status=TransactionStatus.COMMIT
    )
    assert result.headers[HEADER_ID] != headers[HEADER_ID]  # the answer has its own id
    assert result.headers[HEADER_TIMESTAMP] == str(int(T0))


def test_an_answer_is_signed_with_every_secret_so_a_checker_not_yet_rotated_accepts_it(
    handler: CheckHandler, clock: Clock
) -> None:
    """The application took the new secret first ([NEW, OLD]); the checker still has [OLD].
    Signed with the newest alone, its answer failed there, and every check counted towards
    max_checks until the checker was rotated too."""
    headers, body = build_request(Signer(OLD), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 200
    Verifier([OLD], now=clock).verify(result.headers, result.body)
    Verifier([NEW], now=clock).verify(result.headers, result.body)  # and one rotated already
    with pytest.raises(SignatureInvalid):
        Verifier([generate_secret()], now=clock).verify(result.headers, result.body)


@pytest.mark.parametrize(
    ("outcome", "status"),
    [("ROLLBACK", "ROLLBACK"), (TransactionStatus.UNKNOWN, "UNKNOWN"), ("commit", "COMMIT")],
)
def test_resolver_may_answer_a_plain_string_in_any_case(
    outcome: str, status: str, resolver: Resolver, handler: CheckHandler, clock: Clock
) -> None:
    """ "commit" was a 500, and a committed transaction that answered so at every check was
    discarded at max checks."""
    resolver.outcome = outcome
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 200
    assert json.loads(result.body)["status"] == status


@pytest.mark.parametrize("outcome", ["committed", None, 1, True])
def test_resolver_answering_no_status_is_a_500(
    outcome: object,
    resolver: Resolver,
    handler: CheckHandler,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    resolver.outcome = outcome
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 500
    assert error_of(result)["error"] == "resolver_failed"
    assert "expected COMMIT, ROLLBACK or UNKNOWN" in caplog.text


def test_resolver_exception_is_a_500_logged_and_unsigned(
    resolver: Resolver, handler: CheckHandler, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    resolver.outcome = RuntimeError("db down: password=hunter2")
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    with caplog.at_level(logging.ERROR, logger="outbox.checkback._handler"):
        result = handler.handle(headers, body)
    assert result.status_code == 500
    error = error_of(result)
    assert error["error"] == "resolver_failed"
    assert "hunter2" not in result.body.decode()  # internals stay in the log
    assert "tx_id=tx-1" in caplog.text
    assert caplog.records[-1].exc_info is not None


def test_async_resolver_in_sync_handler_is_a_500(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async def later() -> str:
        return "COMMIT"

    sync_handler = CheckHandler(lambda _: later(), [NEW], now=clock)  # type: ignore[arg-type,return-value]
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    assert sync_handler.handle(headers, body).status_code == 500
    assert "use AsyncCheckHandler" in caplog.text


class BrokenReplayStore:
    """A shared replay store out of reach."""

    def seen(self, msg_id: str, now: float) -> bool:
        raise ConnectionError("replay store at 10.0.0.9:6379 refused the connection")


def test_a_replay_store_that_fails_is_a_503_and_the_resolver_not_called(
    resolver: Resolver, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Its exception escaped handle(): the bundled server dropped the connection unanswered,
    an ASGI server sent a bare 500."""
    handler = CheckHandler(resolver, [NEW], replay_cache=BrokenReplayStore(), now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 503
    assert error_of(result)["error"] == "verification_unavailable"
    assert "10.0.0.9" not in result.body.decode()  # internals go to the log only
    assert "10.0.0.9" in caplog.text
    assert resolver.asked == []


def test_an_async_handler_asks_a_replay_store_off_the_event_loop(clock: Clock) -> None:
    loop_threads: list[int] = []
    store_threads: list[int] = []

    class Store:
        def seen(self, msg_id: str, now: float) -> bool:
            store_threads.append(threading.get_ident())
            return False

    async def resolve(request: CheckRequest) -> TransactionStatus:
        loop_threads.append(threading.get_ident())
        return TransactionStatus.COMMIT

    handler = AsyncCheckHandler(resolve, [NEW], replay_cache=Store(), now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    assert asyncio.run(handler.handle(headers, body)).status_code == 200
    assert len(store_threads) == 1
    assert store_threads != loop_threads


def test_forged_request_is_401_and_resolver_not_called(
    handler: CheckHandler, resolver: Resolver, clock: Clock
) -> None:
    other = "whsec_" + base64.b64encode(b"x" * 32).decode()
    headers, body = build_request(Signer(other), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 401
    assert error_of(result) == {
        "error": "signature_invalid",
        "detail": "no signature matches any configured secret",
    }
    assert resolver.asked == []


def test_replayed_request_is_401_and_resolver_called_once(
    handler: CheckHandler, resolver: Resolver, clock: Clock
) -> None:
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    assert handler.handle(headers, body).status_code == 200
    clock.t += 10
    replay = handler.handle(headers, body)
    assert replay.status_code == 401
    assert error_of(replay)["error"] == "replayed_message"
    assert len(resolver.asked) == 1


def test_stale_request_is_401(handler: CheckHandler, resolver: Resolver, clock: Clock) -> None:
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    clock.t += 301
    result = handler.handle(headers, body)
    assert error_of(result)["error"] == "timestamp_outside_tolerance"
    assert result.status_code == 401
    assert resolver.asked == []


def test_missing_signature_is_401(handler: CheckHandler, resolver: Resolver) -> None:
    result = handler.handle({}, b"{}")
    assert result.status_code == 401
    assert error_of(result) == {
        "error": "signature_missing",
        "detail": "webhook-id header is missing or empty",
    }


def test_unsigned_garbage_is_401_not_400(handler: CheckHandler) -> None:
    # Verification comes first: the parser never sees unauthenticated bytes.
    assert handler.handle({}, b"not json").status_code == 401


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"not json", "body: Invalid JSON"),
        (b"[]", "body: Input should be an object"),
        (b'{"protocol": 1}', "producer_group: Field required"),
        (b'{"protocol": 2}', "protocol: Input should be 1"),
    ],
)
def test_malformed_signed_body_is_400_naming_the_problem(
    body: bytes, expected: str, handler: CheckHandler, resolver: Resolver
) -> None:
    result = handler.handle(signed(body), body)
    assert result.status_code == 400
    error = error_of(result)
    assert error["error"] == "malformed_request"
    assert expected in error["detail"]
    assert resolver.asked == []


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("tx_id", None, "tx_id: Input should be a valid string"),
        ("check_count", 0, "check_count: Input should be greater than or equal to 1"),
        ("check_count", "3", "check_count: Input should be a valid integer"),
        (
            "first_prepared_at",
            "2024-05-01T12:00:00",
            "first_prepared_at: Input should have timezone",
        ),
        ("records", [{"id": 1, "topic": "t", "key": "%%", "headers": {}}], "records.0.key"),
        ("records", [{"id": 1, "topic": "t", "key": None}], "records.0.headers: Field required"),
    ],
)
def test_ill_typed_field_is_named(
    field: str, value: object, expected: str, handler: CheckHandler
) -> None:
    document = json.loads(make_request().model_dump_json())
    document[field] = value
    body = json.dumps(document).encode()
    result = handler.handle(signed(body), body)
    assert result.status_code == 400
    assert expected in error_of(result)["detail"]


def test_missing_field_is_named(handler: CheckHandler) -> None:
    document = json.loads(make_request().model_dump_json())
    del document["first_prepared_at"]
    body = json.dumps(document).encode()
    assert error_of(handler.handle(signed(body), body))["detail"] == (
        "first_prepared_at: Field required"
    )


def test_unknown_fields_are_ignored(handler: CheckHandler, resolver: Resolver) -> None:
    document = json.loads(make_request().model_dump_json())
    document["added_in_protocol_1_1"] = {"anything": True}
    document["records"][0]["partition_hint"] = 3
    body = json.dumps(document).encode()
    assert handler.handle(signed(body), body).status_code == 200
    assert resolver.asked == [make_request()]


def test_oversized_body_is_413_before_anything_else(clock: Clock, resolver: Resolver) -> None:
    small = CheckHandler(resolver, [NEW], now=clock, max_body_bytes=64)
    body = b" " * 65
    result = small.handle(signed(body), body)
    assert result.status_code == 413
    assert error_of(result)["error"] == "payload_too_large"
    assert resolver.asked == []


def test_empty_secret_list_is_refused(resolver: Resolver) -> None:
    with pytest.raises(ValueError, match="non-empty list of secrets"):
        CheckHandler(resolver, [])


def test_a_resolver_the_handler_cannot_call_is_refused_when_it_is_built() -> None:
    """Built without a word, every check answered 500 (said only in the log, per request) and
    counted against max_checks: every transaction not ended by then was discarded."""

    async def resolve_async(request: CheckRequest) -> str:
        return "COMMIT"

    with pytest.raises(InvalidConfigError, match="an async one goes with AsyncCheckHandler"):
        CheckHandler(resolve_async, [NEW])  # type: ignore[arg-type]
    for handler_class in (CheckHandler, AsyncCheckHandler):
        with pytest.raises(InvalidConfigError, match=r"resolver must be a .*function.* got str"):
            handler_class("COMMIT", [NEW])  # type: ignore[arg-type]
    assert AsyncCheckHandler(resolve_async, [NEW])  # its own kind
    with pytest.raises(OutboxError, match="serve\\(\\) takes a CheckHandler"):
        serve(AsyncCheckHandler(resolve_async, [NEW]))  # type: ignore[arg-type]


def test_an_async_replay_store_is_refused_when_the_handler_is_built(clock: Clock) -> None:
    """Its coroutine, never awaited, was true: every request was refused as replayed."""

    class AsyncStore:
        async def seen(self, msg_id: str, now: float) -> bool:
            return False

    with pytest.raises(InvalidConfigError, match=r"AsyncStore\.seen is a coroutine function"):
        AsyncCheckHandler(Resolver(), [NEW], replay_cache=AsyncStore())  # type: ignore[arg-type]

    class HiddenAsyncStore:  # a plain method that returns a coroutine
        def seen(self, msg_id: str, now: float) -> Any:
            return AsyncStore().seen(msg_id, now)

    resolver = Resolver()
    handler = CheckHandler(resolver, [NEW], replay_cache=HiddenAsyncStore(), now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    result = handler.handle(headers, body)
    assert result.status_code == 503  # the store's fault, not a replay (401)
    assert resolver.asked == []


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), 0, -1])
def test_a_body_limit_that_limits_nothing_is_refused(limit: float) -> None:
    """NaN passed `<= 0` and turned the limit off: any body was read and verified."""
    with pytest.raises(InvalidConfigError, match="max_body_bytes must be positive and finite"):
        CheckHandler(Resolver(), [NEW], max_body_bytes=limit)  # type: ignore[arg-type]


def test_async_handler_awaits_async_resolver(clock: Clock) -> None:
    asked: list[str] = []

    async def resolve(request: CheckRequest) -> TransactionStatus:
        await asyncio.sleep(0)
        asked.append(request.tx_id)
        return TransactionStatus.ROLLBACK

    handler = AsyncCheckHandler(resolve, [NEW], now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    result = asyncio.run(handler.handle(headers, body))
    assert result.status_code == 200
    assert json.loads(result.body)["status"] == "ROLLBACK"
    assert asked == ["tx-1"]


def test_async_handler_accepts_sync_resolver_and_reports_failures(clock: Clock) -> None:
    ok = AsyncCheckHandler(Resolver("UNKNOWN"), [NEW], now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    assert json.loads(asyncio.run(ok.handle(headers, body)).body)["status"] == "UNKNOWN"

    async def broken(request: CheckRequest) -> str:
        raise LookupError("no such table")

    failing = AsyncCheckHandler(broken, [NEW], now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    assert asyncio.run(failing.handle(headers, body)).status_code == 500


def test_async_handler_runs_a_sync_resolver_off_the_event_loop(clock: Clock) -> None:
    def slow(request: CheckRequest) -> str:
        time.sleep(0.3)  # a blocking database look-up
        return "COMMIT"

    handler = AsyncCheckHandler(slow, [NEW], now=clock)
    headers, body = build_request(Signer(NEW), make_request(), now=clock)

    async def main() -> tuple[HandlerResult, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        result = await handler.handle(headers, body)
        ticker.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert json.loads(result.body)["status"] == "COMMIT"
    # the loop went on while the resolver blocked (on it, it would tick once at most; a
    # loaded machine may tick far less often than every 10 ms)
    assert ticks >= 3


# --- the checker's side: building requests, verifying answers ---


def answer(request_id: str = "msg_req1", tx_id: str = "tx-1") -> tuple[dict[str, str], bytes]:
    return build_response(
        Signer(NEW),
        request_id=request_id,
        tx_id=tx_id,
        status=TransactionStatus.COMMIT,
        now=Clock(T0),
    )


def test_verify_response_accepts_the_matching_answer(clock: Clock) -> None:
    headers, body = answer()
    got = verify_response(Verifier([OLD, NEW], now=clock), "msg_req1", headers, body, tx_id="tx-1")
    assert got.status is TransactionStatus.COMMIT


def test_verify_response_rejects_answer_to_another_request(clock: Clock) -> None:
    headers, body = answer(request_id="msg_other")
    with pytest.raises(ResponseMismatch, match="answers request 'msg_other', not 'msg_req1'"):
        verify_response(Verifier([NEW], now=clock), "msg_req1", headers, body, tx_id="tx-1")


def test_verify_response_rejects_answer_about_another_tx(clock: Clock) -> None:
    headers, body = answer(tx_id="tx-2")
    with pytest.raises(ResponseMismatch, match="tx_id 'tx-2', not 'tx-1'"):
        verify_response(Verifier([NEW], now=clock), "msg_req1", headers, body, tx_id="tx-1")


def test_verify_response_rejects_tampered_body(clock: Clock) -> None:
    headers, body = answer()
    tampered = body.replace(b"COMMIT", b"ROLLBACK")
    assert tampered != body
    with pytest.raises(SignatureInvalid):
        verify_response(Verifier([NEW], now=clock), "msg_req1", headers, tampered, tx_id="tx-1")


def test_verify_response_rejects_wrong_secret(clock: Clock) -> None:
    headers, body = answer()
    with pytest.raises(SignatureInvalid):
        verify_response(Verifier([OLD], now=clock), "msg_req1", headers, body, tx_id="tx-1")


def test_verify_response_rejects_replayed_answer(clock: Clock) -> None:
    headers, body = answer()
    verifier = Verifier([NEW], now=clock)
    verify_response(verifier, "msg_req1", headers, body, tx_id="tx-1")
    with pytest.raises(ReplayedMessage):
        verify_response(verifier, "msg_req1", headers, body, tx_id="tx-1")


def test_verify_response_rejects_signed_nonsense(clock: Clock) -> None:
    body = b'{"tx_id": "tx-1", "request_id": "msg_req1", "status": "MAYBE"}'
    headers = Signer(NEW).sign("msg_resp", int(T0), body)
    with pytest.raises(MalformedResponse, match="status: Input should be 'COMMIT'"):
        verify_response(Verifier([NEW], now=clock), "msg_req1", headers, body, tx_id="tx-1")


def test_build_request_uses_fresh_ids_and_round_trips(clock: Clock) -> None:
    request = make_request()
    first, body = build_request(Signer(NEW), request, now=clock)
    second, _ = build_request(Signer(NEW), request, now=clock)
    assert first[HEADER_ID] != second[HEADER_ID]
    assert first[HEADER_ID].startswith("msg_")
    assert CheckRequest.model_validate_json(body) == request
    assert json.loads(body)["records"][0]["key"] == base64.b64encode(b"\x00k").decode()
    assert json.loads(body)["first_prepared_at"] == "2024-05-01T12:00:00Z"


# --- ASGI ---

Event = dict[str, Any]


def call_asgi(
    app: Callable[[Any, Any, Any], Awaitable[None]],
    scope: dict[str, Any],
    incoming: list[Event],
) -> tuple[list[Event], int]:
    """Run the app once; returns what it sent and how many messages it received."""
    sent: list[Event] = []
    received = 0

    async def receive() -> Event:
        nonlocal received
        received += 1
        return incoming.pop(0)

    async def send(message: Event) -> None:
        sent.append(message)

    async def main() -> None:
        await app(scope, receive, send)

    asyncio.run(main())
    return sent, received


def http_scope(
    method: str = "POST",
    path: str = "/outbox/check",
    headers: dict[str, str] | None = None,
    root_path: str = "",
) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "method": method,
        "path": path,
        "root_path": root_path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }


def response_of(sent: list[Event]) -> tuple[int, dict[str, str], bytes]:
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    body: bytes = sent[1]["body"]
    assert headers["content-length"] == str(len(body))
    return sent[0]["status"], headers, body


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_asgi_good_request(kind: str, resolver: Resolver, clock: Clock) -> None:
    handler: CheckHandler | AsyncCheckHandler = (
        CheckHandler(resolver, [NEW], now=clock)
        if kind == "sync"
        else AsyncCheckHandler(resolver, [NEW], now=clock)
    )
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    chunks: list[Event] = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:]},
    ]
    sent, _ = call_asgi(asgi_app(handler), http_scope(headers=headers), chunks)
    status, out_headers, out_body = response_of(sent)
    assert status == 200
    got = verify_response(
        Verifier([NEW], now=clock), headers[HEADER_ID], out_headers, out_body, tx_id="tx-1"
    )
    assert got.status is TransactionStatus.COMMIT
    assert resolver.asked == [make_request()]


def test_asgi_app_refuses_what_is_not_a_check_handler(resolver: Resolver) -> None:
    """As serve() does: asgi_app() took the resolver itself, and every check was answered 500
    (an AttributeError), counted as failed checks until max_checks discarded the transactions."""
    with pytest.raises(InvalidConfigError) as caught:
        asgi_app(resolver)  # type: ignore[arg-type]
    said = str(caught.value)
    assert said.startswith("asgi_app() takes a CheckHandler or an AsyncCheckHandler, not ")
    assert "asgi_app(AsyncCheckHandler(resolver, secrets))" in said
    with pytest.raises(InvalidConfigError, match=r"AsyncCheckHandler, not str$"):
        asgi_app("/outbox/check")  # type: ignore[arg-type]


def test_asgi_mounted_under_root_path(handler: CheckHandler, clock: Clock) -> None:
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    scope = http_scope(path="/app/outbox/check", root_path="/app", headers=headers)
    sent, _ = call_asgi(asgi_app(handler), scope, [{"type": "http.request", "body": body}])
    assert response_of(sent)[0] == 200


def test_asgi_other_path_is_404(handler: CheckHandler, resolver: Resolver) -> None:
    sent, _ = call_asgi(asgi_app(handler), http_scope(path="/other"), [])
    status, _, body = response_of(sent)
    assert status == 404
    assert json.loads(body)["error"] == "not_found"
    assert resolver.asked == []


def test_asgi_custom_path(handler: CheckHandler) -> None:
    app = asgi_app(handler, path="/internal/tx-check")
    assert response_of(call_asgi(app, http_scope(method="GET"), [])[0])[0] == 404
    sent, _ = call_asgi(app, http_scope(method="GET", path="/internal/tx-check"), [])
    assert response_of(sent)[0] == 405


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_asgi_other_method_is_405(method: str, handler: CheckHandler) -> None:
    sent, _ = call_asgi(asgi_app(handler), http_scope(method=method), [])
    status, headers, _ = response_of(sent)
    assert status == 405
    assert headers["allow"] == "POST"


@pytest.mark.parametrize("declared", ["101", "9" * 5000, "0" * 5000 + "101"])
def test_asgi_declared_oversize_is_413_without_reading(
    declared: str, resolver: Resolver, clock: Clock
) -> None:
    """5,000 digits: int() refuses more than 4,300 (ValueError), and the server answered 500."""
    handler = CheckHandler(resolver, [NEW], now=clock, max_body_bytes=100)
    scope = http_scope(headers={"content-length": declared})
    sent, received = call_asgi(asgi_app(handler), scope, [])
    assert response_of(sent)[0] == 413
    assert received == 0


def test_asgi_streamed_oversize_is_413_while_reading(resolver: Resolver, clock: Clock) -> None:
    handler = CheckHandler(resolver, [NEW], now=clock, max_body_bytes=100)
    chunks = [{"type": "http.request", "body": b"x" * 60, "more_body": True} for _ in range(10)]
    sent, received = call_asgi(asgi_app(handler), http_scope(), chunks)
    status, _, body = response_of(sent)
    assert status == 413
    assert json.loads(body)["detail"] == "body exceeds 100 bytes"
    assert received == 2  # stopped as soon as the limit was crossed
    assert resolver.asked == []


def test_asgi_client_disconnect_sends_nothing(handler: CheckHandler, resolver: Resolver) -> None:
    incoming: list[Event] = [
        {"type": "http.request", "body": b"{", "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent, _ = call_asgi(asgi_app(handler), http_scope(), incoming)
    assert sent == []
    assert resolver.asked == []


def test_asgi_forged_request_is_401(handler: CheckHandler, clock: Clock) -> None:
    headers, body = build_request(Signer(NEW), make_request(), now=clock)
    headers[HEADER_SIGNATURE] = "v1,AAAA"
    scope = http_scope(headers=headers)
    sent, _ = call_asgi(asgi_app(handler), scope, [{"type": "http.request", "body": body}])
    assert response_of(sent)[0] == 401


def test_asgi_lifespan(handler: CheckHandler) -> None:
    incoming: list[Event] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent, _ = call_asgi(asgi_app(handler), {"type": "lifespan"}, incoming)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_asgi_refuses_websockets(handler: CheckHandler) -> None:
    with pytest.raises(ValueError, match="unsupported ASGI scope type 'websocket'"):
        call_asgi(asgi_app(handler), {"type": "websocket", "path": "/outbox/check"}, [])


# --- the OpenAPI contract matches the models ---


def load_openapi() -> dict[str, Any]:
    # The file is JSON, which is also YAML 1.2: the stdlib can check it without PyYAML.
    text = resources.files("outbox.checkback").joinpath("openapi.yaml").read_text()
    document: dict[str, Any] = json.loads(text)
    return document


def test_openapi_schemas_match_models() -> None:
    schemas = load_openapi()["components"]["schemas"]
    for model in (CheckRequest, CheckResponse, CheckRecord):
        generated = model.model_json_schema()
        ours = schemas[model.__name__]
        assert sorted(ours["required"]) == sorted(generated["required"]), model.__name__
        assert set(ours["properties"]) == set(generated["properties"]), model.__name__
    assert schemas["TransactionStatus"]["enum"] == [s.value for s in TransactionStatus]


def test_openapi_operation_headers_and_answers() -> None:
    document = load_openapi()
    assert document["openapi"].startswith("3.1")
    operation = document["paths"]["/outbox/check"]["post"]
    names = {HEADER_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE}
    assert {p["name"] for p in operation["parameters"] if p["in"] == "header"} == names
    responses = operation["responses"]
    assert set(responses) == {"200", "400", "401", "411", "413", "500", "503"}
    assert set(responses["200"]["headers"]) == names
    kinds_401 = responses["401"]["content"]["application/json"]["schema"]["allOf"][1]
    assert set(kinds_401["properties"]["error"]["enum"]) == {
        "signature_missing",
        "signature_invalid",
        "timestamp_outside_tolerance",
        "replayed_message",
    }
