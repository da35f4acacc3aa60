"""Noticing that the HTTP client of a request went away, for the handlers of a long, non-streamed answer.

Starlette does not cancel a handler whose client disconnected (only a streamed response notices). A
handler that awaits a slow answer (the policy server generating, the proxy waiting on its upstream)
therefore runs on for nobody. With an SDK client that times out and retries this multiplies: the
policy server generated every abandoned attempt to ``max_tokens`` next to the live ones, and the recording
proxy stored the late answer the agent never saw as a successful call next to the retry's.

:func:`unless_disconnected` runs such a wait next to a watcher of the connection and cancels the wait
(raising :class:`ClientDisconnected`) as soon as the client is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")

#: The status a handler answers a client that went away with (nginx's "client closed request"), read by no
#: one: the connection is gone.
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    """The client of the request disconnected before its answer was ready."""


async def until_disconnected(request: Request) -> None:
    """Return once the client of ``request`` has disconnected.

    The request's body must have been read: this consumes the ASGI messages that follow it, of which only
    ``http.disconnect`` is left (the server sends it when the connection closes, and keeps sending it).
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client of ``request`` (whose body was read) disconnects first: then
    ``work`` is cancelled, has run its cleanup (``finally`` blocks), and :class:`ClientDisconnected` is raised.

    ``work`` runs as a task of its own, so that cancelling it leaves the handler able to answer.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (server shutdown): so is its work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done() or watcher.cancelled() or watcher.exception() is not None:
        return await task  # (a watcher that failed says nothing about the client: the work goes on)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


__all__ = ["CLIENT_CLOSED_REQUEST", "ClientDisconnected", "unless_disconnected", "until_disconnected"]
