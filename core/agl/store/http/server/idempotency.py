"""Retries are safe: the first answer to each ``Idempotency-Key`` is kept, so a request the client sends again
(it timed out or lost the connection) gets that answer instead of being applied twice."""

from __future__ import annotations

import collections
import threading
import time
import zlib
from typing import Awaitable, Callable, Dict, NamedTuple, Optional, Tuple

import anyio
import anyio.to_thread
from fastapi.responses import Response

from agl.store.http.server.errors import error_response
from agl.store.http.wire import IDEMPOTENCY_HEADER, ErrorBody

# What an entry costs beyond its answer's body: the key, the digest, the entry and the Response objects.
ENTRY_OVERHEAD = 600
# Answers longer than this are kept compressed: they are mostly JSON, which zlib's fastest level shrinks several
# fold (a task's text echoed back in each rollout), so more retries find their answer within the byte bound.
COMPRESS_OVER = 4096


class RetryKey(NamedTuple):
    """One request as its retries name it: who sent it (the token's name), where, the ``Idempotency-Key``,
    and a digest of its body, which binds the key to the body it first came with."""

    client: str
    path: str
    key: str
    digest: bytes


class _Entry:
    """A key's first request: running until ``done`` is set, then its answer (``body`` zlib-compressed when
    ``compressed``)."""

    __slots__ = ("body", "compressed", "digest", "done", "finished", "media_type", "size", "status")

    def __init__(self, digest: bytes) -> None:
        self.digest = digest
        self.done = threading.Event()
        self.body = b""
        self.compressed = False
        self.status = 0
        self.media_type: Optional[str] = None
        self.finished = 0.0
        self.size = ENTRY_OVERHEAD

    def keep(self, response: Response) -> None:
        body = bytes(response.body)
        self.compressed = len(body) > COMPRESS_OVER
        self.body = zlib.compress(body, 1) if self.compressed else body
        self.status, self.media_type = response.status_code, response.media_type
        self.size = ENTRY_OVERHEAD + len(self.body)


class IdempotencyCache:
    """The first answer to each ``Idempotency-Key``, so that a retried request is not applied twice.

    A retry that arrives while the first request still runs waits for its answer. Answers are kept ``ttl``
    seconds after they were given, and at most ``max_bytes`` of them (their bodies, compressed when long, plus a
    fixed cost per entry):
    the oldest go first, so a burst of large answers cannot grow the server without bound, and a retry, which
    comes within the client's back-off, still finds the recent ones. A key is bound to its body's digest: the
    same key with another body is refused (422), never given the first answer. The cache is per server
    process; across a server restart the client's own checks take over (see agl.store.http.client).
    """

    def __init__(self, ttl: float, max_bytes: int) -> None:
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: Dict[Tuple[str, str, str], _Entry] = {}
        self._finished: collections.OrderedDict[Tuple[str, str, str], _Entry] = collections.OrderedDict()
        self.kept_bytes = 0  # the sizes of the answered entries, which the byte bound limits

    def run(self, key: RetryKey, call: Callable[[], Response]) -> Response:
        owner, entry = self._enter(key)
        if entry is None:
            return _reused(key)
        if not owner:
            entry.done.wait()
            return _copy_answer(entry)
        try:
            response = call()
        except BaseException as exc:  # noqa: BLE001 - an error the handler turns into 4xx: a retry gets the same one
            response = error_response(exc)
        return self._finish(key, entry, response)

    async def run_async(self, key: RetryKey, call: Callable[[], Awaitable[Response]]) -> Response:
        """:meth:`run` for a call made on the event loop."""
        owner, entry = self._enter(key)
        if entry is None:
            return _reused(key)
        if not owner:  # rare: a retry while the first try still runs
            await anyio.to_thread.run_sync(entry.done.wait)
            return _copy_answer(entry)
        try:
            response = await call()
        except BaseException as exc:  # noqa: BLE001 - as in run()
            response = error_response(exc)
        return self._finish(key, entry, response)

    def record(self, key: RetryKey, response: Response) -> Response:
        """Keep ``response`` as the answer to ``key`` (a request answered without ``run``)."""
        owner, entry = self._enter(key)
        if entry is None:
            return _reused(key)
        return self._finish(key, entry, response) if owner else response

    def seen(self, key: RetryKey) -> bool:
        with self._lock:
            return _slot(key) in self._entries

    def _enter(self, key: RetryKey) -> Tuple[bool, Optional[_Entry]]:
        """(whether this request runs the call, the key's entry), the entry made if the key is new; no entry if
        the key was first used with another body."""
        with self._lock:
            self._expire()
            entry = self._entries.get(_slot(key))
            if entry is None:
                entry = self._entries[_slot(key)] = _Entry(key.digest)
                return True, entry
            return False, entry if entry.digest == key.digest else None

    def _finish(self, key: RetryKey, entry: _Entry, response: Response) -> Response:
        """Keep ``response`` as the key's answer; a failure of our own (5xx) is not kept: a retry tries again."""
        entry.keep(response)  # outside the lock: compressing a large answer takes milliseconds
        with self._lock:
            entry.finished = time.monotonic()
            if response.status_code >= 500:
                self._entries.pop(_slot(key), None)
            else:
                self._finished[_slot(key)] = entry
                self.kept_bytes += entry.size
                self._expire()
        entry.done.set()
        return response

    def _expire(self) -> None:
        """Drop answers older than ``ttl``, then the oldest while over ``max_bytes`` (with the lock held)."""
        deadline = time.monotonic() - self.ttl
        while self._finished:
            key, entry = next(iter(self._finished.items()))
            if self.kept_bytes <= self.max_bytes and entry.finished > deadline:
                break
            del self._finished[key]
            del self._entries[key]
            self.kept_bytes -= entry.size


def _slot(key: RetryKey) -> Tuple[str, str, str]:
    """Where a key's entry is kept: its digest is checked against the entry's, not part of the lookup."""
    return key.client, key.path, key.key


def _reused(key: RetryKey) -> Response:
    """The answer to a key sent again with another body: a client bug, which must not get the first answer."""
    body = ErrorBody(
        error="StoreRequestError",
        message=f"{IDEMPOTENCY_HEADER} {key.key!r} was already used for a request to {key.path} with another body: "
        "send a new key with each new request (a retry sends the same body with the same key)",
    )
    return Response(body.model_dump_json(exclude_none=True), status_code=422, media_type="application/json")


def _copy_answer(entry: _Entry) -> Response:
    """The first try's answer, as a response of its own for the retry."""
    body = zlib.decompress(entry.body) if entry.compressed else entry.body
    return Response(body, status_code=entry.status, media_type=entry.media_type)
