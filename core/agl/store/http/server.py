"""The store over HTTP: ``agl store serve`` (FastAPI + uvicorn) in front of any LightningStore.

Why it is built this way:
- Every endpoint is one LightningStore call, so the HTTP store behaves exactly like the one it serves;
  the client (agl.store.http.client) passes the same contract suite. The API is documented at ``/docs``
  (OpenAPI schema at ``/openapi.json``).
- No token, no access: every endpoint but ``/healthz`` and the API's description (``/docs``,
  ``/openapi.json``: routes and schemas, no data) needs ``Authorization: Bearer <token>``; tokens
  are a shared secret and/or one per runner from a file. A missing token gets 401, a wrong one 403.
- Bad input never reaches the store half-checked and never gets a 5xx: bodies over the size limit get
  413 before they are parsed, malformed ones 422 (400 for OTLP) naming the field, unknown ids 404 naming
  the id, stale updates 409. Nothing is changed by a refused request.
- Dequeue and wait are long polls: the request thread blocks inside the store, which wakes it when work
  arrives or a rollout ends (a condition variable, SQLite's doorbell, PostgreSQL's notifications). They
  run on their own thread limiter so waiting runners never starve other requests; a poll is answered
  after at most ``max_poll_seconds`` and the client asks again.
- Retries are safe: a request with an ``Idempotency-Key`` header that arrives again (the client timed out
  or lost the connection) gets the first answer, even while the first is still running.
- A timer calls ``reap_expired`` so attempts of runners that died are ended and retried even when no
  runner or trainer is calling.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agl import semconv
from agl.errors import AglError, StoreUnavailableError
from agl._util.http_thread import ThreadedServer
from agl.store.http import otlp
from agl.store.http.transport import bearer_token
from agl.store._waiting import give_up_when
from agl.store.base import AsyncRolloutCalls, LightningStore, StoreStats
from agl.store.memory import InMemoryLightningStore
from agl.store.sqlite.store import SqliteLightningStore
from agl.store.http.wire import (
    AUTH_HEADER,
    IDEMPOTENCY_HEADER,
    TOKEN_ENV,
    AttemptList,
    CompleteAndDequeueBody,
    CompleteBody,
    CompletedAndClaimed,
    Deleted,
    DeleteSpansBody,
    DequeueBody,
    EnqueueBody,
    ErrorBody,
    MaybeResources,
    QueryBody,
    Renewed,
    ResourcesBody,
    RolloutList,
    SpanList,
    SpansBody,
    Stored,
    WaitBody,
    error_body,
    error_status,
)
from agl.types import Attempt, ResourcesUpdate, Rollout

logger = logging.getLogger("agl.store.http.server")


@dataclass
class ServerLimits:
    """What one server accepts; every limit is answered with a 4xx that names it."""

    max_body_bytes: int = 32 * 1024 * 1024  # span batches with token ids are a few MB
    max_poll_seconds: float = 20.0  # a long poll answers after this at most; the client asks again
    poll_slice_seconds: float = 1.0  # a long poll checks for a gone client this often
    max_pollers: int = 2048  # concurrent long polls (each holds a thread while it waits)
    max_workers: int = 64  # threads for all other requests
    reap_interval: float = 1.0  # seconds between reap_expired() calls of the server's timer
    idempotency_ttl: float = 600.0  # seconds a retried request still gets the first answer
    idempotency_entries: int = 100_000
    inline_calls: Optional[bool] = None  # run non-waiting store calls on the event loop (None: for local stores)
    async_calls: bool = True  # a networked store's AsyncRolloutCalls on the event loop (else on worker threads)


_COMMENT = re.compile(r"(?:^|(?<=\s))#")  # a comment starts a line or follows a space


class TokenSet:
    """The bearer tokens a server accepts, by name (the name shows up in the logs, never the token)."""

    def __init__(self, tokens: Dict[str, str]) -> None:
        tokens = {name: bearer_token(token, f"token {name!r}") or "" for name, token in tokens.items()}
        empty = [name for name, token in tokens.items() if not token]
        if empty:
            raise ValueError(f"token(s) {', '.join(empty)} are empty: every token needs at least one character")
        self._tokens = [(name, token.encode()) for name, token in tokens.items()]

    @classmethod
    def load(cls, token: Optional[str] = None, tokens_file: Optional[str] = None) -> "TokenSet":
        """A shared ``token`` (default: ``$AGL_STORE_TOKEN``) and/or per-runner tokens from ``tokens_file``.

        The file has one token per line, ``NAME TOKEN`` or just ``TOKEN``; ``#`` at the start of a line or after
        a space starts a comment (one inside a token is part of it: a secret is never cut short). A name given
        twice is refused, not the first token silently dropped.
        """
        tokens: Dict[str, str] = {}
        where: Dict[str, str] = {}  # name -> where it was given
        if token is None:
            token = bearer_token(os.environ.get(TOKEN_ENV), f"${TOKEN_ENV}")
        else:
            token = bearer_token(token, "--token")
        if token:
            tokens["shared"], where["shared"] = token, "the shared token (--token or $AGL_STORE_TOKEN)"
        if tokens_file:
            with open(tokens_file, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    words = _COMMENT.split(line, 1)[0].split()
                    if not words:
                        continue
                    if len(words) > 2:
                        raise ValueError(f"{tokens_file}:{number}: write 'NAME TOKEN' or 'TOKEN' (tokens have no spaces)")
                    name, value = (words[0], words[1]) if len(words) == 2 else (f"line-{number}", words[0])
                    if name in tokens:
                        raise ValueError(
                            f"{tokens_file}:{number}: the name {name!r} is given twice (also {where[name]}): give each "
                            "runner or machine its own name"
                        )
                    tokens[name], where[name] = value, f"line {number}"
        return cls(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def check(self, presented: str) -> Optional[str]:
        """The name of the token presented, or None; compares in constant time against every token."""
        found = None
        for name, token in self._tokens:
            if hmac.compare_digest(presented.encode(), token):
                found = name
        return found


# -- request body size ----------------------------------------------------------------------------------


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


class TokenCheck:
    """ASGI middleware: a request under ``prefix`` needs a bearer token the server accepts (401/403 with a JSON
    error otherwise); the token's name goes to ``scope["state"]["agl_client"]`` (the idempotency keys' owner).

    Why a middleware and not a FastAPI dependency: solving the dependency cost a light request 10-17 of its
    70-90 µs of server CPU (``benchmarks/server_overhead.py``); this is a header lookup. A request for a
    path that does not exist under ``prefix`` gets 401 without a token too (no route list for strangers).
    """

    def __init__(self, app: ASGIApp, tokens: Optional[TokenSet], prefix: str) -> None:
        self.app = app
        self.tokens = tokens
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        try:
            name = self._check(scope)
        except _AuthFailure as exc:
            body = ErrorBody(error="StoreAuthError", message=exc.message)
            headers = {"WWW-Authenticate": 'Bearer realm="agl-store"'} if exc.status == 401 else None
            response = JSONResponse(body.model_dump(exclude_none=True), status_code=exc.status, headers=headers)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[CLIENT_STATE] = name
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> str:
        if not self.tokens:
            return "anonymous"
        header = next((v for k, v in scope["headers"] if k == _AUTH_HEADER), b"").decode("latin-1")
        scheme, _, presented = header.partition(" ")
        if not header:
            raise _AuthFailure(401, "this store server needs a token: send 'Authorization: Bearer <token>' "
                               f"(the agl client reads token=... or ${TOKEN_ENV})")
        if scheme.lower() != "bearer" or not presented.strip():
            raise _AuthFailure(401, "the Authorization header must be 'Bearer <token>'")
        name = self.tokens.check(presented.strip())
        if name is None:
            raise _AuthFailure(403, "token not accepted by this store server: check the token you were given")
        return name


class DirectRoutes:
    """ASGI middleware: a runner's hot requests go straight to their endpoint functions.

    Why: under load, Starlette's and FastAPI's per-request machinery (matching the path against every route,
    the exception and exit-stack middlewares, dependency solving, the request and response wrappers) was ~18%
    of the server's CPU per PostgreSQL rollout (py-spy under ``benchmarks/store_load.py``); calling the
    endpoints directly cut the server's CPU per rollout by ~15% (alternated runs, 8 clients). The routes stay
    registered with FastAPI, which documents them (OpenAPI) and answers every other method and path; errors
    get the app's own exception handlers, looked up along the exception's MRO as Starlette looks them up.
    Only endpoints taking path strings and the request may be listed (their bodies are parsed by ``_parse``).
    """

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, names: Sequence[str]) -> None:
        self.app = app
        self._fastapi = fastapi_app
        self._names = names
        self._table: Optional[List[Tuple[str, Any, Callable[..., Awaitable[Response]]]]] = None

    def _routes(self) -> List[Tuple[str, Any, Callable[..., Awaitable[Response]]]]:
        if self._table is None:  # built on the first request: the routes are registered after the middleware
            found = {route.name: route for route in self._fastapi.routes if isinstance(route, APIRoute)}
            self._table = [
                (method, found[name].path_regex, found[name].endpoint)
                for name in self._names
                for method in found[name].methods
            ]
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):]
            for method, regex, endpoint in self._routes():
                if scope["method"] == method and (match := regex.match(path)):
                    await self._call(endpoint, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _call(
        self, endpoint: Callable[..., Awaitable[Response]], params: Dict[str, str], scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request=request, **params)
        except Exception as exc:
            handlers = self._fastapi.exception_handlers
            handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
            if handler is None:
                raise  # as through FastAPI: ServerErrorMiddleware answers 500
            response = await handler(request, exc)
        await response(scope, receive, send)


CLIENT_STATE = "agl_client"
_AUTH_HEADER = AUTH_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes


# -- idempotent retries -----------------------------------------------------------------------------------


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
        self._entries: "collections.OrderedDict[Tuple[str, ...], Tuple[float, threading.Event, List[Any]]]"
        self._entries = collections.OrderedDict()

    def run(self, key: Tuple[str, ...], call: Callable[[], Response]) -> Response:
        owner, (_, done, result) = self._enter(key)
        if not owner:
            done.wait()
            return _copy_response(result[0])
        try:
            response = call()
        except BaseException as exc:  # an error the handler turns into 4xx: a retry gets the same one
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
        response = _error_response(exc)
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


# -- errors ---------------------------------------------------------------------------------------------


def _error_response(exc: BaseException) -> Response:
    status = error_status(exc)
    if isinstance(exc, StoreUnavailableError):  # an outage of its database, not a bug: one line, no traceback
        logger.warning("store unavailable, answered 503 (clients retry): %s", exc)
    if status is None:
        logger.exception("store server error", exc_info=exc)
        body = ErrorBody(error="InternalError", message=f"the store server failed: {type(exc).__name__}: {exc}")
        return Response(body.model_dump_json(exclude_none=True), status_code=500, media_type="application/json")
    return Response(error_body(exc).model_dump_json(exclude_none=True), status_code=status, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg')}")
    more = f" (and {len(exc.errors()) - 5} more)" if len(exc.errors()) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more + " (see the API schema at /docs)"


def _install_error_handlers(app: FastAPI) -> None:
    async def on_store_error(request: Request, exc: Exception) -> Response:
        return _error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        body = ErrorBody(error="StoreRequestError", message=_validation_message(exc))
        return JSONResponse(body.model_dump(exclude_none=True), status_code=422)

    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no endpoint {request.method} {request.url.path} on this store server (see /docs)"
            if "/v1/" in request.url.path[1:]:  # the client was given a URL with a path: .../v1, .../v1/stats
                message += "; pass the store as http://HOST:PORT, without a path (the client adds /v1/...)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path} (see /docs)"
        body = ErrorBody(error="StoreRequestError", message=message)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(AglError, on_store_error)
    app.add_exception_handler(ValueError, on_store_error)
    app.add_exception_handler(TypeError, on_store_error)
    app.add_exception_handler(OverflowError, on_store_error)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]


# -- the app --------------------------------------------------------------------------------------------

_ROLLOUTS = TypeAdapter(RolloutList)


def _json(model: Any) -> Response:
    """A pre-serialised JSON response (the response models are only used for the OpenAPI schema)."""
    return Response(model.model_dump_json(), media_type="application/json")


def _rollouts(rollouts: List[Rollout]) -> Response:
    return Response(_ROLLOUTS.dump_json(RolloutList(rollouts=rollouts)), media_type="application/json")


_ERRORS: Dict[int | str, Dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "no token (Authorization: Bearer <token>)",
        403: "token not accepted",
        404: "an id that is not in the store (the message names it)",
        409: "a stale or illegal state change (nothing was changed)",
        413: "request body over the server's limit",
        422: "malformed request (the message names the field)",
    }.items()
}


def create_app(
    store: LightningStore,
    *,
    tokens: Optional[TokenSet] = None,
    allow_anonymous: bool = False,
    limits: Optional[ServerLimits] = None,
) -> FastAPI:
    """The FastAPI app serving ``store``. It does not close the store; its owner does.

    ``tokens`` are required unless ``allow_anonymous`` (then anybody who can reach the port has full access).
    """
    if not tokens and not allow_anonymous:
        raise ValueError(
            "a store server needs at least one token (--token, $AGL_STORE_TOKEN or --tokens-file); "
            "pass allow_anonymous=True (--insecure-no-auth) only on a trusted network"
        )
    limits = limits or ServerLimits()
    cache = IdempotencyCache(limits.idempotency_ttl, limits.idempotency_entries)
    # Calls to a store in this process's memory or on local disk take tens of microseconds: they run on
    # the event loop, because handing each to a worker thread costs more CPU than the call itself. A
    # networked store (PostgreSQL) waits on its server, so its calls go to worker threads. Long polls
    # always do (they wait by design).
    inline = limits.inline_calls
    if inline is None:
        inline = isinstance(store, (InMemoryLightningStore, SqliteLightningStore))
    # A networked store with coroutines for the calls of a rollout cycle waits for its database on the event
    # loop: no thread hop for those (see AsyncRolloutCalls); its other calls still go to worker threads.
    native = store if isinstance(store, AsyncRolloutCalls) and limits.async_calls and not inline else None
    pollers: Dict[str, anyio.CapacityLimiter] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = limits.max_workers
        pollers["limiter"] = anyio.CapacityLimiter(limits.max_pollers)
        # Runners could not send heartbeats while this server was down: without this, a restart after more
        # than the heartbeat timeout would end all their attempts as unresponsive at once.
        renewed = await anyio.to_thread.run_sync(store.renew_heartbeats)
        if renewed:
            logger.info("renewed the heartbeat deadline of %d running attempt(s) for their runners to reconnect", renewed)
        stop = threading.Event()
        reaper = threading.Thread(target=_reap_forever, args=(store, stop, limits.reap_interval), daemon=True)
        reaper.start()
        try:
            yield
        finally:
            stop.set()

    def idempotency_key(request: Request) -> Optional[Tuple[str, ...]]:
        """(the token's name, the path, the Idempotency-Key header): a retry of the same request by the same
        client, if the request has the header."""
        key = request.headers.get(IDEMPOTENCY_HEADER)
        return (request.scope["state"][CLIENT_STATE], request.url.path, key[:128]) if key else None

    def once(request: Request, call: Callable[[], Response]) -> Response:
        """Run ``call``; with an Idempotency-Key, a repeat of the same request gets the first answer."""
        key = idempotency_key(request)
        return call() if key is None else cache.run(key, call)

    async def once_async(request: Request, call: Callable[[], Awaitable[Response]]) -> Response:
        key = idempotency_key(request)
        return await call() if key is None else await cache.run_async(key, call)

    async def long_poll(request: Request, wait: Callable[[threading.Event], Response]) -> Response:
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
            return await anyio.to_thread.run_sync(wait, gone, limiter=pollers["limiter"])
        finally:
            watcher.cancel()

    def sliced(timeout: float, gone: threading.Event, step: Callable[[float], Any]) -> Any:
        """Call ``step(wait)`` in slices until it returns something or the time is up; None once the client left.

        ``gone`` is checked before each slice and, by a store that waits in ``wait_until`` (SQLite,
        PostgreSQL), before each claim within a slice: work that arrives after the disconnect is not claimed
        for a client that will never get it. A slice bounds how long the thread stays after that.
        """
        deadline = time.monotonic() + min(timeout, limits.max_poll_seconds)
        with give_up_when(gone):
            while not gone.is_set():
                left = max(0.0, deadline - time.monotonic())
                result = step(min(left, limits.poll_slice_seconds))
                if result or left <= limits.poll_slice_seconds:
                    return result
        return None

    app = FastAPI(
        title="agl store server",
        version="1",
        description=(
            "The LightningStore over HTTP: trainers and runners on different machines meet here. Every "
            "endpoint but /healthz and this description needs `Authorization: Bearer <token>`. Errors are JSON "
            "`{error, message, ...ids}` where `error` names the exception the Python client raises. "
            "POST endpoints honour an `Idempotency-Key` header (a retry gets the first answer). "
            "OpenTelemetry exporters send spans to /v1/traces (OTLP/HTTP, JSON or protobuf)."
        ),
        lifespan=lifespan,
    )
    _install_error_handlers(app)
    app.add_middleware(DirectRoutes, fastapi_app=app, names=["dequeue", "complete", "complete_and_dequeue", "add_spans"])
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(TokenCheck, tokens=tokens, prefix="/v1/")  # added last: runs first, before bodies are read

    @app.get("/healthz", tags=["meta"], summary="liveness (no token needed)")
    async def healthz() -> Dict[str, str]:
        return {"status": "ok"}

    api = _Routes(app, "/v1", responses=_ERRORS)

    async def run(call: Callable[[], Response]) -> Response:
        """A store call that does not wait: inline for local stores, on a worker thread for networked ones."""
        return call() if inline else await anyio.to_thread.run_sync(call)

    # -- rollouts ---------------------------------------------------------------------------------------
    @api.post("/rollouts", response_model=RolloutList, tags=["rollouts"], summary="enqueue rollouts (FIFO)")
    async def enqueue(body: EnqueueBody, request: Request) -> Response:
        return await run(lambda: once(request, lambda: _rollouts(store.enqueue_many(body.requests))))

    @api.post("/rollouts/dequeue", body=DequeueBody, response_model=RolloutList, tags=["rollouts"], summary="claim work (long poll)")
    async def dequeue(request: Request) -> Response:
        body = await _parse(request, DequeueBody)

        def waited(gone: threading.Event) -> Response:
            step = lambda t: store.dequeue_many(body.runner_id, body.limit, timeout=t)  # noqa: E731
            claimed = sliced(body.timeout, gone, step) or []
            if claimed and gone.is_set():  # claimed as the client left (or by a store whose wait cannot give up)
                claimed = _give_back(store, claimed, body.runner_id)
            return _rollouts(claimed)

        if native is not None:
            async def claim_or_wait() -> Response:  # the claim on the loop; only an empty queue costs a thread
                claimed = await native.aclaim(body.runner_id, body.limit)
                if claimed or body.timeout <= 0:
                    return _rollouts(claimed)
                return await long_poll(request, waited)

            return await once_async(request, claim_or_wait)  # a retry waits for this answer
        key = idempotency_key(request)
        if inline and (key is None or not cache.seen(key)):  # a first try: claim without a thread if work is there
            claimed = store.dequeue_many(body.runner_id, body.limit, timeout=0)
            if claimed or body.timeout <= 0:
                response = _rollouts(claimed)
                return response if key is None else cache.record(key, response)
        return await long_poll(request, lambda gone: once(request, lambda: waited(gone)))

    @api.post("/rollouts/wait", response_model=RolloutList, tags=["rollouts"], summary="wait for rollouts to end (long poll)")
    async def wait_for_rollouts(body: WaitBody, request: Request) -> Response:
        ids = list(dict.fromkeys(body.rollout_ids))

        def wait(gone: threading.Event) -> Response:
            def step(t: float) -> Optional[List[Rollout]]:
                done = store.wait_for_rollouts(ids, timeout=t)
                return done if len(done) == len(ids) else None

            done = sliced(body.timeout, gone, step)
            return _rollouts(done if done is not None else store.wait_for_rollouts(ids, timeout=0))

        return await long_poll(request, wait)

    @api.post("/rollouts/query", response_model=RolloutList, tags=["rollouts"], summary="list rollouts, filtered")
    async def query_rollouts(body: QueryBody) -> Response:
        return await run(lambda: _rollouts(store.query_rollouts(**body.model_dump())))

    @api.post("/rollouts/reap", response_model=RolloutList, tags=["rollouts"], summary="end expired attempts now")
    async def reap() -> Response:
        return await run(lambda: _rollouts(store.reap_expired()))

    @api.post(
        "/attempts/renew-heartbeats",
        response_model=Renewed,
        tags=["rollouts"],
        summary="count every running attempt as having sent a heartbeat now",
    )
    async def renew_heartbeats() -> Response:
        return await run(lambda: _json(Renewed(renewed=store.renew_heartbeats())))

    @api.get("/rollouts/{rollout_id}", response_model=Rollout, tags=["rollouts"])
    async def get_rollout(rollout_id: str) -> Response:
        return await run(lambda: _json(store.get_rollout(rollout_id)))

    @api.post("/rollouts/{rollout_id}/cancel", response_model=Rollout, tags=["rollouts"])
    async def cancel(rollout_id: str) -> Response:
        return await run(lambda: _json(store.cancel_rollout(rollout_id)))

    @api.get("/rollouts/{rollout_id}/attempts", response_model=AttemptList, tags=["attempts"])
    async def query_attempts(rollout_id: str) -> Response:
        return await run(lambda: _json(AttemptList(attempts=store.query_attempts(rollout_id))))

    @api.post("/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat", response_model=Attempt, tags=["attempts"])
    async def heartbeat(rollout_id: str, attempt_id: str) -> Response:
        return await run(lambda: _json(store.heartbeat(rollout_id, attempt_id)))

    @api.post("/rollouts/{rollout_id}/attempts/{attempt_id}/complete", body=CompleteBody, response_model=Rollout, tags=["attempts"])
    async def complete(rollout_id: str, attempt_id: str, request: Request) -> Response:
        body = await _parse(request, CompleteBody)
        if native is not None:
            async def complete_here() -> Response:
                return _json(await native.acomplete_attempt(
                    rollout_id, attempt_id, body.status, reward=body.reward, error=body.error
                ))

            return await once_async(request, complete_here)
        call = lambda: _json(  # noqa: E731
            store.complete_attempt(rollout_id, attempt_id, body.status, reward=body.reward, error=body.error)
        )
        return await run(lambda: once(request, call))

    @api.post(
        "/rollouts/{rollout_id}/attempts/{attempt_id}/complete-and-dequeue",
        body=CompleteAndDequeueBody,
        response_model=CompletedAndClaimed,
        tags=["attempts"],
        summary="complete, then claim work without waiting (a runner's step to its next rollout)",
    )
    async def complete_and_dequeue(rollout_id: str, attempt_id: str, request: Request) -> Response:
        body = await _parse(request, CompleteAndDequeueBody)
        outcome = dict(reward=body.reward, error=body.error)
        if native is not None:
            async def here() -> Response:
                completed = await native.acomplete_attempt(rollout_id, attempt_id, body.status, **outcome)
                try:
                    claimed = await native.aclaim(body.runner_id, body.limit)
                except Exception as exc:  # noqa: BLE001 - as LightningStore.complete_and_dequeue: completion stands
                    logger.warning("claim after completing %s failed (the runner will dequeue again): %s", rollout_id, exc)
                    claimed = []
                return _json(CompletedAndClaimed(rollout=completed, claimed=claimed))

            return await once_async(request, here)

        def call() -> Response:
            completed, claimed = store.complete_and_dequeue(
                rollout_id, attempt_id, body.status, **outcome, runner_id=body.runner_id, limit=body.limit
            )
            return _json(CompletedAndClaimed(rollout=completed, claimed=claimed))

        return await run(lambda: once(request, call))

    # -- spans ------------------------------------------------------------------------------------------
    @api.post("/spans", body=SpansBody, response_model=Stored, tags=["spans"], summary="store spans (insert-only, idempotent)")
    async def add_spans(request: Request) -> Response:
        body = await _parse(request, SpansBody)
        if native is not None:
            async def add_here() -> Response:
                return _json(Stored(stored=await native.aadd_spans(body.spans)))

            return await once_async(request, add_here)
        return await run(lambda: once(request, lambda: _json(Stored(stored=store.add_spans(body.spans)))))

    @api.post(
        "/spans/delete",
        body=DeleteSpansBody,
        response_model=Deleted,
        tags=["spans"],
        summary="delete the spans of finished rollouts (the rollouts stay)",
    )
    async def delete_spans(request: Request) -> Response:
        body = await _parse(request, DeleteSpansBody)
        return await run(lambda: once(request, lambda: _json(Deleted(deleted=store.delete_spans(body.rollout_ids)))))

    @api.get("/rollouts/{rollout_id}/spans", response_model=SpanList, tags=["spans"])
    async def query_spans(
        rollout_id: str,
        attempt_id: str = Query("latest", description="an attempt id, 'latest' or 'all'"),
    ) -> Response:
        which = None if attempt_id == "all" else attempt_id
        return await run(lambda: _json(SpanList(spans=store.query_spans(rollout_id, which))))

    @api.post(
        "/traces",
        tags=["spans"],
        summary="OTLP/HTTP trace export (JSON or protobuf)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    otlp.JSON: {"schema": {"$ref": "#/components/schemas/ExportTraceServiceRequest"}},
                    otlp.PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                },
            }
        },
    )
    async def otlp_traces(request: Request) -> Response:
        body = await request.body()
        media = request.headers.get("content-type", otlp.JSON)
        answer_media = otlp.PROTOBUF if media.split(";")[0].strip().lower() == otlp.PROTOBUF else otlp.JSON
        try:
            export = otlp.decode_export(body, media, request.headers.get("content-encoding", ""), limits.max_body_bytes)
            spans, refusals = otlp.to_spans(export)
            stored, refused_by_store = 0, []
            if spans:
                stored, refused_by_store = await run(lambda: _add_otlp_spans(store, spans, refusals))  # type: ignore[arg-type,return-value]
        except LookupError as exc:
            if isinstance(exc, KeyError):  # Unknown*Error: an id that is not in the store
                return _otlp_error(answer_media, 404, exc)
            return _otlp_error(answer_media, 415, exc)
        except otlp.BodyTooLarge as exc:  # a gzip body that inflates past the limit: as a large body
            return _otlp_error(answer_media, 413, exc)
        except otlp.OtlpError as exc:  # bad data: 400, which OTLP exporters do not retry
            return _otlp_error(answer_media, 400, exc)
        except (AglError, ValueError, TypeError, OverflowError) as exc:
            return _otlp_error(answer_media, error_status(exc) or 400, exc)
        otlp_refusals.log(refusals)
        if refused_by_store and not stored:  # nothing stored, and the store refused ids: the error, as before
            status, _ = refused_by_store[0]
            return _otlp_error(answer_media, status, _OtlpRefused(refusals.message(), refused_by_store[0][1]))
        return Response(otlp.export_response(answer_media, refusals.rejected, refusals.message()), media_type=answer_media)

    # -- resources and stats -----------------------------------------------------------------------------
    @api.post("/resources", response_model=ResourcesUpdate, tags=["resources"], summary="add a resources version")
    async def add_resources(body: ResourcesBody, request: Request) -> Response:
        call = lambda: _json(store.add_resources(body.resources, body.resources_id))  # type: ignore[arg-type]  # noqa: E731
        return await run(lambda: once(request, call))

    @api.get("/resources", response_model=MaybeResources, tags=["resources"], summary="a resources version, or the latest")
    async def get_resources(resources_id: Optional[str] = Query(None, description="omit for the latest")) -> Response:
        if native is not None:
            return _json(MaybeResources(update=await native.aget_resources(resources_id)))
        return await run(lambda: _json(MaybeResources(update=store.get_resources(resources_id))))

    @api.get("/stats", response_model=StoreStats, tags=["meta"])
    async def stats() -> Response:
        return await run(lambda: _json(store.stats()))

    otlp_refusals = _RefusalLog()
    _document_models(app, api.bodies + [otlp.ExportTraceServiceRequest])
    return app


Body = TypeVar("Body", bound=BaseModel)


async def _parse(request: Request, model: Type[Body]) -> Body:
    """The request's JSON body as ``model``, parsed from the raw bytes in one step by pydantic's JSON parser.

    Why not a FastAPI body parameter: FastAPI decodes with ``json.loads`` and then validates the objects, ~15 µs
    more per small request (dequeue, complete: ``benchmarks/server_overhead.py``) and ~3x the cost for a batch
    of 1,000 spans. Errors are the same 422 that FastAPI gives, naming the field.
    """
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


class _Routes:
    """``@api.get`` / ``@api.post`` for endpoints under ``prefix`` that share documented responses, registered
    on the app itself.

    Why not an ``APIRouter`` and ``include_router``: FastAPI (0.16x) matches the routes of an included router
    through an extra layer on every request, ~55 of the ~170 microseconds of server CPU a light request
    costs (measured with ``GET /v1/resources``); routes of the app are matched directly.
    """

    def __init__(self, app: FastAPI, prefix: str, *, responses: Dict[Any, Any]) -> None:
        self._app = app
        self._prefix = prefix
        self._common: Dict[str, Any] = {"responses": responses}
        self.bodies: List[Type[BaseModel]] = []  # models of bodies the endpoints parse themselves (:func:`_parse`)

    def get(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self._app.get(self._prefix + path, **self._common, **kwargs)

    def post(self, path: str, *, body: Optional[Type[BaseModel]] = None, **kwargs: Any) -> Callable[[Any], Any]:
        """``body``: the model of a JSON body the endpoint parses with :func:`_parse`, for the OpenAPI document."""
        if body is not None:
            self.bodies.append(body)
            schema = {"$ref": f"#/components/schemas/{body.__name__}"}
            kwargs["openapi_extra"] = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
        return self._app.post(self._prefix + path, **self._common, **kwargs)


def _document_models(app: FastAPI, models: List[Type[BaseModel]]) -> None:
    """Add the models of bodies that endpoints parse themselves to the OpenAPI components (FastAPI documents
    only the bodies it parses); a model FastAPI already documents keeps FastAPI's schema."""
    generate = app.openapi

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in found.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components.setdefault(model.__name__, found)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class _AuthFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_SPAN_REFUSALS = (AglError, ValueError, TypeError, OverflowError)  # what add_spans raises on purpose


def _add_otlp_spans(store: LightningStore, spans: List[Any], refusals: otlp.Refusals) -> Tuple[int, List[Tuple[int, BaseException]]]:
    """Store an OTLP export's spans: in one call, or, when the store refuses the batch (an unknown rollout or
    attempt, a span it cannot store), one call per (rollout, attempt), so that one bad id does not drop the
    other rollouts' spans. Refused groups are added to ``refusals``. Returns (spans stored or already there,
    [(status, error)] of the refused groups); a 5xx error (the store is closed) is raised."""
    groups: Dict[Tuple[str, str], List[Any]] = {}
    for span in spans:
        groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
    failures: Dict[Tuple[str, str], BaseException] = {}
    try:
        store.add_spans(spans)
    except _SPAN_REFUSALS as exc:
        if (error_status(exc) or 400) >= 500:
            raise
        if len(groups) == 1:
            failures[next(iter(groups))] = exc
        else:
            for key, group in groups.items():
                try:
                    store.add_spans(group)
                except _SPAN_REFUSALS as group_exc:
                    if (error_status(group_exc) or 400) >= 500:
                        raise
                    failures[key] = group_exc
    stored, refused = 0, []
    for key, group in groups.items():
        failure = failures.get(key)
        if failure is None:
            stored += len(group)
            continue
        hint = (f" (set {semconv.OTLP_ROLLOUT_ID} and {semconv.OTLP_ATTEMPT_ID} to the ids of a rollout the "
                "runner is running: rollout.rollout_id, rollout.attempt.attempt_id)") if isinstance(failure, KeyError) else ""
        refusals.refuse(f"{failure}{hint}", key[0], len(group))
        refused.append((error_status(failure) or 400, failure))
    return stored, refused


class _OtlpRefused(Exception):
    """An OTLP export of which nothing was stored: the whole refusal message, answered with the status (and, for
    JSON clients, the error name and ids) of the store's first refusal."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


class _RefusalLog:
    """Server-side warnings for spans /v1/traces refused or stored with a note (OpenTelemetry exporters do not
    show the partial-success message, so the server's log is where an operator sees it). Bounded: each (reason,
    rollout id) is logged the first time, then again with its running count at 10, 100, 1000, ... spans; at
    most ``per_minute`` lines a minute, then one line counting what was left out."""

    def __init__(self, per_minute: int = 30, max_keys: int = 10_000) -> None:
        self._counts: Dict[Tuple[str, str, bool], int] = {}
        self._per_minute = per_minute
        self._max_keys = max_keys
        self._window = 0.0
        self._lines = 0
        self._left_out = 0
        self._lock = threading.Lock()

    def log(self, refusals: otlp.Refusals) -> None:
        if not refusals:
            return
        for reason, rollout_id, refused, n in refusals.entries():
            with self._lock:
                key = (reason, rollout_id, refused)
                before = self._counts.get(key, 0)
                if len(self._counts) >= self._max_keys and key not in self._counts:
                    self._counts.clear()
                after = self._counts[key] = before + n
                if before and len(str(after)) == len(str(before)):  # log again only at 10, 100, 1000, ...
                    continue
                now = time.monotonic()
                if now - self._window >= 60.0:
                    if self._left_out:
                        logger.warning("OTLP /v1/traces: %d more refusal warning(s) left out in the last minute",
                                       self._left_out)
                    self._window, self._lines, self._left_out = now, 0, 0
                if self._lines >= self._per_minute:
                    self._left_out += 1
                    continue
                self._lines += 1
            where = f" for rollout {rollout_id}" if rollout_id else ""
            what = "refused" if refused else "stored with a note"
            total = "" if not before else f" ({after} so far)"
            logger.warning("OTLP /v1/traces: %d span(s)%s %s%s: %s", n, where, what, total, reason)


def _otlp_error(media: str, status: int, exc: BaseException) -> Response:
    """An OTLP failure: a google.rpc.Status for protobuf clients, agl's error body for JSON ones."""
    if media == otlp.PROTOBUF:
        grpc_code = {404: 5, 415: 3}.get(status, 3)  # NOT_FOUND, INVALID_ARGUMENT
        return Response(otlp.status_response(grpc_code, str(exc)), status_code=status, media_type=media)
    if isinstance(exc, _OtlpRefused):  # the store's error (name, ids) with the whole export's message
        body = error_body(exc.cause).model_copy(update={"message": str(exc)})
        return Response(body.model_dump_json(exclude_none=True), status_code=status, media_type=otlp.JSON)
    name = type(exc).__name__ if error_status(exc) else "StoreRequestError"
    body = error_body(exc).model_copy(update={"error": name})
    return Response(body.model_dump_json(exclude_none=True), status_code=status, media_type=otlp.JSON)


def _give_back(store: LightningStore, claimed: List[Rollout], runner_id: str) -> List[Rollout]:
    """End the attempts of rollouts claimed for a poll whose client has disconnected (the answer cannot reach it),
    as the reaper would after the heartbeat timeout, but now: the rollouts are retried while attempts are left.
    Returns no rollouts: the answer a retry of the same request (Idempotency-Key) gets, so nobody runs them."""
    error = (f"runner {runner_id!r} disconnected before the store server could hand it this rollout "
             "(the runner left): attempt ended by the server")
    for rollout in claimed:
        if rollout.attempt is None:  # a dequeued rollout always has one
            continue
        try:
            after = store.complete_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "unresponsive", error=error)
        except Exception as exc:  # noqa: BLE001 - the reaper ends it after the heartbeat timeout instead
            logger.warning("rollout %s claimed for runner %s, which left: could not end the attempt: %s",
                           rollout.rollout_id, runner_id, exc)
            continue
        logger.info("rollout %s claimed for runner %s, which left: attempt ended, rollout is now %s",
                    rollout.rollout_id, runner_id, after.status)
    return []


def _reap_forever(store: LightningStore, stop: threading.Event, interval: float) -> None:
    """End attempts past their deadline even when nobody calls the store (every runner is dead)."""
    while not stop.wait(interval):
        try:
            changed = store.reap_expired()
        except Exception as exc:  # noqa: BLE001 - a failing store must not kill the timer
            logger.warning("reap_expired failed: %s", exc)
            continue
        for rollout in changed:
            logger.info("rollout %s: attempt expired, rollout is now %s", rollout.rollout_id, rollout.status)


# -- running it -----------------------------------------------------------------------------------------


class ServerThread(ThreadedServer):
    """The store server for ``app`` on a background thread (tests, benchmarks, notebooks).

    ``port=0`` picks a free port; ``url`` tells which once started. ``stop()`` shuts it down gracefully.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(app, name="agl-store-server", host=host, port=port, lifespan="on")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve(
    store: LightningStore,
    host: str = "127.0.0.1",
    port: int = 4747,
    *,
    tokens: Optional[TokenSet] = None,
    allow_anonymous: bool = False,
    limits: Optional[ServerLimits] = None,
    log_level: str = "info",
) -> None:
    """Serve ``store`` until SIGINT/SIGTERM (uvicorn stops gracefully on both), then close it and return.

    uvicorn raises the signal again once it has shut down, so that the process dies of it: ``store.close()``
    then never ran, and a clean stop exited 143, which process managers report as a failure. A handler of
    our own is what uvicorn restores before raising it: the signal then does nothing more, and this returns."""
    import uvicorn

    app = create_app(store, tokens=tokens, allow_anonymous=allow_anonymous, limits=limits)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # no access log: a line per request costs more than some requests (errors are still logged)
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
