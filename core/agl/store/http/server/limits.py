"""What one store server accepts (:class:`ServerLimits`), and the middleware that refuses a body over the
size limit with 413 before anything parses it (:class:`BodyLimit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agl.store.http.wire import ErrorBody

BODY_STATE = "agl_body"  # scope["state"] key: the request's whole body, once BodyLimit has read it


@dataclass
class ServerLimits:
    """What one server accepts; a request over a limit is answered with a 4xx that names it (408 when it does not
    come in time; 503, which clients retry, above the connection cap)."""

    max_body_bytes: int = 32 * 1024 * 1024  # span batches with token ids are a few MB
    max_poll_seconds: float = 20.0  # a long poll answers after this at most; the client asks again
    poll_slice_seconds: float = 1.0  # a long poll checks for a gone client this often
    max_pollers: int = 2048  # concurrent long polls (each holds a thread while it waits)
    max_workers: int = 64  # threads for all other requests
    reap_interval: float = 1.0  # seconds between reap_expired() calls of the server's timer
    idempotency_ttl: float = 600.0  # seconds a retried request still gets the first answer
    idempotency_bytes: int = 64 * 1024 * 1024  # answers kept for retries, at most (the oldest go first)
    header_timeout: float = 10.0  # seconds a request's headers may take to arrive, whole
    body_timeout: float = 30.0  # seconds a request's body may stall (no byte received) before the connection closes
    max_connections: int = 4096  # open connections and running requests; above, requests get 503 (clients retry)
    inline_calls: Optional[bool] = None  # run non-waiting store calls on the event loop (None: for local stores)
    async_calls: bool = True  # a networked store's AsyncRolloutCalls on the event loop (else on worker threads)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 before anything parses it.

    It reads the body itself (FastAPI would buffer it anyway) and replays it to the app, so a body sent
    without Content-Length (chunked) is limited too.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _too_large(scope, send, self.max_bytes)
            return
        chunks: List[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _too_large(scope, send, self.max_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        scope.setdefault("state", {})[BODY_STATE] = body  # the idempotency key's digest is made of it
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for the client to disconnect

        await self.app(scope, replay, send)


async def _too_large(scope: Scope, send: Send, max_bytes: int) -> None:
    body = ErrorBody(
        error="StoreRequestError",
        message=f"request body larger than this server's limit of {max_bytes} bytes: send smaller batches "
        "(the agl client splits span batches by itself) or start the server with a larger --max-body-mb",
    )
    response = Response(body.model_dump_json(exclude_none=True), status_code=413, media_type="application/json")
    await response(scope, _drain_receive, send)


async def _drain_receive() -> Message:
    return {"type": "http.disconnect"}
