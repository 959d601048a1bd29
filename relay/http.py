"""The sidecar's probes and metrics: /healthz (alive), /readyz (can work), /metrics (Prometheus)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar, cast

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from outbox._watchdog import Watch, Watchdog

logger = logging.getLogger(__name__)

# One thread per connection: without bounds a client that connected and sent nothing held a
# thread for ever, and enough of them (anything on the pod's network) grew the sidecar to its
# memory limit. A request's line and headers must come within HEAD_DEADLINE_S in all (a probe
# sends them at once), and at MAX_CONNECTIONS the one waiting longest for its request is cut.
HEAD_DEADLINE_S = 10.0
MAX_CONNECTIONS = 32
IDLE_AFTER_S = 0.5  # a connection waiting this long for its request may be cut to make room
_head_watchdog = Watchdog("probes-watchdog")
# /readyz answers within READY_WITHIN_S, under the chart's readiness probe timeout (5 s): a part
# that has not answered by then is reported not ready, and said late. A part's own checks (the
# database, the broker) get CHECK_WITHIN_S, so that the one not reachable is named first.
READY_WITHIN_S = 4.0
CHECK_WITHIN_S = 3.0

Alive = Callable[[], bool]
Ready = Callable[[], dict[str, Any]]
T = TypeVar("T")


class InFlight:
    """Checks still running, by name. A probe that finds its check still running from an earlier
    probe waits for that one (within its own deadline) instead of starting another: a check stuck
    past its probe's deadline (a connect to a host that does not answer, a JVM that stalls) holds
    one thread however often it is probed, not one more per probe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Future[Any]] = {}

    def start(self, name: str, check: Callable[[], T]) -> Future[T]:
        with self._lock:
            running = self._running.get(name)
            if running is not None and not running.done():
                return running
            future: Future[T] = Future()
            self._running[name] = future
        threading.Thread(
            target=_settle, args=(future, check), name=f"probe-{name}", daemon=True
        ).start()
        return future


def _settle(future: Future[T], check: Callable[[], T]) -> None:
    try:
        future.set_result(check())
    except BaseException as exc:  # raised in the thread that waits for it
        future.set_exception(exc)


def gather(
    checks: Mapping[str, Callable[[], T]],
    within_s: float | None = None,
    late: Callable[[str], T] | None = None,
    in_flight: InFlight | None = None,
) -> dict[str, T]:
    """Each check on a thread of its own, all waited for: in an outage each may wait a connect
    timeout or two, and one after another /readyz took 20-30 s to answer, well past a kubelet's
    probe timeout. A check's exception is raised once all have ended. Daemon threads: a check
    stuck past the process's end does not hold it up.
    With `within_s`, a check not ended by then is given `late(name)` (without `late`,
    TimeoutError), and an exception of one that ended is raised then: a probe must answer
    before its client gives up, and the database's own waits (a connect timeout, 10 s by
    default) ran past the kubelet's timeout, which then said only that the probe timed out,
    not what was not reachable. `in_flight`: the caller's checks still running, shared with
    its earlier calls (see InFlight)."""
    if len(checks) <= 1 and within_s is None:
        return {name: check() for name, check in checks.items()}
    running = in_flight or InFlight()
    futures = {name: running.start(name, check) for name, check in checks.items()}
    wait(futures.values(), timeout=within_s)
    ended = {name for name, future in futures.items() if future.done()}
    for name in checks:  # in the checks' order, whichever failed first
        failure = futures[name].exception() if name in ended else None
        if failure is not None:
            raise failure
    if len(ended) < len(checks):
        if late is None:
            unended = ", ".join(sorted(set(checks) - ended))
            raise TimeoutError(f"not ended within {within_s:g} s: {unended}")
        return {name: futures[name].result() if name in ended else late(name) for name in checks}
    return {name: futures[name].result() for name in checks}


class ProbeServerUnavailable(OSError):
    """The probes' address cannot be listened on."""


class ProbeServer:
    """`registry`: what /metrics serves. `settings`: the names of the port's and the host's
    settings, as the error for an address that cannot be listened on says them."""

    def __init__(
        self,
        host: str,
        port: int,
        alive: dict[str, Alive],
        ready: dict[str, Ready],
        *,
        registry: CollectorRegistry = REGISTRY,
        settings: tuple[str, str] = ("http.port", "http.host"),
        head_deadline_s: float = HEAD_DEADLINE_S,
        max_connections: int = MAX_CONNECTIONS,
        ready_within_s: float = READY_WITHIN_S,
    ):
        self.alive = alive
        self.ready = ready
        probes = self

        in_flight = InFlight()

        def _late(name: str) -> dict[str, Any]:
            return {"ready": False, "late": f"no answer within {ready_within_s:g} s"}

        class Handler(BaseHTTPRequestHandler):
            timeout = head_deadline_s  # each read and write; the watch bounds the head in all
            _watch: Watch | None = None

            def setup(self) -> None:
                self._watch = _head_watchdog.arm(self.request, time.monotonic() + head_deadline_s)
                super().setup()

            def parse_request(self) -> bool:
                parsed = super().parse_request()
                if not self._head_read():
                    self.close_connection = True  # too slow: cut off, not answered
                    return False
                return parsed

            def finish(self) -> None:
                self._head_read()  # a request line never completed, say
                super().finish()

            def _head_read(self) -> bool:
                """Within the deadline (else the socket was shut down): no longer cut to make
                room either."""
                watch, self._watch = self._watch, None
                if watch is None:
                    return True
                kept = cast(_LoggingHTTPServer, self.server).head_read(self.request)
                fired = _head_watchdog.disarm(watch)
                # cut to make room: its end of input ended the headers, and answered, it went
                # uncounted (a /readyz holding a thread for seconds, per new connection)
                return kept and not fired

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    status = {name: check() for name, check in probes.alive.items()}
                    self._send(200 if all(status.values()) else 503, status)
                elif path == "/readyz":
                    report = gather(probes.ready, ready_within_s, _late, in_flight)
                    ok = all(r.get("ready", False) for r in report.values())
                    self._send(200 if ok else 503, report)
                elif path == "/metrics":
                    self._send_raw(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                else:
                    self._send(404, {"error": "not found"})

            def do_HEAD(self) -> None:  # a load balancer's check: GET's status, no body
                self.head_only = True
                self.do_GET()

            def _send(self, code: int, body: dict[str, Any]) -> None:
                self._send_raw(code, "application/json", json.dumps(body, default=str).encode())

            def _send_raw(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not getattr(self, "head_only", False):
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("probe %s", format % args)

        try:
            self._server = _server_for(host)((host, port), Handler)
        except OSError as exc:  # a port taken, an address not of this host: say which setting
            port_setting, host_setting = settings
            raise ProbeServerUnavailable(
                f"{port_setting} {port} on {host_setting} {host!r} cannot be listened on: "
                f"{exc.strerror}"
            ) from None
        self._server.daemon_threads = True
        self._server.max_connections = max_connections
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="probes", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        logger.info("probes and metrics on port %s", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _LoggingHTTPServer(ThreadingHTTPServer):
    max_connections = MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        # connections whose request line and headers are still to come, by when each came,
        # the oldest first
        self._awaiting_head: dict[socket.socket, float] = {}
        self._last_refusal_logged = -math.inf
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._open) >= self.max_connections and self._awaiting_head:
                # A probe sends its request at once: the one waiting longest is idle, unless
                # it came just now (a kubelet's, its thread not yet reading). Shut down, its
                # thread reads the end of its input and ends.
                oldest, came = next(iter(self._awaiting_head.items()))
                if now - came >= IDLE_AFTER_S:
                    self._forget(oldest)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
            refused = len(self._open) >= self.max_connections  # all of them busy
            if not refused:
                self._open.add(request)
                self._awaiting_head[request] = now
        if refused:
            self._log_refusal(client_address)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def head_read(self, request: socket.socket) -> bool:
        """Its request line and headers are read: False if it was cut to make room."""
        with self._lock:
            self._awaiting_head.pop(request, None)
            return request in self._open

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._forget(request)
        super().shutdown_request(request)

    def _forget(self, request: socket.socket) -> None:
        self._open.discard(request)
        self._awaiting_head.pop(request, None)

    def _log_refusal(self, client_address: Any) -> None:
        now = time.monotonic()
        if now - self._last_refusal_logged >= 60:  # a flood of them: one line a minute
            self._last_refusal_logged = now
            logger.warning(
                "probe connection from %s refused: all %d connections are being answered or "
                "have just come",
                client_address,
                self.max_connections,
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver printed a raw traceback to stderr, past the sidecar's JSON logs: for
        any probe whose client gave up first (a kubelet past its probe timeout), too."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):  # gone, or too slow to read
            logger.debug("probe client %s went away: %s", client_address, exc)
            return
        logger.error("probe request from %s failed", client_address, exc_info=True)


def _server_for(host: str) -> type[_LoggingHTTPServer]:
    """ThreadingHTTPServer listens on IPv4 only: an IPv6 host ("::" in an IPv6-only cluster)
    failed to start, and the kubelet's probes could not reach "0.0.0.0" there."""
    if ":" not in host:
        return _LoggingHTTPServer

    class ThreadingHTTPServerV6(_LoggingHTTPServer):
        address_family = socket.AF_INET6

    return ThreadingHTTPServerV6
