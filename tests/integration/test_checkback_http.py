"""The check handler behind a real HTTP server on loopback. No database or broker needed."""

from __future__ import annotations

import base64
import fcntl
import http.client
import json
import logging
import os
import resource
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from email.message import Message
from typing import Any

import pytest

from checker import HttpCheckClient
from checker.config import EndpointSettings
from outbox import InvalidConfigError
from outbox.checkback import (
    HEADER_ID,
    HEADER_SIGNATURE,
    AsyncCheckHandler,
    CheckHandler,
    CheckRecord,
    CheckRequest,
    RunningServer,
    Signer,
    TransactionStatus,
    Verifier,
    build_request,
    generate_secret,
    serve,
    verify_response,
)

SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
TIMEOUT_S = 10
MAX_BODY = 4096

# No proxy from the environment may sit between the test and a loopback server.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Resolver:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, request: CheckRequest) -> TransactionStatus:
        self.asked.append(request.tx_id)
        rolled_back = request.tx_id.startswith("rb")
        return TransactionStatus.ROLLBACK if rolled_back else TransactionStatus.COMMIT


@pytest.fixture
def resolver() -> Resolver:
    return Resolver()


@pytest.fixture
def server(resolver: Resolver) -> Iterator[RunningServer]:
    with serve(CheckHandler(resolver, [SECRET], max_body_bytes=MAX_BODY)) as running:
        yield running


def check_request(tx_id: str = "tx-1") -> CheckRequest:
    return CheckRequest(
        producer_group="orders",
        tx_id=tx_id,
        check_count=1,
        first_prepared_at=datetime(2024, 5, 1, tzinfo=UTC),
        records=[CheckRecord(id=1, topic="orders.created", key=b"42", headers={})],
    )


def post(url: str, headers: dict[str, str], body: bytes) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _opener.open(request, timeout=TIMEOUT_S) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers, error.read()


def test_good_request_gets_verifiable_answer(server: RunningServer, resolver: Resolver) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}/outbox/check"
    headers, body = build_request(Signer(SECRET), check_request("rb-7"))
    status, answer_headers, answer_body = post(server.url, headers, body)
    assert status == 200
    answer = verify_response(
        Verifier([SECRET]),
        headers[HEADER_ID],
        dict(answer_headers.items()),
        answer_body,
        tx_id="rb-7",
    )
    assert answer.status is TransactionStatus.ROLLBACK
    assert resolver.asked == ["rb-7"]


@pytest.mark.parametrize("rotated_first", ["application", "checker"])
def test_either_side_may_take_a_new_secret_first(resolver: Resolver, rotated_first: str) -> None:
    """The checker's client and the application's handler, each signing with every secret it
    has: while only one side has the new secret, checks still get their answers."""
    new = generate_secret()
    both, old_only = [new, SECRET], [SECRET]
    app, checker = (both, old_only) if rotated_first == "application" else (old_only, both)
    with serve(CheckHandler(resolver, app)) as running:
        client = HttpCheckClient(
            EndpointSettings.model_validate({"url": running.url, "secrets": checker})
        )
        try:
            answer = client.check(check_request("tx-rotating"))
        finally:
            client.close()
    assert (answer.outcome, resolver.asked) == ("commit", ["tx-rotating"])


def test_forged_request_is_401(server: RunningServer, resolver: Resolver) -> None:
    forger = Signer("whsec_" + base64.b64encode(b"f" * 32).decode())
    headers, body = build_request(forger, check_request())
    status, _, error = post(server.url, headers, body)
    assert status == 401
    assert json.loads(error)["error"] == "signature_invalid"
    assert resolver.asked == []


def test_replayed_request_is_401(server: RunningServer, resolver: Resolver) -> None:
    headers, body = build_request(Signer(SECRET), check_request())
    assert post(server.url, headers, body)[0] == 200
    status, answer_headers, error = post(server.url, headers, body)
    assert status == 401
    assert json.loads(error)["error"] == "replayed_message"
    assert HEADER_SIGNATURE not in answer_headers
    assert resolver.asked == ["tx-1"]


def test_malformed_request_is_400(server: RunningServer, resolver: Resolver) -> None:
    body = b'{"protocol": 1, "tx_id": "tx-1"}'
    headers = Signer(SECRET).sign("msg_bad", int(datetime.now(UTC).timestamp()), body)
    status, _, error = post(server.url, headers, body)
    assert status == 400
    assert "producer_group: Field required" in json.loads(error)["detail"]
    assert resolver.asked == []


def raw_exchange(
    server: RunningServer, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """One request with full control over framing (urllib always adds Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body or None)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def test_missing_content_length_is_411(server: RunningServer) -> None:
    status, headers, body = raw_exchange(server, "POST", "/outbox/check", {})
    assert status == 411
    assert json.loads(body)["error"] == "length_required"
    assert headers["connection"] == "close"


def test_chunked_body_is_411(server: RunningServer) -> None:
    chunked = {"transfer-encoding": "chunked"}
    status, _, _ = raw_exchange(server, "POST", "/outbox/check", chunked, b"2\r\n{}\r\n0\r\n\r\n")
    assert status == 411


def test_oversized_body_is_413(server: RunningServer, resolver: Resolver) -> None:
    body = b"x" * (MAX_BODY + 1)
    status, _, error = raw_exchange(
        server, "POST", "/outbox/check", {"content-length": str(len(body))}, body
    )
    assert status == 413
    assert json.loads(error)["detail"] == f"body exceeds {MAX_BODY} bytes"
    assert resolver.asked == []


def test_expect_continue_with_oversized_body_is_413_up_front(server: RunningServer) -> None:
    headers = {"content-length": str(MAX_BODY + 1), "expect": "100-continue"}
    status, _, _ = raw_exchange(server, "POST", "/outbox/check", headers)
    assert status == 413


def test_a_content_length_too_long_for_python_to_read_is_413(
    server: RunningServer, resolver: Resolver
) -> None:
    """int() refuses more than 4,300 digits: the request got no answer, and a traceback was
    logged as an unexpected error, for any client to repeat."""
    for headers in ({"content-length": "9" * 5000}, {"content-length": "1" + "0" * 5000}):
        status, _, error = raw_exchange(server, "POST", "/outbox/check", headers)
        assert status == 413
        assert json.loads(error)["error"] == "payload_too_large"
    headers, body = build_request(Signer(SECRET), check_request())
    headers["content-length"] = "0" * 5000 + str(len(body))  # leading zeros: its own length
    status, _, _ = raw_exchange(server, "POST", "/outbox/check", headers, body)
    assert status == 200
    assert len(resolver.asked) == 1


def _closed_while_sending(sock: socket.socket, pieces: Iterator[bytes], every_s: float) -> float:
    """Sends a piece every `every_s` until the server closes the connection; the seconds it
    took (inf: never, within the pieces)."""
    started = time.monotonic()
    for piece in pieces:
        try:
            sock.sendall(piece)
            ready, _, _ = select.select([sock], [], [], every_s)
            if ready and not sock.recv(65536):  # its end of input
                return time.monotonic() - started
        except OSError:  # a reset: a piece came after the server's last read, then its close
            return time.monotonic() - started
    return float("inf")


def test_headers_sent_a_line_at_a_time_are_given_up_after_the_timeout_in_all(
    resolver: Resolver,
) -> None:
    """The timeout counted per read: a client sending a header line just inside it held its
    thread for as long as it liked (found by a review; 64 such held every connection)."""
    with (
        serve(CheckHandler(resolver, [SECRET]), timeout_s=1.0) as running,
        socket.create_connection(("127.0.0.1", running.port), timeout=TIMEOUT_S) as sock,
    ):
        sock.sendall(b"POST /outbox/check HTTP/1.1\r\n")
        lines = (f"x-drip-{n}: y\r\n".encode() for n in range(40))
        took = _closed_while_sending(sock, lines, 0.4)  # each line inside the timeout
    assert took < 6.0, "the server went on reading headers trickling in for 16 s"
    assert resolver.asked == []


def test_input_after_a_refusal_is_drained_for_a_second_in_all(server: RunningServer) -> None:
    """After an error answered before the body is read (411 here), the server drains what the
    client sends for a moment, so that its close does not reset the answer away. The moment
    counted per read: a byte every 0.9 s held the thread for days (found by a review)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /outbox/check HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 411 ")
        started = time.monotonic()
        for _ in range(40):
            try:
                sock.sendall(b"x")  # each inside the 1 s a read waits
            except OSError:  # the server closed: its drain is over
                break
            time.sleep(0.4)  # the client's slowness, not a synchronisation
        took = time.monotonic() - started
    assert took < 6.0, "the server went on draining a byte every 0.4 s for 16 s"


def test_bad_content_length_is_400(server: RunningServer) -> None:
    status, _, _ = raw_exchange(server, "POST", "/outbox/check", {"content-length": "12x"})
    assert status == 400


def test_wrong_path_and_method(server: RunningServer) -> None:
    assert raw_exchange(server, "POST", "/elsewhere", {"content-length": "0"})[0] == 404
    status, headers, _ = raw_exchange(server, "GET", "/outbox/check", {})
    assert status == 405
    assert headers["allow"] == "POST"
    status, _, body = raw_exchange(server, "HEAD", "/outbox/check", {})
    assert (status, body) == (405, b"")


def test_keep_alive_connection_serves_several_checks(
    server: RunningServer, resolver: Resolver
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    try:
        for tx_id in ("tx-a", "tx-b"):
            headers, body = build_request(Signer(SECRET), check_request(tx_id))
            conn.request("POST", "/outbox/check?from=test", body=body, headers=headers)
            response = conn.getresponse()
            answer_body = response.read()
            assert response.status == 200
            got = verify_response(
                Verifier([SECRET]),
                headers[HEADER_ID],
                dict(response.getheaders()),
                answer_body,
                tx_id=tx_id,
            )
            assert got.tx_id == tx_id
    finally:
        conn.close()
    assert resolver.asked == ["tx-a", "tx-b"]


def test_close_is_idempotent_and_stops_serving(resolver: Resolver) -> None:
    running = serve(CheckHandler(resolver, [SECRET]), path="/check")
    assert running.url.endswith("/check")
    running.close()
    running.close()
    with pytest.raises(ConnectionRefusedError):
        raw_exchange(running, "GET", "/check", {})


def test_an_async_handler_given_to_serve_is_refused_by_name(resolver: Resolver) -> None:
    """It was served: every check got a dropped connection, from an AttributeError."""
    # an OutboxError as every error of the library: an InvalidConfigError
    with pytest.raises(InvalidConfigError, match="AsyncCheckHandler in an ASGI server"):
        serve(AsyncCheckHandler(resolver, [SECRET]))  # type: ignore[arg-type]


def test_content_length_given_twice_is_400_and_the_connection_closed(
    server: RunningServer, resolver: Resolver
) -> None:
    """The first one counted, and the rest of the body was read as a next request: a proxy
    counting the other one could be made to pass a request this server reads differently."""
    headers, body = build_request(Signer(SECRET), check_request())
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /outbox/check HTTP/1.1\r\nhost: x\r\n{head}content-length: {len(body)}\r\n"
            f"content-length: 5\r\n\r\n".encode()
            + body
        )
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert b"Content-Length is given twice" in answer
    assert resolver.asked == []


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_sent_a_byte_at_a_time_is_given_up_after_the_timeout_in_all(
    resolver: Resolver,
) -> None:
    """The timeout counted per read: a client sending a byte just inside it held its thread
    for as long as it liked."""
    headers, body = build_request(Signer(SECRET), check_request())
    with (
        serve(CheckHandler(resolver, [SECRET]), timeout_s=1.0) as running,
        socket.create_connection(("127.0.0.1", running.port), timeout=TIMEOUT_S) as sock,
    ):
        sock.sendall(raw_post(headers, body)[: -len(body)])  # the head alone
        started = time.monotonic()
        closed = False
        for byte in body[:40]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            ready, _, _ = select.select([sock], [], [], 0.4)  # each byte inside the timeout
            try:
                if ready and sock.recv(1) == b"":
                    closed = True
                    break
            except OSError:  # a reset: a byte came after the server's last read, then its close
                closed = True
                break
        elapsed = time.monotonic() - started
    assert closed, "the server went on reading a body trickling in for 16 s"
    assert elapsed < 6.0  # the 1 s timeout, on a loaded machine; the 16 s of before fail
    assert resolver.asked == []


def test_close_ends_a_kept_alive_connection_too(resolver: Resolver) -> None:
    """The server stopped accepting, but a kept-alive connection went on being served: the
    checker's next check reached a resolver whose application was shutting down."""
    running = serve(CheckHandler(resolver, [SECRET]))
    conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=TIMEOUT_S)
    try:
        headers, body = build_request(Signer(SECRET), check_request("tx-a"))
        conn.request("POST", "/outbox/check", body=body, headers=headers)
        assert conn.getresponse().read()
        running.close()
        headers, body = build_request(Signer(SECRET), check_request("tx-b"))
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            post_on(conn, headers, body)
    finally:
        conn.close()
    assert resolver.asked == ["tx-a"]


class HeldResolver:
    """Answers COMMIT once let go: a check being answered while the server closes."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def __call__(self, request: CheckRequest) -> TransactionStatus:
        self.entered.set()
        assert self.let_go.wait(TIMEOUT_S)
        return TransactionStatus.COMMIT


def _post_in_background(running: RunningServer) -> tuple[threading.Thread, list[int]]:
    statuses: list[int] = []
    headers, body = build_request(Signer(SECRET), check_request())
    poster = threading.Thread(target=lambda: statuses.append(post_raw(running, headers, body)))
    poster.start()
    return poster, statuses


def test_close_waits_for_the_check_being_answered() -> None:
    """close() returned with a check still in the resolver: an application closing its
    database pool next failed the check it was answering."""
    held = HeldResolver()
    running = serve(CheckHandler(held, [SECRET]))
    poster, statuses = _post_in_background(running)
    assert held.entered.wait(TIMEOUT_S)
    closer = threading.Thread(target=running.close)
    closer.start()
    try:
        closer.join(0.5)
        assert closer.is_alive(), "close() returned while a check was being answered"
        with pytest.raises(ConnectionRefusedError):  # new connections refused meanwhile
            socket.create_connection(("127.0.0.1", running.port), timeout=TIMEOUT_S)
    finally:
        held.let_go.set()
        closer.join(TIMEOUT_S)
        poster.join(TIMEOUT_S)
    assert not closer.is_alive()
    assert statuses == [200]


def test_close_gives_up_waiting_after_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    held = HeldResolver()
    running = serve(CheckHandler(held, [SECRET]))
    poster, statuses = _post_in_background(running)
    try:
        assert held.entered.wait(TIMEOUT_S)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="outbox.checkback._server"):
            running.close(timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < TIMEOUT_S
        assert "closed with 1 connection(s) still being answered after 0.3s" in caplog.text
    finally:
        held.let_go.set()
        poster.join(TIMEOUT_S)
    assert statuses == [200]  # its answer still went out


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), None, True, "30"])
def test_serve_refuses_a_timeout_that_is_not_a_number_of_seconds(timeout_s: Any) -> None:
    with pytest.raises(InvalidConfigError, match=r"timeout_s must be a finite number of seconds"):
        serve(CheckHandler(Resolver(), [SECRET]), timeout_s=timeout_s)


def test_close_refuses_a_negative_timeout() -> None:
    running = serve(CheckHandler(Resolver(), [SECRET]))
    try:
        with pytest.raises(InvalidConfigError, match=r"timeout_s .* 0 or more; got -1"):
            running.close(timeout_s=-1)
    finally:
        running.close()


def test_connections_past_the_cap_are_closed_at_once(resolver: Resolver) -> None:
    with serve(CheckHandler(resolver, [SECRET]), max_connections=1) as running:
        idle = socket.create_connection(("127.0.0.1", running.port), timeout=TIMEOUT_S)
        try:
            wait_until(lambda: open_connections(running) == 1)
            headers, body = build_request(Signer(SECRET), check_request())
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                post_raw(running, headers, body)
        finally:
            idle.close()
        wait_until(lambda: open_connections(running) == 0)
        assert post_raw(running, headers, body) == 200  # a place again
    assert resolver.asked == ["tx-1"]


makes_room = pytest.mark.skipif(
    not hasattr(select, "poll"), reason="without poll(), no idle connection makes room"
)


@makes_room
def test_a_connection_kept_alive_idle_makes_room_for_a_new_one(resolver: Resolver) -> None:
    """At the cap, a checker's kept-alive connections, idle between checks, refused every new
    connection (another checker's, or its own after a restart) until they timed out."""
    with serve(CheckHandler(resolver, [SECRET]), max_connections=1) as running:
        kept = http.client.HTTPConnection("127.0.0.1", running.port, timeout=TIMEOUT_S)
        try:
            headers, body = build_request(Signer(SECRET), check_request("tx-a"))
            assert post_on(kept, headers, body) == 200
            wait_until(lambda: len(running._httpd._waiting) == 1)  # back waiting: idle
            headers, body = build_request(Signer(SECRET), check_request("tx-b"))
            assert post_raw(running, headers, body) == 200  # served, not refused
            headers, body = build_request(Signer(SECRET), check_request("tx-c"))
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                post_on(kept, headers, body)  # the idle one made room
        finally:
            kept.close()
    assert resolver.asked == ["tx-a", "tx-b"]


@makes_room
def test_a_checker_whose_idle_connection_made_room_checks_again_on_a_new_one(
    resolver: Resolver,
) -> None:
    with serve(CheckHandler(resolver, [SECRET]), max_connections=1) as running:
        client = HttpCheckClient(
            EndpointSettings.model_validate({"url": running.url, "secrets": [SECRET]})
        )
        try:
            assert client.check(check_request("tx-a")).outcome == "commit"
            wait_until(lambda: len(running._httpd._waiting) == 1)
            headers, body = build_request(Signer(SECRET), check_request("tx-b"))
            assert post_raw(running, headers, body) == 200  # takes the checker's place
            wait_until(lambda: open_connections(running) == 0)  # that one's client closed it
            assert client.check(check_request("tx-c")).outcome == "commit"  # retried anew
        finally:
            client.close()
    assert resolver.asked == ["tx-a", "tx-b", "tx-c"]


def test_a_connection_being_answered_does_not_make_room(resolver: Resolver) -> None:
    """Only a connection waiting between requests is closed for room: one whose request is
    being answered (here: a body still coming) keeps its place, and the new one is refused."""
    with serve(CheckHandler(resolver, [SECRET]), max_connections=1) as running:
        kept = socket.create_connection(("127.0.0.1", running.port), timeout=TIMEOUT_S)
        try:
            headers, body = build_request(Signer(SECRET), check_request("tx-a"))
            kept.sendall(raw_post(headers, body))
            assert answer_status(kept) == 200
            wait_until(lambda: len(running._httpd._waiting) == 1)
            headers, body = build_request(Signer(SECRET), check_request("tx-b"))
            kept.sendall(raw_post(headers, body)[:-1])  # all but the body's last byte
            wait_until(lambda: not running._httpd._waiting)  # its request is being read
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                post_raw(running, headers, body)
            kept.sendall(raw_post(headers, body)[-1:])
            assert answer_status(kept) == 200
        finally:
            kept.close()
    assert resolver.asked == ["tx-a", "tx-b"]


class NotRead(socket.socket):
    """A handler's socket that the server's accept thread must not read: with the socket's
    timeout, even a MSG_DONTWAIT read waited, under the server's lock, for input its handler
    thread had taken first."""

    reading = False

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        assert self.reading, "the server read a handler's socket to make room"
        return super().recv(*args, **kwargs)


@makes_room
@pytest.mark.parametrize("high_fd", [False, True], ids=["fd", "fd-past-1024"])
def test_room_is_made_only_by_a_connection_with_no_request_arriving(
    resolver: Resolver, high_fd: bool
) -> None:
    """Each case on a connected pair of sockets standing for a kept-alive connection; past
    descriptor 1024, select() refused it, and no room was ever made."""
    if high_fd:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard <= 1100:
            pytest.skip(f"the descriptor limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    with serve(CheckHandler(resolver, [SECRET]), max_connections=1) as running:
        server = running._httpd

        def make_room_with(client_does: Callable[[socket.socket], None]) -> tuple[bool, bytes]:
            """(counted still, what the server's side reads after)"""
            pair, theirs = socket.socketpair()
            fd = pair.detach()
            if high_fd:  # the lowest free descriptor past 1024, then the first one closed
                fd, low = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1025), fd
                os.close(low)
                assert fd > 1024
            ours = NotRead(fileno=fd)
            with ours, theirs:
                ours.settimeout(2)  # as a handler's socket
                client_does(theirs)
                with server._open_lock:
                    server._open.add(ours)
                    server._waiting[ours] = None
                    server._make_room()
                    counted = ours in server._open
                    server._open.discard(ours)
                    server._waiting.pop(ours, None)
                ours.reading = True
                return counted, ours.recv(16)

        # idle: closed to make room, its reader sees the end of input
        assert make_room_with(lambda client: None) == (False, b"")
        # a request arriving: kept, its input intact
        assert make_room_with(lambda client: client.sendall(b"POST /")) == (True, b"POST /")
        # closed by its client: no longer counted
        assert make_room_with(lambda client: client.shutdown(socket.SHUT_WR)) == (False, b"")


def answer_status(sock: socket.socket) -> int:
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def raw_post(headers: dict[str, str], body: bytes) -> bytes:
    lines = [
        "POST /outbox/check HTTP/1.1",
        "Host: 127.0.0.1",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def open_connections(running: RunningServer) -> int:
    return len(running._httpd._open)


def wait_until(condition: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def post_raw(running: RunningServer, headers: dict[str, str], body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=TIMEOUT_S)
    try:
        return post_on(conn, headers, body)
    finally:
        conn.close()


def post_on(conn: http.client.HTTPConnection, headers: dict[str, str], body: bytes) -> int:
    conn.request("POST", "/outbox/check", body=body, headers=headers)
    response = conn.getresponse()
    response.read()
    return response.status


def test_ipv6_loopback(resolver: Resolver) -> None:
    try:
        running = serve(CheckHandler(resolver, [SECRET]), host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with running:
        assert running.url == f"http://[::1]:{running.port}/outbox/check"
        headers, body = build_request(Signer(SECRET), check_request())
        assert post(running.url, headers, body)[0] == 200
