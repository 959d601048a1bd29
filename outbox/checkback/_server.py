"""A small real HTTP endpoint for the check handler, on the standard library alone.

For applications without a web framework, for the sample producer, and for the checker's tests.
Applications that already run an ASGI server should mount ``asgi_app`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, cast

from outbox._errors import InvalidConfigError
from outbox._watchdog import Watch, Watchdog

try:  # POSIX: how much input waits on a connection, without reading it
    import fcntl
    import termios
except ImportError:  # elsewhere no idle connection is closed to make room
    fcntl = termios = None  # type: ignore[assignment]

from ._handler import CheckHandler, HandlerResult, error_result, too_large_result
from ._protocol import length_over

logger = logging.getLogger(__name__)

_LINGER_S = 1.0
_LINGER_BYTES = 256 * 1024
_READ_CHUNK = 65536
DEFAULT_MAX_CONNECTIONS = 64  # a checker keeps one per worker thread; a few checkers at once
# A request's line and headers within the timeout in all: the socket's bounds each read, and a
# client sending a header byte at a time just inside it held its thread for as long as it liked.
_head_watchdog = Watchdog("outbox-checkback-watchdog")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive
    request_queue_size = 128  # several checkers open connections at once
    max_connections = DEFAULT_MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], handler_class: type[BaseHTTPRequestHandler]):
        self.closing = False
        self._open: set[socket.socket] = set()
        # kept alive after an answer, waiting for the next request: the longest waiting first
        self._waiting: dict[socket.socket, None] = {}
        self._open_lock = threading.Lock()
        self._all_closed = threading.Condition(self._open_lock)
        super().__init__(address, handler_class)

    def process_request(self, request: Any, client_address: Any) -> None:
        # One thread per connection: without a cap, idle or slow connections took threads and
        # memory without end. Over it, a connection kept alive waiting for its next request
        # makes room (as a busy web server does; a client retries a request on a reused
        # connection closed under it); with none, the new one is closed at once.
        with self._open_lock:
            if not self.closing and len(self._open) >= self.max_connections:
                self._make_room()
            refused = self.closing or len(self._open) >= self.max_connections
            if not refused:
                self._open.add(request)
        if refused:
            logger.warning(
                "check server: connection from %s refused: %d open, at most %d",
                client_address,
                len(self._open),
                self.max_connections,
            )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def _make_room(self) -> None:
        """Close the longest-waiting kept-alive connection with no request arriving on it.
        Called holding _open_lock."""
        for conn in list(self._waiting):
            del self._waiting[conn]
            input_ = _pending_input(conn)
            if input_ is None:
                continue  # a request is arriving: not idle
            self._open.discard(conn)
            if input_ == "closed":
                # by its client: its thread is ending. (A client that sent a request, then
                # closed its side, is not answered if its thread read the request just before:
                # checkers do not half-close.)
                return
            with contextlib.suppress(OSError):  # reset meanwhile: its thread ends all the same
                conn.shutdown(socket.SHUT_RD)  # its thread reads the end of input and ends
            logger.info(
                "check server: at %d connections, closed one kept alive idle to make room",
                self.max_connections,
            )
            return

    def waits(self, conn: socket.socket) -> None:
        """A kept-alive connection waits for its next request: it may make room."""
        with self._open_lock:
            if conn in self._open:
                self._waiting[conn] = None

    def request_came(self, conn: socket.socket) -> bool:
        """A kept-alive connection's next request came: False if it made room meanwhile (its
        thread may have read the request before the end of input: it must not answer)."""
        with self._open_lock:
            self._waiting.pop(conn, None)
            return conn in self._open

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
            self._waiting.pop(request, None)
            if not self._open:
                self._all_closed.notify_all()
        super().shutdown_request(request)

    def wait_closed(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every open connection to close: how many are left."""
        with self._all_closed:
            self._all_closed.wait_for(lambda: not self._open, timeout_s)
            return len(self._open)

    def stop_reading(self) -> None:
        """Serve no further request on the open connections: a kept-alive one waiting for its
        next request sees the end of its input; one being answered finishes its answer."""
        with self._open_lock:
            self.closing = True
            open_now = list(self._open)
        for conn in open_now:
            with contextlib.suppress(OSError):  # closed meanwhile
                conn.shutdown(socket.SHUT_RD)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints to stderr; a library logs instead. A client that went away is
        # its own business (a checker's watchdog ends a request that outlives its timeout).
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            logger.debug("check server: connection from %s ended", client_address, exc_info=True)
            return
        logger.exception("check server: unexpected error serving %s", client_address)


def _pending_input(conn: socket.socket) -> Literal["nothing", "closed"] | None:
    """What waits to be read on an idle connection: "nothing", "closed" (its client closed it),
    or None (a request, or not known). Never blocks: never reads (a socket's timeout made even a
    MSG_DONTWAIT read wait, under the server's lock, when its thread took the input first)."""
    if fcntl is None or not hasattr(select, "poll"):
        return None
    poller = select.poll()  # not select(): descriptors past 1024
    poller.register(conn, select.POLLIN | getattr(select, "POLLRDHUP", 0))
    events = poller.poll(0)
    if not events:
        return "nothing"
    try:
        count = struct.unpack("i", fcntl.ioctl(conn, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return None
    return "closed" if count == 0 else None


class _Server6(_Server):
    address_family = socket.AF_INET6


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for checkers that reuse connections
    # Headers and body go out in two writes: without this, Nagle holds the body back ~40 ms.
    disable_nagle_algorithm = True
    server_version = "outbox-checkback"
    check_handler: CheckHandler
    check_path: str
    check_timeout_s: float
    _answered = False  # a request of this connection was handled: it is kept alive
    _head_watch: Watch | None = None  # the deadline of the request line and headers

    def do_POST(self) -> None:
        if self._closing():
            return
        if self._route() != self.check_path:
            self._reply(error_result(404, "not_found", f"the check endpoint is {self.check_path}"))
            return
        length = self._content_length()
        if isinstance(length, HandlerResult):
            self._reply(length)
            return
        body = self._read_body(length)
        if body is None:  # timed out, reset or cut short: nobody to answer
            self.close_connection = True
            return
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), value)  # first occurrence wins, as headers.get does
        self._reply(self.check_handler.handle(headers, body), body_read=True)

    def _not_allowed(self) -> None:
        if self._closing():
            return
        if self._route() != self.check_path:
            self._reply(error_result(404, "not_found", f"the check endpoint is {self.check_path}"))
            return
        self._reply(
            error_result(
                405, "method_not_allowed", "the check endpoint takes POST", {"allow": "POST"}
            )
        )

    do_GET = do_HEAD = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _not_allowed

    def handle_expect_100(self) -> bool:
        # Refuse an oversized body before the client sends it.
        length = self._content_length()
        if isinstance(length, HandlerResult) and length.status_code == 413:
            self._reply(length)
            return False
        return super().handle_expect_100()

    def handle_one_request(self) -> None:
        # Between two requests of a kept-alive connection its thread only waits: it may be
        # closed to make room for a new connection. A new connection is not (its first request
        # may be on its way).
        if self._answered:
            self._server.waits(self.connection)
        self._head_watch = _head_watchdog.arm(
            self.connection, time.monotonic() + self.check_timeout_s
        )
        try:
            super().handle_one_request()
        finally:
            self._head_read()  # a request line never completed, say
        self._answered = True

    def _head_read(self) -> bool:
        """The request's line and headers are read: True if within the timeout (else the
        socket is shut down, and the request is not answered)."""
        watch, self._head_watch = self._head_watch, None
        return watch is None or not _head_watchdog.disarm(watch)

    def parse_request(self) -> bool:
        if self._answered and not self._server.request_came(self.connection):
            self.close_connection = True  # closed unanswered: the client retries elsewhere
            return False
        parsed = super().parse_request()
        if not self._head_read():
            self.close_connection = True  # too slow: cut off
            return False
        return parsed

    @property
    def _server(self) -> _Server:
        return cast(_Server, self.server)

    def _closing(self) -> bool:
        """A request read once the server began closing is not answered (the input already
        queued is read past the shutdown of the connection's reading side)."""
        closing: bool = getattr(self.server, "closing", False)
        if closing:
            self.close_connection = True
        return closing

    def _read_body(self, length: int) -> bytes | None:
        """``length`` bytes, within ``timeout`` in all: a socket timeout alone is per read, and
        a client sending a byte at a time just inside it held its thread for ever."""
        deadline = time.monotonic() + self.check_timeout_s
        chunks: list[bytes] = []
        left = length
        try:
            while left > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(left, _READ_CHUNK))
                if not chunk:
                    return None
                chunks.append(chunk)
                left -= len(chunk)
        except OSError:
            return None
        finally:
            self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def _route(self) -> str:
        return self.path.partition("?")[0]

    def _content_length(self) -> int | HandlerResult:
        if "transfer-encoding" in self.headers:
            return error_result(411, "length_required", "send Content-Length, not chunked")
        given = self.headers.get_all("content-length") or []
        if not given:
            return error_result(411, "length_required", "Content-Length header is required")
        if len({value.strip() for value in given}) > 1:
            # Which one counts is what a proxy and this server could disagree on (RFC 9112 6.3)
            return error_result(400, "malformed_request", "Content-Length is given twice")
        raw = given[0].strip()
        if not (raw.isascii() and raw.isdigit()):
            return error_result(400, "malformed_request", "Content-Length is not a number")
        if length_over(raw, self.check_handler.max_body_bytes):
            return too_large_result(self.check_handler.max_body_bytes)
        return int(raw.lstrip("0") or "0")

    def _reply(self, result: HandlerResult, *, body_read: bool = False) -> None:
        # An unread body would be taken for the next request on this connection: close it.
        if not body_read:
            self.close_connection = True
        self.send_response(result.status_code)
        for name, value in result.headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(result.body)))
        if self.close_connection:
            self.send_header("connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(result.body)
        if not body_read:
            self._discard_unread_input()

    def _discard_unread_input(self) -> None:
        # Closing a socket with unread input makes the kernel send RST, which can destroy our
        # answer before the client reads it. Signal the end of the answer, then read and drop a
        # bounded amount of input, briefly (in all: a byte a second held the thread for days),
        # until the client closes.
        deadline = time.monotonic() + _LINGER_S
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            left = _LINGER_BYTES
            while left > 0 and (remaining := deadline - time.monotonic()) > 0:
                self.connection.settimeout(remaining)
                if not (chunk := self.rfile.read1(min(left, 65536))):
                    break
                left -= len(chunk)
        except OSError:
            pass  # timeout or reset: the client is gone or slow; we tried

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("check server: %s %s", self.address_string(), format % args)


class RunningServer:
    """A server answering on a background thread. ``close()`` is idempotent; also a context
    manager."""

    def __init__(self, httpd: _Server, path: str, timeout_s: float) -> None:
        self._httpd = httpd
        self._timeout_s = timeout_s
        self._closed = False
        self._lock = threading.Lock()
        address = httpd.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{netloc}:{self.port}{path}"
        self._thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"outbox-checkback:{self.port}",
            daemon=True,
        )
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Take no further connection or request, and wait up to ``timeout_s`` (by default the
        server's timeout) for the checks being answered: an application that closes its
        database once this returns must not fail them. A check still being answered then is
        logged, and its answer may still go out."""
        wait_s = self._timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s, 0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.stop_reading()  # else a kept-alive connection went on being served
        self._httpd.server_close()
        self._thread.join(timeout=5)
        if left := self._httpd.wait_closed(wait_s):
            logger.warning(
                "check server: closed with %d connection(s) still being answered after %gs",
                left,
                wait_s,
            )

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def serve(
    handler: CheckHandler,
    host: str = "127.0.0.1",
    port: int = 0,
    path: str = "/outbox/check",
    *,
    timeout_s: float = 30.0,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> RunningServer:
    """Serve ``handler`` on ``http://host:port/path`` (port 0: any free port, see ``.port``).

    ``timeout_s`` bounds each socket read and write, and in all the reading of a request's line
    and headers, and of its body, so a slow or silent client holds a thread no longer than that.
    At most ``max_connections`` are open at once (a thread each): past that, a connection kept
    alive idle between requests is closed to make room, and with none idle the new one is
    closed at once; so as many clients that connect and send nothing hold them all for up to
    ``timeout_s`` at a time. Put a proxy with TLS in front (ingress, mesh) when the endpoint is
    reachable beyond the checkers.
    """
    if not isinstance(handler, CheckHandler):
        raise InvalidConfigError(
            f"serve() takes a CheckHandler, not {type(handler).__name__}: mount an "
            "AsyncCheckHandler in an ASGI server with asgi_app()"
        )
    _seconds("timeout_s", timeout_s, None)
    if max_connections < 1:
        raise InvalidConfigError(f"max_connections must be 1 or more, got {max_connections!r}")
    handler_class = type(
        "CheckRequestHandler",
        (_RequestHandler,),
        {
            "check_handler": handler,
            "check_path": path,
            "timeout": timeout_s,
            "check_timeout_s": timeout_s,
        },
    )
    server_class = type(
        "CheckServer",
        (_Server6 if ":" in host else _Server,),
        {"max_connections": max_connections},
    )
    return RunningServer(server_class((host, port), handler_class), path, timeout_s)


def _seconds(name: str, value: float, least: float | None) -> float:
    """``value`` as seconds, finite and at least ``least`` (None: above 0). A socket timeout of
    0 or None made every read fail or never time out."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        not number
        or not math.isfinite(value)
        or not (value > 0 if least is None else value >= least)
    ):
        bound = "above 0" if least is None else f"{least:g} or more"
        raise InvalidConfigError(
            f"{name} must be a finite number of seconds, {bound}; got {value!r}"
        )
    return float(value)
