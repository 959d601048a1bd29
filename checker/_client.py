"""The HTTP side of a check: one signed POST to a producer group's endpoint, one verified answer.

Standard library only (``http.client``), which also means: no proxy from the environment, and no
redirect is ever followed (a 3xx is a failed check). Limits, all explicit:

- connect timeout (name lookup and TCP, every address tried included; each read of the TLS
  handshake) and a total timeout for the whole exchange, enforced by a watchdog that shuts the
  socket down at the deadline, so a server dripping bytes cannot hold a worker longer than the
  total;
- TLS verified (``ssl.create_default_context()``, or the endpoint's ``ca_file``);
- answers longer than ``max_response_bytes`` are refused without being read further;
- every answer is authenticated with ``outbox.checkback.verify_response``: signature, timestamp,
  replay, request id and tx id must all match, else the check has no answer.

Connections are kept alive per worker thread; a kept-alive connection the server has closed in
the meantime is retried once on a fresh connection, with a freshly signed request.
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol

from checker.config import EndpointSettings
from outbox._watchdog import Watchdog
from outbox.checkback import (
    HEADER_ID,
    AuthenticationFailed,
    CheckRequest,
    InMemoryReplayCache,
    MalformedResponse,
    ResponseMismatch,
    Signer,
    TransactionStatus,
    Verifier,
    build_request,
    verify_response,
)
from outbox.checkback._protocol import length_over

logger = logging.getLogger(__name__)

_USER_AGENT = "outbox-checker/1"
_REPLAY_CACHE_ENTRIES = 4096
_ERROR_SAID_CHARS = 200


class Outcome(enum.StrEnum):
    """What one check came to. The first three are answers; the rest say why there was none."""

    COMMIT = "commit"
    ROLLBACK = "rollback"
    UNKNOWN = "unknown"
    # sent, but no usable answer
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    TRANSPORT_ERROR = "transport_error"
    HTTP_ERROR = "http_error"
    REDIRECT = "redirect"
    TOO_LARGE = "too_large"
    BAD_SIGNATURE = "bad_signature"
    BAD_RESPONSE = "bad_response"
    MISMATCH = "mismatch"
    INTERNAL_ERROR = "internal_error"
    # never sent: the check is given back uncounted
    CIRCUIT_OPEN = "circuit_open"
    DEFERRED = "deferred"

    @property
    def decided(self) -> bool:
        return self in (Outcome.COMMIT, Outcome.ROLLBACK)

    @property
    def sent(self) -> bool:
        return self not in (Outcome.CIRCUIT_OPEN, Outcome.DEFERRED)

    @property
    def answered(self) -> bool:
        """A valid signed answer: the endpoint is healthy, whatever it said."""
        return self in (Outcome.COMMIT, Outcome.ROLLBACK, Outcome.UNKNOWN)


_FROM_STATUS = {
    TransactionStatus.COMMIT: Outcome.COMMIT,
    TransactionStatus.ROLLBACK: Outcome.ROLLBACK,
    TransactionStatus.UNKNOWN: Outcome.UNKNOWN,
}


@dataclass(frozen=True, slots=True)
class CheckAnswer:
    outcome: Outcome
    detail: str = ""
    #: Seconds until the HTTP answer was read; None when there was no HTTP answer.
    latency_s: float | None = None


class CheckClient(Protocol):
    """Asks one endpoint about one transaction. Called from several worker threads at once."""

    def check(self, request: CheckRequest) -> CheckAnswer: ...

    def close(self) -> None: ...


_watchdog = Watchdog("outbox-checker-watchdog")


class _FinalResponse(http.client.HTTPResponse):
    """The final response, after any informational (1xx) ones: http.client skips only
    ``100 Continue``, so a ``103 Early Hints`` was taken for the answer, and the real answer
    was left on the kept-alive connection for the next check to read."""

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:  # 101: a protocol switch, not interim
                return version, status, reason
            http.client.parse_headers(self.fp)  # the interim response's headers: dropped


class _Failed(Exception):
    def __init__(self, outcome: Outcome, detail: str, latency_s: float | None = None) -> None:
        super().__init__(detail)
        self.answer = CheckAnswer(outcome, detail, latency_s)


class _Stale(Exception):
    """A kept-alive connection turned out to be closed before any answer: retry once."""


class _RecentIds:
    """A bounded ``InMemoryReplayCache``, wrapped so that no one takes it for the default one
    by its truthiness (an empty one is falsy: it has ``__len__``)."""

    def __init__(self, max_entries: int, tolerance: timedelta) -> None:
        self._cache = InMemoryReplayCache(max_entries=max_entries)
        self._cache.cover(tolerance.total_seconds())

    def seen(self, msg_id: str, now: float) -> bool:
        return self._cache.seen(msg_id, now)


def _error_said(data: bytes) -> str:
    """What an error answer's body says, briefly: the handler writes ``{"error": kind,
    "detail": text}`` (a wrong secret, a clock out of tolerance), which "HTTP 401" alone hides."""
    try:
        said = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return ""
    if not isinstance(said, dict):
        return ""
    parts = [said.get("error"), said.get("detail")]
    text = ": ".join(p for p in parts if isinstance(p, str) and p)
    text = "".join(c if c.isprintable() else "?" for c in text)[:_ERROR_SAID_CHARS]
    return f" ({text})" if text else ""


def _ack_at_once(sock: socket.socket | None) -> None:
    """Ask Linux to acknowledge the answer's segments at once, not ~40 ms later.

    A server that writes its status line and headers, then its body, in two sends with Nagle's
    algorithm on (the standard library's http.server does) holds the body back until the headers
    are acknowledged; on a kept-alive connection the kernel delays that acknowledgement. The
    flag is a one-shot hint, so it is set again for every request. Elsewhere: nothing.
    """
    if sock is not None and hasattr(socket, "TCP_QUICKACK"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def _said(exc: BaseException) -> str:
    return f": {exc}" if str(exc) else ""


class _Lookup:
    """One name lookup on a thread of its own, which those of the same name share while it
    runs: the system resolver cannot be interrupted, and with a nameserver gone each check
    would leave one more thread waiting on it."""

    _running: ClassVar[dict[tuple[str, int], _Lookup]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, host: str, port: int) -> None:
        self.done = threading.Event()
        self.found: list[tuple[Any, ...]] | OSError = OSError(f"name lookup of {host} unfinished")
        self._key = (host, port)

    @classmethod
    def of(cls, host: str, port: int) -> _Lookup:
        with cls._lock:
            lookup = cls._running.get((host, port))
            if lookup is None:
                lookup = cls(host, port)
                # started first: a thread that cannot start must not leave a lookup no one runs
                threading.Thread(
                    target=lookup._run, name="outbox-checker-lookup", daemon=True
                ).start()
                cls._running[(host, port)] = lookup
            return lookup

    def _run(self) -> None:
        host, port = self._key
        try:
            self.found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            self.found = exc
        except Exception as exc:  # a name IDNA cannot encode, say
            self.found = OSError(f"name lookup of {host} failed: {exc}")
        finally:
            with self._lock:
                if self._running.get(self._key) is self:
                    del self._running[self._key]
            self.done.set()


def _lookup(host: str, port: int, by: float) -> list[tuple[Any, ...]]:
    """getaddrinfo, given up at `by` (see _Lookup)."""
    try:  # an address needs no lookup, nor a thread
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    lookup = _Lookup.of(host, port)
    if not lookup.done.wait(max(0.0, by - time.monotonic())):
        raise TimeoutError(f"name lookup of {host} unanswered")
    if isinstance(lookup.found, OSError):
        raise lookup.found
    return lookup.found


def _open_socket(
    host: str, port: int, by: float, read_timeout: float, total_by: float
) -> socket.socket:
    """A TCP connection to the first of the host's addresses that accepts one by `by`, each
    address given an equal share of the time left (one that drops packets must not take it
    all); its reads (the TLS handshake's) then wait up to `read_timeout` each, and not past
    `total_by` (the check's whole time)."""
    error: OSError | None = None
    addresses = _lookup(host, port, by)
    for n, (family, kind, proto, _, address) in enumerate(addresses):
        left = by - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left / (len(addresses) - n))
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        sock.settimeout(max(0.001, min(read_timeout, total_by - time.monotonic())))
        return sock
    if error is None or isinstance(error, TimeoutError):
        raise TimeoutError()  # said as the connect timeout
    raise error


class HttpCheckClient:
    """``CheckClient`` over ``http.client``: signs, sends, bounds, verifies. Thread-safe."""

    def __init__(self, settings: EndpointSettings, *, ssl_context: ssl.SSLContext | None = None):
        url = settings.url
        if url.host is None:
            raise ValueError(f"endpoint URL {url} has no host")
        self._https = url.scheme == "https"
        self._host = url.host.strip("[]")
        self._port = url.port or (443 if self._https else 80)
        self._target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        secrets = [s.get_secret_value() for s in settings.secrets]
        self._signer = Signer(secrets)
        # An answer must echo the id of the request it answers (fresh for every request), so a
        # replayed answer cannot match anyway; the replay cache is a second line, kept small so
        # that memory does not grow with the number of checks.
        self._verifier = Verifier(
            secrets,
            tolerance_s=settings.signature_tolerance.total_seconds(),
            replay_cache=_RecentIds(_REPLAY_CACHE_ENTRIES, settings.signature_tolerance),
        )
        self._connect_s = settings.connect_timeout.total_seconds()
        self._timeout_s = settings.timeout.total_seconds()
        self._max_bytes = settings.max_response_bytes
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            self._ssl = ssl_context or ssl.create_default_context(cafile=settings.ca_file)
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    # --- connections, one kept alive per worker thread ---------------------------------------

    def _new_connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._connect_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._connect_s)
        conn.response_class = _FinalResponse
        return conn

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            return conn, True
        conn = self._new_connection()
        self._local.conn = conn
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            conn.close()

    # --- one check ---------------------------------------------------------------------------

    def check(self, request: CheckRequest) -> CheckAnswer:
        start = time.monotonic()
        deadline = start + self._timeout_s
        for attempt in (1, 2):
            conn, reused = self._take()
            try:
                return self._exchange(conn, reused and attempt == 1, request, start, deadline)
            except _Stale:
                self._drop(conn)
                continue
            except _Failed as failed:
                self._drop(conn)
                return failed.answer
            except Exception:
                self._drop(conn)  # whatever it was, the connection's state is unknown
                raise
        raise AssertionError("unreachable: the second attempt never raises _Stale")

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        may_be_stale: bool,
        request: CheckRequest,
        start: float,
        deadline: float,
    ) -> CheckAnswer:
        if conn.sock is None:
            self._connect(conn, deadline)
        sock = conn.sock
        assert sock is not None
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Failed(Outcome.TIMEOUT, f"no time left after connecting ({self._timeout_s}s)")
        sock.settimeout(left)
        headers, body = build_request(self._signer, request)
        request_id = headers[HEADER_ID]
        headers["user-agent"] = _USER_AGENT
        watch = _watchdog.arm(sock, deadline)
        try:
            status, answer_headers, data, will_close = self._send(conn, may_be_stale, headers, body)
        except _Stale:
            if _watchdog.disarm(watch):
                raise _Failed(Outcome.TIMEOUT, f"no answer within {self._timeout_s}s") from None
            raise
        except _Failed as failed:
            if _watchdog.disarm(watch):
                raise _Failed(
                    Outcome.TIMEOUT, f"no answer within {self._timeout_s}s", failed.answer.latency_s
                ) from None
            raise
        except BaseException:
            _watchdog.disarm(watch)  # armed, it would shut the socket of a later request
            raise
        if _watchdog.disarm(watch):
            raise _Failed(Outcome.TIMEOUT, f"no answer within {self._timeout_s}s")
        latency = time.monotonic() - start
        if will_close:
            self._drop(conn)
        if 300 <= status < 400:
            location = answer_headers.get("location", "")
            raise _Failed(Outcome.REDIRECT, f"HTTP {status} to {location[:200]!r}", latency)
        if status != 200:
            raise _Failed(Outcome.HTTP_ERROR, f"HTTP {status}{_error_said(data)}", latency)
        try:
            answer = verify_response(
                self._verifier, request_id, answer_headers, data, tx_id=request.tx_id
            )
        except AuthenticationFailed as exc:
            raise _Failed(Outcome.BAD_SIGNATURE, f"{exc.kind}: {exc}", latency) from None
        except MalformedResponse as exc:
            raise _Failed(Outcome.BAD_RESPONSE, str(exc), latency) from None
        except ResponseMismatch as exc:
            raise _Failed(Outcome.MISMATCH, str(exc), latency) from None
        return CheckAnswer(_FROM_STATUS[answer.status], "", latency)

    def _connect(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        conn.timeout = max(0.001, min(self._connect_s, deadline - time.monotonic()))
        by = time.monotonic() + conn.timeout

        # The name lookup and every address tried within the connect timeout, not each of them
        # within it (http.client's), nor the lookup for as long as the system resolver takes.
        def open_socket(address: tuple[str, int], *_: object) -> socket.socket:
            return _open_socket(address[0], address[1], by, self._connect_s, deadline)

        conn._create_connection = open_socket  # type: ignore[attr-defined]
        try:
            conn.connect()
        except ssl.SSLError as exc:
            raise _Failed(Outcome.CONNECT_ERROR, f"TLS: {exc}") from None
        except TimeoutError as exc:
            detail = f"connect timed out ({conn.timeout:.3g}s{_said(exc)})"
            raise _Failed(Outcome.CONNECT_ERROR, detail) from None
        except OSError as exc:
            raise _Failed(Outcome.CONNECT_ERROR, f"{type(exc).__name__}: {exc}") from None

    def _send(
        self,
        conn: http.client.HTTPConnection,
        may_be_stale: bool,
        headers: dict[str, str],
        body: bytes,
    ) -> tuple[int, dict[str, str], bytes, bool]:
        try:
            conn.request("POST", self._target, body=body, headers=headers)
            _ack_at_once(conn.sock)
            response = conn.getresponse()
        except (
            http.client.RemoteDisconnected,
            ConnectionResetError,
            ConnectionAbortedError,
            BrokenPipeError,
            # a TLS server's keep-alive timeout closes with no close_notify (Python's, gunicorn's)
            ssl.SSLEOFError,
            ssl.SSLZeroReturnError,
        ) as exc:
            if may_be_stale:
                raise _Stale from None
            raise _Failed(Outcome.TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise _Failed(Outcome.TIMEOUT, f"no answer within {self._timeout_s}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Failed(Outcome.TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}") from None
        answer_headers: dict[str, str] = {}
        for name, value in response.getheaders():
            answer_headers.setdefault(name.lower(), value)  # first occurrence wins
        status = response.status
        if 300 <= status < 400:
            return status, answer_headers, b"", True  # not read, not followed
        declared = answer_headers.get("content-length", "").strip()
        if declared.isascii() and declared.isdigit() and length_over(declared, self._max_bytes):
            raise _Failed(
                Outcome.TOO_LARGE, f"answer of {declared} bytes exceeds {self._max_bytes}"
            )
        try:
            data = response.read(self._max_bytes + 1)
        except TimeoutError:
            raise _Failed(Outcome.TIMEOUT, f"no answer within {self._timeout_s}s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Failed(Outcome.TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}") from None
        if len(data) > self._max_bytes:
            raise _Failed(Outcome.TOO_LARGE, f"answer exceeds {self._max_bytes} bytes")
        return status, answer_headers, data, response.will_close or not response.isclosed()
