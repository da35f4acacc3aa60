"""A real OpenAI-compatible HTTP server on 127.0.0.1 whose model is scripted.

Tests, examples and ``agl dev`` run real agent frameworks with the real ``openai`` client against it, so
everything between the agent and the model (clients, retries, streaming, tool-call parsing, agl's
instrumentation) is exercised for real while the answers stay deterministic. The model side lives in
:mod:`agl.testing.fake_policy`; :mod:`~agl.testing.fake_chat` and :mod:`~agl.testing.fake_responses`
serialize it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from agl._util.http_thread import ThreadedServer
from agl.openai_wire.apis import (
    API_PATHS,
    CHAT,
    COMPLETIONS,
    NOT_AN_OBJECT,
    RESPONSES,
    TOKEN_IDS_REQUEST,
    BadRequest,
    error_body,
)
from agl.testing import fake_chat, fake_completions, fake_responses
from agl.testing.fake_policy import ChatTool, FakeReply, FakeTokenizer, Generation, ToolChoice, generate

logger = logging.getLogger(__name__)

Body = Mapping[str, Any]
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class FakeOpenAIServer:
    """Serves ``/v1/models``, ``/v1/chat/completions``, ``/v1/responses`` and the legacy ``/v1/completions``
    from a daemon thread.

    Generation requests take replies from :meth:`script` in order, from either endpoint; when the script
    is empty the default policy answers (see :func:`agl.testing.fake_policy.default_policy`). Token ids are
    returned when a request asks with ``"return_token_ids": true`` (vLLM's convention) or always when
    ``always_token_ids`` is set, to stand in for an agl-managed vLLM server. With ``reject_token_ids`` it
    stands in for api.openai.com instead, which answers a request carrying ``return_token_ids`` with the
    400 it gives any unknown parameter.
    """

    def __init__(self, always_token_ids: bool = False, reject_token_ids: bool = False) -> None:
        self.always_token_ids = always_token_ids
        self.reject_token_ids = reject_token_ids
        self.tokenizer = FakeTokenizer()
        self._lock = threading.Lock()
        self._script: collections.deque[FakeReply] = collections.deque()
        self._requests: list[dict[str, Any]] = []
        self.app = _create_app(self)
        self._http = ThreadedServer(self.app, name="agl-fake-openai", graceful_shutdown_s=1)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> FakeOpenAIServer:
        """Start serving on a free port and return once the server accepts connections."""
        self._http.start()
        logger.debug("fake OpenAI server listening on %s", self.base_url)
        return self

    def stop(self) -> None:
        """Stop serving and wait for the thread (streams still open get a second to finish)."""
        self._http.stop()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- what tests use ----------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``, the ``base_url`` to give OpenAI clients."""
        if self._http.port is None:
            raise RuntimeError("FakeOpenAIServer is not running: use it as a context manager or call start()")
        return f"http://127.0.0.1:{self._http.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A copy of the request log: ``{"path", "body", "headers"}`` per request, in arrival order."""
        with self._lock:
            return list(self._requests)

    def script(self, *replies: FakeReply) -> None:
        """Queue replies for the next generation requests, after any still queued."""
        with self._lock:
            self._script.extend(replies)

    def reset(self) -> None:
        """Forget queued replies and logged requests, so each test starts clean on a shared server."""
        with self._lock:
            self._script.clear()
            self._requests.clear()

    def _record(self, request: Request, body: Any) -> None:
        entry = {"path": request.url.path, "body": body, "headers": dict(request.headers)}
        with self._lock:
            self._requests.append(entry)

    def _next_reply(self) -> FakeReply | None:
        with self._lock:
            return self._script.popleft() if self._script else None


class _DeliberateStreamBreak(Exception):
    """Raised inside a streaming body to make uvicorn drop the connection, as ``break_stream_after`` asks."""


class _QuietStreamBreaks(logging.Filter):
    """Keeps uvicorn from logging our deliberate stream breaks as application errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _DeliberateStreamBreak))


logging.getLogger("uvicorn.error").addFilter(_QuietStreamBreaks())


def _create_app(server: FakeOpenAIServer) -> FastAPI:
    app = FastAPI(title="agl fake OpenAI", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/v1/models")
    async def _models(request: Request) -> dict[str, Any]:
        server._record(request, None)
        model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "agl"}
        return {"object": "list", "data": [model]}

    for path, api in API_PATHS.items():
        app.post(f"/v1/{path}")(_endpoint(server, _WIRE_APIS[api]))
    return app


def _endpoint(server: FakeOpenAIServer, api: _WireApi) -> Callable[[Request], Any]:
    async def generate(request: Request) -> Response:
        return await _generate(server, request, api)

    return generate


Conversation = tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]


def _chat_answer(
    reply: FakeReply | None, conversation: Conversation, body: Body, tokenizer: FakeTokenizer
) -> Generation:
    """Chat and Responses: the conversation through the chat template, answered by the script or the policy."""
    return generate(reply, *conversation, tokenizer)


@dataclass(frozen=True)
class _WireApi:
    """How one OpenAI API reads a request and writes a generation; the rest of serving is shared."""

    missing_field: Callable[[Body], str | None]
    conversation: Callable[[Body], Conversation]
    as_json: Callable[[Generation, Body, bool], dict[str, Any]]
    as_sse: Callable[[Generation, Body, bool], Iterator[str]]
    answer: Callable[[FakeReply | None, Conversation, Body, FakeTokenizer], Generation] = _chat_answer


_CHAT = _WireApi(fake_chat.missing_field, fake_chat.conversation, fake_chat.completion, fake_chat.sse_events)
_RESPONSES = _WireApi(
    fake_responses.missing_field,
    fake_responses.conversation,
    fake_responses.response,
    fake_responses.sse_events,
)
_COMPLETIONS = _WireApi(
    fake_completions.missing_field,
    fake_completions.conversation,
    fake_completions.completion,
    fake_completions.sse_events,
    fake_completions.answer,
)
_WIRE_APIS = {CHAT: _CHAT, RESPONSES: _RESPONSES, COMPLETIONS: _COMPLETIONS}


async def _generate(server: FakeOpenAIServer, request: Request, api: _WireApi) -> Response:
    """Log the request, take the next scripted reply, then answer with an error, JSON or SSE."""
    try:
        body = await request.json()
    except ValueError:
        body = None
    server._record(request, body)
    if not isinstance(body, dict):
        return error_response(400, NOT_AN_OBJECT)
    missing = api.missing_field(body)
    if missing:
        return error_response(400, f"missing required parameter: '{missing}'")
    if server.reject_token_ids and TOKEN_IDS_REQUEST in body:  # api.openai.com's words
        if api is _RESPONSES:
            return error_response(
                400, f"Unknown parameter: '{TOKEN_IDS_REQUEST}'.", TOKEN_IDS_REQUEST, "unknown_parameter"
            )
        return error_response(400, f"Unrecognized request argument supplied: {TOKEN_IDS_REQUEST}", code=None)
    try:
        conversation = api.conversation(body)
    except BadRequest as exc:  # e.g. a Responses input item type agl does not map; no scripted reply is used
        return error_response(400, str(exc))
    reply = server._next_reply()
    if reply is not None and reply.delay:
        await asyncio.sleep(reply.delay)
    if reply is not None and reply.is_error:
        return error_response(reply.status_code, reply.error_message or f"fake error {reply.status_code}")
    gen = api.answer(reply, conversation, body, server.tokenizer)
    token_ids = server.always_token_ids or bool(body.get(TOKEN_IDS_REQUEST))
    if body.get("stream"):
        break_after = reply.break_stream_after if reply is not None else None
        events = _stream(api.as_sse(gen, body, token_ids), break_after)
        return StreamingResponse(events, media_type="text/event-stream")
    return JSONResponse(api.as_json(gen, body, token_ids))


async def _stream(events: Iterator[str], break_after: int | None) -> AsyncIterator[str]:
    for count, event in enumerate(events):
        if break_after is not None and count >= break_after:
            raise _DeliberateStreamBreak(f"stream broken after {break_after} events, as scripted")
        yield event


def error_response(status_code: int, message: str, param: str | None = None, code: Any = "") -> JSONResponse:
    """An OpenAI-style error, which the ``openai`` client turns into the matching ``APIStatusError``
    (``code``: default the error type)."""
    error_type = _ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = error_body(message, status_code, param, error_type if code == "" else code, error_type)
    return JSONResponse(body, status_code=status_code)
