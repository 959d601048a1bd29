"""The check handler as an ASGI 3 application, to mount in any ASGI server or framework."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from outbox._errors import InvalidConfigError

from ._handler import (
    AsyncCheckHandler,
    CheckHandler,
    HandlerResult,
    error_result,
    too_large_result,
)
from ._protocol import length_over

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_METHOD_NOT_ALLOWED = error_result(
    405, "method_not_allowed", "the check endpoint takes POST", {"allow": "POST"}
)


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def asgi_app(handler: CheckHandler | AsyncCheckHandler, path: str = "/outbox/check") -> ASGIApp:
    """Serve ``handler`` for POST on ``path``: 404 elsewhere, 405 for other methods, 413 if the
    body exceeds ``handler.max_body_bytes`` (enforced while reading, not after)."""
    if not isinstance(handler, (CheckHandler, AsyncCheckHandler)):
        # Typed callers cannot; others were accepted, and every check answered 500 (an
        # AttributeError): counted as failed checks, until max_checks discarded the pending ones.
        hint = (  # type: ignore[unreachable]
            ": wrap the resolver, asgi_app(AsyncCheckHandler(resolver, secrets)) (or "
            "CheckHandler for a blocking one)"
            if callable(handler)
            else ""
        )
        raise InvalidConfigError(
            f"asgi_app() takes a CheckHandler or an AsyncCheckHandler, not "
            f"{type(handler).__name__}{hint}"
        )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            raise ValueError(f"unsupported ASGI scope type {scope['type']!r}")
        if path not in (scope["path"], _route_path(scope)):
            await _respond(send, error_result(404, "not_found", f"the check endpoint is {path}"))
            return
        if scope["method"] != "POST":
            await _respond(send, _METHOD_NOT_ALLOWED)
            return
        headers = _headers(scope)
        try:
            body = await _read_body(receive, headers, handler.max_body_bytes)
        except _Disconnected:
            return  # nobody to answer
        except _TooLarge:
            await _respond(send, too_large_result(handler.max_body_bytes))
            return
        if isinstance(handler, AsyncCheckHandler):
            result = await handler.handle(headers, body)
        else:
            # The resolver usually queries a database: keep the blocking call off the event loop.
            result = await asyncio.to_thread(handler.handle, headers, body)
        await _respond(send, result)

    return app


def _route_path(scope: Scope) -> str:
    # ASGI puts the mount point in root_path and (per spec) also at the start of path.
    root: str = scope.get("root_path", "")
    full: str = scope["path"]
    return full[len(root) :] if root and full.startswith(root) else full


def _headers(scope: Scope) -> dict[str, str]:
    # First occurrence wins, as in http.server; ASGI header names are already lower-case.
    headers: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


async def _read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    declared = headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and length_over(declared, limit):
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _respond(send: Send, result: HandlerResult) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in result.headers.items()]
    headers.append((b"content-length", str(len(result.body)).encode("ascii")))
    await send({"type": "http.response.start", "status": result.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": result.body})


async def _lifespan(receive: Receive, send: Send) -> None:
    # Nothing to set up or tear down; just let the server know.
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
