"""The state an app's endpoints share (:class:`ServerContext`, on ``app.state``): the store, the limits, the
idempotency cache and the long-poll limiter, and how a store call runs (on the event loop or a thread)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from fastapi.responses import Response

from agl.store._waiting import give_up_when
from agl.store.base import AsyncRolloutCalls, LightningStore
from agl.store.http.server.auth import CLIENT_STATE
from agl.store.http.server.idempotency import IdempotencyCache, RetryKey
from agl.store.http.server.limits import BODY_STATE, ServerLimits
from agl.store.http.server.refusal_log import RefusalLog
from agl.store.http.wire import IDEMPOTENCY_HEADER
from agl.store.memory import InMemoryLightningStore
from agl.store.sqlite.store import SqliteLightningStore

T = TypeVar("T")


class ServerContext:
    """What the endpoints of one app share, and the ways they call its store."""

    def __init__(self, store: LightningStore, limits: ServerLimits) -> None:
        self.store = store
        self.limits = limits
        self.cache = IdempotencyCache(limits.idempotency_ttl, limits.idempotency_bytes)
        # Calls to a store in this process's memory or on local disk take tens of microseconds: they run on
        # the event loop, because handing each to a worker thread costs more CPU than the call itself. A
        # networked store (PostgreSQL) waits on its server, so its calls go to worker threads. Long polls
        # always do (they wait by design).
        inline = limits.inline_calls
        if inline is None:
            inline = isinstance(store, (InMemoryLightningStore, SqliteLightningStore))
        self.inline: bool = inline
        # A networked store with coroutines for the calls of a rollout cycle waits for its database on the event
        # loop: no thread hop for those (see AsyncRolloutCalls); its other calls still go to worker threads.
        self.native: Optional[AsyncRolloutCalls] = (
            store if isinstance(store, AsyncRolloutCalls) and limits.async_calls and not inline else None
        )
        self.pollers: Optional[anyio.CapacityLimiter] = None  # the long polls' limiter, made by the app's lifespan
        self.otlp_refusals = RefusalLog()

    async def run(self, call: Callable[[], T]) -> T:
        """A store call that does not wait: inline for local stores, on a worker thread for networked ones."""
        return call() if self.inline else await anyio.to_thread.run_sync(call)

    def idempotency_key(self, request: Request) -> Optional[RetryKey]:
        """(the token's name, the path, the Idempotency-Key header, the body's digest): a retry of the same
        request by the same client, if the request has the header."""
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if not key:
            return None
        state = request.scope["state"]
        digest = hashlib.sha256(state.get(BODY_STATE, b"")).digest()  # ~2 ms per MB: only for keyed requests
        return RetryKey(state[CLIENT_STATE], request.url.path, key[:128], digest)

    def once(self, request: Request, call: Callable[[], Response]) -> Response:
        """Run ``call``; with an Idempotency-Key, a repeat of the same request gets the first answer."""
        key = self.idempotency_key(request)
        return call() if key is None else self.cache.run(key, call)

    async def once_async(self, request: Request, call: Callable[[], Awaitable[Response]]) -> Response:
        key = self.idempotency_key(request)
        return await call() if key is None else await self.cache.run_async(key, call)

    async def answer_once(
        self,
        request: Request,
        call: Callable[[], Response],
        on_loop: Callable[[AsyncRolloutCalls], Awaitable[Response]],
    ) -> Response:
        """A change a client may send again, answered once per Idempotency-Key: ``on_loop`` with the store's
        async calls on the event loop if it has them (see ``native``), else ``call`` where :meth:`run` runs it."""
        native = self.native
        if native is not None:
            return await self.once_async(request, lambda: on_loop(native))
        return await self.run(lambda: self.once(request, call))

    async def long_poll(self, request: Request, wait: Callable[[threading.Event], Response]) -> Response:
        """Run a blocking wait on the poll limiter; ``gone`` is set if the client disconnects meanwhile."""
        gone = threading.Event()

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            return await anyio.to_thread.run_sync(wait, gone, limiter=self.pollers)
        finally:
            watcher.cancel()

    def sliced(self, timeout: float, gone: threading.Event, step: Callable[[float], Any]) -> Any:
        """Call ``step(wait)`` in slices until it returns something or the time is up; None once the client left.

        ``gone`` is checked before each slice and, by a store that waits in ``wait_until`` (SQLite,
        PostgreSQL), before each claim within a slice: work that arrives after the disconnect is not claimed
        for a client that will never get it. A slice bounds how long the thread stays after that.
        """
        limits = self.limits
        deadline = time.monotonic() + min(timeout, limits.max_poll_seconds)
        with give_up_when(gone):
            while not gone.is_set():
                left = max(0.0, deadline - time.monotonic())
                result = step(min(left, limits.poll_slice_seconds))
                if result or left <= limits.poll_slice_seconds:
                    return result
        return None


def context_of(request: Request) -> ServerContext:
    """The shared state of the app that ``request`` came to (set by ``create_app``)."""
    return request.app.state.store_server
