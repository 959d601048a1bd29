"""A small real HTTP endpoint for the check handler, on the standard library alone.

For applications without a web framework, for the sample producer, and for the checker's tests.
Applications that already run an ASGI server should mount ``asgi_app`` instead.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from ._handler import CheckHandler, HandlerResult, error_result, too_large_result

logger = logging.getLogger(__name__)

_LINGER_S = 1.0
_LINGER_BYTES = 256 * 1024


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive
    request_queue_size = 128  # several checkers open connections at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints to stderr; a library logs instead.
        logger.exception("check server: unexpected error serving %s", client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for checkers that reuse connections
    # Headers and body go out in two writes: without this, Nagle holds the body back ~40 ms.
    disable_nagle_algorithm = True
    server_version = "outbox-checkback"
    check_handler: CheckHandler
    check_path: str

    def do_POST(self) -> None:
        if self._route() != self.check_path:
            self._reply(error_result(404, "not_found", f"the check endpoint is {self.check_path}"))
            return
        length = self._content_length()
        if isinstance(length, HandlerResult):
            self._reply(length)
            return
        try:
            body = self.rfile.read(length)
        except OSError:  # timeout or reset: nobody to answer
            self.close_connection = True
            return
        if len(body) < length:
            self.close_connection = True
            return
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), value)  # first occurrence wins, as headers.get does
        self._reply(self.check_handler.handle(headers, body), body_read=True)

    def _not_allowed(self) -> None:
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

    def _route(self) -> str:
        return self.path.partition("?")[0]

    def _content_length(self) -> int | HandlerResult:
        if "transfer-encoding" in self.headers:
            return error_result(411, "length_required", "send Content-Length, not chunked")
        raw = self.headers.get("content-length")
        if raw is None:
            return error_result(411, "length_required", "Content-Length header is required")
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()):
            return error_result(400, "malformed_request", "Content-Length is not a number")
        if int(raw) > self.check_handler.max_body_bytes:
            return too_large_result(self.check_handler.max_body_bytes)
        return int(raw)

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
        # bounded amount of input, briefly, until the client closes.
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            left = _LINGER_BYTES
            while left > 0 and (chunk := self.rfile.read1(min(left, 65536))):
                left -= len(chunk)
        except OSError:
            pass  # timeout or reset: the client is gone or slow; we tried

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("check server: %s %s", self.address_string(), format % args)


class RunningServer:
    """A server answering on a background thread. ``close()`` is idempotent; also a context
    manager."""

    def __init__(self, httpd: _Server, path: str) -> None:
        self._httpd = httpd
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

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

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
) -> RunningServer:
    """Serve ``handler`` on ``http://host:port/path`` (port 0: any free port, see ``.port``).

    ``timeout_s`` bounds each socket read and write, so a slow or silent client only holds its
    own thread, and only that long. Put TLS in front (ingress, mesh) when the checker is remote.
    """
    handler_class = type(
        "CheckRequestHandler",
        (_RequestHandler,),
        {"check_handler": handler, "check_path": path, "timeout": timeout_s},
    )
    server_class = _Server6 if ":" in host else _Server
    return RunningServer(server_class((host, port), handler_class), path)
