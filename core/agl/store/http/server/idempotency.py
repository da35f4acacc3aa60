"""Retries are safe: the first answer to each ``Idempotency-Key`` is kept, so a request the client sends again
(it timed out or lost the connection) gets that answer instead of being applied twice."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Awaitable, Callable, List, Tuple

import anyio
import anyio.to_thread
from fastapi.responses import Response

from agl.store.http.server.errors import error_response


class IdempotencyCache:
    """The first answer to each ``Idempotency-Key``, so that a retried request is not applied twice.

    A retry that arrives while the first request still runs waits for its answer. Entries live
    ``ttl`` seconds (at most ``max_entries``): a retry comes within the client's back-off, not later.
    The cache is per server process; across a server restart the client's own checks take over (see
    agl.store.http.client).
    """

    def __init__(self, ttl: float, max_entries: int) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Tuple[str, ...], Tuple[float, threading.Event, List[Any]]]
        self._entries = collections.OrderedDict()

    def run(self, key: Tuple[str, ...], call: Callable[[], Response]) -> Response:
        owner, (_, done, result) = self._enter(key)
        if not owner:
            done.wait()
            return _copy_response(result[0])
        try:
            response = call()
        except BaseException as exc:  # noqa: BLE001 - an error the handler turns into 4xx: a retry gets the same one
            response = self._failed(key, exc)
        result.append(response)
        done.set()
        return response

    async def run_async(self, key: Tuple[str, ...], call: Callable[[], Awaitable[Response]]) -> Response:
        """:meth:`run` for a call made on the event loop."""
        owner, (_, done, result) = self._enter(key)
        if not owner:  # rare: a retry while the first try still runs
            await anyio.to_thread.run_sync(done.wait)
            return _copy_response(result[0])
        try:
            response = await call()
        except BaseException as exc:  # noqa: BLE001 - as in run()
            response = self._failed(key, exc)
        result.append(response)
        done.set()
        return response

    def _enter(self, key: Tuple[str, ...]) -> Tuple[bool, Tuple[float, threading.Event, List[Any]]]:
        """(whether this request runs the call, the key's entry), the entry made if the key is new."""
        with self._lock:
            self._expire()
            entry = self._entries.get(key)
            owner = entry is None
            if entry is None:
                entry = (time.monotonic(), threading.Event(), [])
                self._entries[key] = entry
        return owner, entry

    def _failed(self, key: Tuple[str, ...], exc: BaseException) -> Response:
        response = error_response(exc)
        if response.status_code >= 500:
            with self._lock:  # a failure of our own: let a retry try again
                self._entries.pop(key, None)
        return response

    def seen(self, key: Tuple[str, ...]) -> bool:
        with self._lock:
            return key in self._entries

    def record(self, key: Tuple[str, ...], response: Response) -> Response:
        """Keep ``response`` as the answer to ``key`` (a request answered without ``run``)."""
        done = threading.Event()
        done.set()
        with self._lock:
            self._expire()
            self._entries.setdefault(key, (time.monotonic(), done, [response]))
        return response

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            key, (created, done, _) = next(iter(self._entries.items()))
            if len(self._entries) <= self.max_entries and now - created < self.ttl:
                break
            if not done.is_set():
                break  # still running: keep it (entries are in start order)
            del self._entries[key]


def _copy_response(response: Response) -> Response:
    return Response(response.body, status_code=response.status_code, media_type=response.media_type)
