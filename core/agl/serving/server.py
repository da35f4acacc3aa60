"""``PolicyServer``: the current policy behind an OpenAI-compatible HTTP API, with exact token ids.

Agents reach the model by ``base_url`` only, like any OpenAI endpoint; every answer also carries the
prompt and response token ids the trainer needs and the policy version that produced it (see
:mod:`agl.serving.openai_api`). The server runs uvicorn on a daemon thread of the calling process, so an
in-process trainer can share the model object: it steps the optimizer inside ``with server.paused():``
and then calls ``server.set_version(n)``. A server in another process (``agl serve``) gets new weights with
:meth:`PolicyServer.load_weights`.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/responses`` (plain and streamed; see
:mod:`agl.serving.responses_api`), ``GET /v1/models``, ``GET /health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agl.http_thread import ThreadedServer
from agl.serving.chat_format import BadRequest, parse_output, render_prompt, streamable_prefix
from agl.serving.engine import EngineStats, Failed, Finished, GenerationEngine, Started, Step, Token
from agl.serving.openai_api import (
    VERSION_FIELD,
    VERSION_HEADER,
    ChatRequest,
    ResponseWriter,
    error_body,
    parse_request,
)
from agl.serving.responses_api import AnswerWriter, ResponsesWriter, in_responses_terms, to_chat_body
from agl.serving.weights import WeightLoader, WeightsSource

logger = logging.getLogger(__name__)



class PolicyServer:
    """Serves ``model`` (a transformers causal LM) under ``model_name`` on ``host:port`` (0: a free port).

    ``max_batch_size``: most requests generated together. ``version``: the policy version reported until
    :meth:`set_version` / :meth:`load_weights` change it. ``default_max_tokens``: the answer length limit for
    requests that set none (the model's context caps it too). ``batch_wait_s``: how long an idle server
    waits after a request for others to batch with it.

    Requests may name any ``model``: the server has one policy, and a trainer may publish a checkpoint path
    as the model name (docs/serving.md); responses carry ``model_name``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 16,
        version: int = 0,
        *,
        default_max_tokens: int = 512,
        batch_wait_s: float = 0.005,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host = host
        self.port = port
        self.default_max_tokens = default_max_tokens
        self.engine = GenerationEngine(
            model, tokenizer, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, version=version
        )
        self.app = _create_app(self)
        self._weights: Optional[WeightLoader] = None
        self._http = ThreadedServer(self.app, name="agl-policy-server", host=host, port=port)
        self._stopped = False

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving; returns the ``base_url`` (``http://HOST:PORT/v1``) once connections are accepted."""
        if self._http.running or self._stopped:
            raise RuntimeError("a PolicyServer starts once: create a new one to serve again")
        self._http.start()
        logger.info("policy server %r (version %d) listening on %s", self.model_name, self.version, self.base_url)
        return self.base_url

    def stop(self) -> None:
        """Stop serving and the generation worker; queued requests fail with a clear error."""
        self._stopped = True
        self.engine.close()  # running requests fail now instead of holding uvicorn's shutdown
        self._http.stop()

    def __enter__(self) -> "PolicyServer":
        self.start()
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        if self._http.port is None:
            raise RuntimeError("the PolicyServer is not running: call start() first")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self._http.port}/v1"

    # --- policy versions -------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version new requests are answered with."""
        return self.engine.version

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def paused(self) -> "contextlib.AbstractContextManager[None]":
        """Inside the block no request runs: new ones wait, the running batch has drained on entry."""
        return self.engine.paused()

    def set_version(self, version: int) -> None:
        """The shared model was updated in place: answer from now on as ``version``."""
        self.engine.set_version(version)
        logger.info("policy server now serves version %d", version)

    def load_weights(self, source: WeightsSource, version: int) -> None:
        """Pause, copy the weights in (see :mod:`agl.serving.weights`), resume as ``version``.

        Bad weights raise :class:`~agl.serving.weights.WeightsError` and the served model and version stay
        as they were.
        """
        started = time.monotonic()
        with self.paused():
            if self._weights is None:
                self._weights = WeightLoader(self.model)
            count = self._weights.load(source)
            self.engine.set_version(version)
        where = "a state dict" if isinstance(source, dict) else str(source)
        elapsed = time.monotonic() - started
        logger.info("loaded %d tensors from %s in %.1f s; serving version %d", count, where, elapsed, version)

    # --- requests --------------------------------------------------------------------------------------------

    def _prepare(self, body: Any) -> tuple[ChatRequest, List[int], Any]:
        """Check and render a request: ``(request, prompt ids, sampling params)``. Raises BadRequest."""
        request = parse_request(body)
        prompt = render_prompt(self.tokenizer, request.messages, request.tools if request.tools_offered else None)
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        context = self.engine.max_context
        room = context - len(prompt_ids) if context else None
        if room is not None and room < 1:
            raise BadRequest(
                f"the prompt is {len(prompt_ids)} tokens, the model's context is {context}: shorten the conversation",
                "messages",
            )
        max_tokens = request.max_tokens or min(self.default_max_tokens, room or self.default_max_tokens)
        if room is not None and max_tokens > room:
            raise BadRequest(
                f"max_tokens {max_tokens} plus the {len(prompt_ids)}-token prompt exceeds the model's context of "
                f"{context} tokens: ask for at most {room}",
                "max_tokens",
            )
        params = request.sampling(max_tokens)
        if params.grammar is not None:
            self.engine.grammars.check(params.grammar)
        return request, prompt_ids, params


def _create_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="agl policy server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def _health() -> Response:
        engine = server.engine
        payload = {"status": "ok", "model": server.model_name, VERSION_FIELD: engine.version, "waiting": engine.waiting}
        return _versioned(payload, engine.version)

    @app.get("/v1/models")
    async def _models() -> Response:
        model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "agl"}
        version = server.engine.version
        return _versioned({"object": "list", "data": [model], VERSION_FIELD: version}, version)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await _generate(server, request, responses_api=False)

    @app.post("/v1/responses")
    async def _responses(request: Request) -> Response:
        return await _generate(server, request, responses_api=True)

    return app


async def _generate(server: PolicyServer, http_request: Request, responses_api: bool) -> Response:
    """One request of either API: both are checked, rendered and generated as the chat request they mean."""
    version = server.engine.version
    try:
        body = await http_request.json()
    except ValueError:
        return _error(400, "the request body is not valid JSON", None, version)
    chat_body = None
    try:
        chat_body = to_chat_body(body) if responses_api else body
        request, prompt_ids, params = server._prepare(chat_body)
    except BadRequest as exc:
        if responses_api and chat_body is not None:
            exc = in_responses_terms(exc)  # a chat-path check failed on what the Responses request meant
        return _error(400, str(exc), exc.param, version)
    loop = asyncio.get_running_loop()
    events: "asyncio.Queue[Any]" = asyncio.Queue()
    try:
        handle = server.engine.submit(
            prompt_ids, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        )
    except RuntimeError as exc:
        return _error(503, f"{exc}; retry against a running server", None, version)
    finished = False
    try:
        first = await events.get()
        if isinstance(first, Failed):
            finished = True
            return _error(500, f"generation failed: {first.error}", None, version)
        assert isinstance(first, Started)
        writer: AnswerWriter
        if responses_api:
            writer = ResponsesWriter(body, server.model_name, server.tokenizer, first.version, request.logprobs)
        else:
            writer = ResponseWriter(request, server.model_name, server.tokenizer, first.version)
        headers = {VERSION_HEADER: str(first.version)}
        if request.stream:
            finished = True  # the stream owns the request from here
            stream = _stream(events, handle, writer, request, prompt_ids)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        while True:
            event = await events.get()
            if isinstance(event, Finished):
                finished = True
                gen = event.generation
                parsed = parse_output(gen.text, request.tools_offered)
                return _versioned(writer.final(gen, parsed), first.version)
            if isinstance(event, Failed):
                finished = True
                return _error(500, f"generation failed: {event.error}", None, first.version)
    finally:
        if not finished:
            handle.cancel()  # the client went away: stop generating for it


async def _stream(
    events: "asyncio.Queue[Any]", handle: Any, writer: AnswerWriter, request: ChatRequest, prompt_ids: List[int]
) -> AsyncIterator[str]:
    """SSE as tokens arrive, for either API's writer; text is sent only once it can no longer turn into a
    tool call (``streamable_prefix``), the rest with the parsed output at the end."""
    finished = False
    try:
        for line in writer.stream_start(prompt_ids):
            yield line
        sent = ""
        pending: List[Token] = []
        while True:
            event = await events.get()
            if isinstance(event, Step):
                pending.append(event.token)
                safe = streamable_prefix(event.text, request.tools_offered, request.stop)
                if len(safe) > len(sent):
                    for line in writer.stream_text(safe[len(sent) :], pending, first=not sent):
                        yield line
                    sent, pending = safe, []
            elif isinstance(event, Finished):
                finished = True
                gen = event.generation
                for line in writer.stream_finish(gen, parse_output(gen.text, request.tools_offered), sent, pending):
                    yield line
                return
            elif isinstance(event, Failed):
                finished = True
                yield writer.stream_error(error_body(f"generation failed: {event.error}", 500))
                return
    finally:
        if not finished:
            handle.cancel()


def _versioned(payload: Dict[str, Any], version: int, status: int = 200) -> JSONResponse:
    """Every response says which policy version it comes from, in a header too."""
    return JSONResponse(payload, status_code=status, headers={VERSION_HEADER: str(version)})


def _error(status: int, message: str, param: Optional[str], version: int) -> JSONResponse:
    return _versioned(error_body(message, status, param), version, status)
