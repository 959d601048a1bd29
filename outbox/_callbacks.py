"""Calling application code back from the async API without stalling the event loop."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any


def is_async(fn: object) -> bool:
    """A coroutine function, or an object whose __call__ is one, partials of them included."""
    while isinstance(fn, functools.partial):  # inspect unwraps them for functions, not objects
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 -- the bound method, not callable()
    )


async def call_back(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` for an async API: a coroutine function runs on the loop; anything else runs in
    a worker thread (`asyncio.to_thread`, as ASGI frameworks run sync endpoints), so that a
    resolver or local transaction that blocks (a database call, an HTTP call) does not stall
    every other task. An awaitable it returns is awaited."""
    out = fn(*args) if is_async(fn) else await asyncio.to_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out
