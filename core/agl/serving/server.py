"""``PolicyServer``: the current policy behind an OpenAI-compatible HTTP API, with exact token ids.

Agents reach the model by ``base_url`` only, like any OpenAI endpoint; every answer also carries the
prompt and response token ids the trainer needs and the policy version that produced it (see
:mod:`agl.serving.openai_api`). The server runs uvicorn on a daemon thread of the calling process, so an
in-process trainer can share the model object: it steps the optimizer inside ``with server.paused():``
and then calls ``server.set_version(n)``. A server in another process (``agl serve``) gets new weights with
:meth:`PolicyServer.load_weights`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/responses`` (see :mod:`agl.serving.responses_api`) and
the legacy ``POST /v1/completions`` for agents that send their own prompt text or token ids (see
:mod:`agl.serving.completions_api`), each plain and streamed; ``GET /v1/models``, ``GET /health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from types import TracebackType
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl._util.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from agl._util.http_thread import ThreadedServer
from agl.openai_wire.apis import (
    API_PATHS,
    CHAT,
    COMPLETIONS,
    CONTEXT_LENGTH_EXCEEDED,
    RESPONSES,
    TOO_DEEP,
    BadRequest,
    require_shallow,
)
from agl.openai_wire.chat_format import ParsedOutput, parse_output, render_prompt, streamable_prefix
from agl.openai_wire.responses import in_responses_terms, to_chat_body
from agl.openai_wire.sampling import with_defaults
from agl.openai_wire.stops import streamable_text
from agl.serving.completions_api import (
    DEFAULT_MAX_TOKENS as COMPLETIONS_DEFAULT_MAX_TOKENS,
)
from agl.serving.completions_api import (
    CompletionRequest,
    CompletionWriter,
    parse_completion_request,
    prompt_token_ids,
)
from agl.serving.engine import (
    EngineStats,
    Failed,
    Finished,
    Generation,
    GenerationEngine,
    SamplingParams,
    ServerStopped,
    Started,
    Step,
    Token,
)
from agl.serving.openai_api import (
    VERSION_FIELD,
    VERSION_HEADER,
    ChatRequest,
    ResponseWriter,
    error_body,
    parse_request,
)
from agl.serving.responses_api import AnswerWriter, ResponsesWriter
from agl.serving.structured import response_grammar
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
        # Sampling settings for requests that leave them out: a trainer sets its published ones here, so an
        # agent that does not pass llm.sampling_parameters on is still sampled as the trainer computes.
        self.request_defaults: Dict[str, Any] = {}
        self.engine = GenerationEngine(
            model, tokenizer, max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, version=version
        )
        self._vocab_size = _prompt_vocabulary(model, tokenizer)
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

    def __enter__(self) -> PolicyServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.stop()

    @property
    def bound_port(self) -> int:
        """The port it listens on (``port=0`` picks a free one at ``start()``)."""
        if self._http.port is None:
            raise RuntimeError("the PolicyServer is not running: call start() first")
        return self._http.port

    @property
    def base_url(self) -> str:
        """The URL for clients on this machine (a wildcard bind is reached at 127.0.0.1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.bound_port}/v1"

    # --- policy versions -------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The version new requests are answered with."""
        return self.engine.version

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def paused(self) -> contextlib.AbstractContextManager[None]:
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

    def _prepare(self, body: Any) -> tuple[ChatRequest, List[int], SamplingParams]:
        """Check and render a chat request: ``(request, prompt ids, sampling params)``. Raises BadRequest."""
        request = parse_request(self._with_defaults(body, ("temperature", "top_p", "logprobs")))
        prompt = render_prompt(self.tokenizer, request.messages, request.tools if request.tools_offered else None)
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        default = self._default_max_tokens(self.default_max_tokens)
        limit = (
            "max_completion_tokens"
            if isinstance(body, dict) and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        max_tokens = self._max_tokens(prompt_ids, request.max_tokens, default, "messages", limit)
        params = request.sampling(max_tokens)
        if params.grammar is not None:
            self._check_grammar(request, params.grammar)
        return request, prompt_ids, params

    def _check_grammar(self, request: ChatRequest, grammar: str) -> None:
        """A 400 when the grammar cannot be enforced, naming what the client sent that breaks it: the tools'
        ``parameters`` and the answer's schema compile as one grammar, and a client that forced a tool call
        with a bad ``parameters`` sent no ``response_format`` at all."""
        grammars = self.engine.grammars
        try:
            grammars.check(grammar)
        except BadRequest:
            for index, tool in request.grammar_tools():
                grammars.check(response_grammar(None, [tool], calls_only=True), f"tools[{index}].function.parameters")  # type: ignore[arg-type]  # a tool always yields a grammar
            raise

    def _prepare_completion(self, body: Any) -> tuple[CompletionRequest, List[int], SamplingParams]:
        """Check a ``/v1/completions`` request: ``(request, prompt ids, sampling params)``. Raises BadRequest."""
        request = parse_completion_request(self._with_defaults(body, ("temperature", "top_p")))
        prompt_ids = prompt_token_ids(self.tokenizer, request.prompt, self._vocab_size)
        default = self._default_max_tokens(COMPLETIONS_DEFAULT_MAX_TOKENS)
        max_tokens = self._max_tokens(prompt_ids, request.chat.max_tokens, default, "prompt")
        return request, prompt_ids, request.chat.sampling(max_tokens)

    def _with_defaults(self, body: Any, keys: Sequence[str]) -> Any:
        """``body`` with :attr:`request_defaults` for those of ``keys`` it leaves out (a token limit of any
        name counts as given; the Completions API's ``logprobs`` is a number, so it gets none)."""
        if not self.request_defaults or not isinstance(body, dict):
            return body
        return with_defaults(body, self.request_defaults, keys)

    def _default_max_tokens(self, fallback: int) -> int:
        """The token limit of a request that sets none: :attr:`request_defaults`' ``max_tokens``, else
        ``fallback``. A default, not a limit the client asked for: like the server's own, the context caps
        it (a trainer's 512 must not turn a prompt that leaves room for 300 into a 400 naming a
        ``max_tokens`` the agent never sent)."""
        value = self.request_defaults.get("max_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else fallback

    def _max_tokens(
        self,
        prompt_ids: List[int],
        requested: Optional[int],
        default: int,
        prompt_param: str,
        limit: str = "max_tokens",
    ) -> int:
        """The answer's token limit: ``requested``, else ``default`` as far as the model's context leaves room.

        A prompt that fills the context gets a 400 naming ``prompt_param``; a requested limit beyond it one
        naming ``limit`` (what the client called it) and the most that fits. Both carry OpenAI's code
        (``CONTEXT_LENGTH_EXCEEDED``)
        and words that agent frameworks match to shorten a conversation that outgrew the model and retry:
        "maximum context length is" (CrewAI, LiteLLM) and "prompt is too long" (LangChain, whose check of the
        code reads only the message with openai 3's clients).
        """
        context = self.engine.max_context
        room = context - len(prompt_ids) if context else None
        if room is not None and room < 1:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens, but the prompt is too long: "
                f"{len(prompt_ids)} tokens; shorten it",
                prompt_param,
                CONTEXT_LENGTH_EXCEEDED,
            )
        max_tokens = requested or min(default, room or default)
        if room is not None and max_tokens > room:
            raise BadRequest(
                f"This model's maximum context length is {context} tokens, but the prompt is too long for "
                f"{limit} {max_tokens}: {len(prompt_ids)} + {max_tokens} tokens; ask for at most {room}",
                limit,
                CONTEXT_LENGTH_EXCEEDED,
            )
        return max_tokens


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

    for path, api in API_PATHS.items():
        app.post(f"/v1/{path}")(_endpoint(server, _JOBS[api]))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Unknown routes and methods (an agent calling embeddings, a GET on chat/completions) in OpenAI's error
        # shape, logged like every refusal: FastAPI's {"detail": ...} left the openai client saying only
        # "Error code: 404".
        what = "route" if exc.status_code == 404 else "method"
        message = (
            f"agl's policy server has no {request.method} {request.url.path} ({exc.detail}): it serves "
            "POST /v1/chat/completions, /v1/responses and /v1/completions, GET /v1/models and /health"
        )
        return _error(request.url.path, exc.status_code, message, server.engine.version, code=f"unknown_{what}")

    return app


def _endpoint(server: PolicyServer, job_for: Callable[[PolicyServer, Any], _Job]) -> Callable[[Request], Any]:
    async def generate(request: Request) -> Response:
        return await _generate(server, request, job_for)

    return generate


@dataclasses.dataclass
class _Job:
    """A checked request of any of the three APIs, as the generation loop runs it."""

    prompt_ids: List[int]
    params: SamplingParams
    stream: bool
    tools_offered: bool  # tool calls are parsed out of the answer
    streamable: Callable[[str], str]  # how much of the text so far a stream may send (see ``_stream``)
    writer: Callable[[int], AnswerWriter]  # the API's writer, given the version that answers
    one_call: bool = False  # parallel_tool_calls: false

    def parse(self, gen: Generation) -> ParsedOutput:
        """The answer's content and tool calls; a call that ``max_tokens`` cut short is dropped.

        ``one_call``: calls after the first are dropped. A grammar allows one call only where one is in
        force; a free answer (``tool_choice`` "auto") may hold several, and OpenAI promises at most one.
        """
        parsed = parse_output(gen.text, self.tools_offered, cut=gen.finish_reason == "length")
        if self.one_call and len(parsed.tool_calls) > 1:
            return dataclasses.replace(parsed, tool_calls=parsed.tool_calls[:1])
        return parsed


def _chat_job(server: PolicyServer, body: Any) -> _Job:
    request, prompt_ids, params = server._prepare(body)
    return _as_chat(
        request,
        prompt_ids,
        params,
        lambda version: ResponseWriter(request, server.model_name, server.tokenizer, version),
    )


def _responses_job(server: PolicyServer, body: Any) -> _Job:
    """Checked, rendered and generated as the chat request it stands for."""
    chat_body = to_chat_body(body)
    try:
        request, prompt_ids, params = server._prepare(chat_body)
    except BadRequest as exc:
        raise in_responses_terms(exc) from None  # a chat-path check failed on what the Responses request meant
    return _as_chat(
        request,
        prompt_ids,
        params,
        lambda version: ResponsesWriter(body, server.model_name, server.tokenizer, version, request.logprobs),
    )


def _as_chat(
    request: ChatRequest, prompt_ids: List[int], params: SamplingParams, writer: Callable[[int], AnswerWriter]
) -> _Job:
    """A chat request's job: tool calls are parsed, and streamed content waits until it cannot become one."""
    return _Job(
        prompt_ids=prompt_ids,
        params=params,
        stream=request.stream,
        tools_offered=request.tools_offered,
        streamable=lambda text: streamable_prefix(text, request.tools_offered, request.stop),
        writer=writer,
        one_call=not request.parallel_tool_calls,
    )


def _completions_job(server: PolicyServer, body: Any) -> _Job:
    """The request's own prompt; its text streams as the model writes it (no tool calls, nothing stripped)."""
    request, prompt_ids, params = server._prepare_completion(body)
    return _Job(
        prompt_ids=prompt_ids,
        params=params,
        stream=request.chat.stream,
        tools_offered=False,
        streamable=lambda text: streamable_text(text, request.chat.stop),
        writer=lambda version: CompletionWriter(request, server.model_name, server.tokenizer, version),
    )


_JOBS = {CHAT: _chat_job, RESPONSES: _responses_job, COMPLETIONS: _completions_job}


async def _generate(
    server: PolicyServer, http_request: Request, job_for: Callable[[PolicyServer, Any], _Job]
) -> Response:
    """One request of any API: ``job_for`` checks it (a 400 when it cannot be served), then it runs."""
    version = server.engine.version
    path = http_request.url.path
    try:
        job = job_for(server, await _request_body(http_request))
    except BadRequest as exc:
        return _error(path, 400, str(exc), version, exc.param, exc.code)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()
    try:
        handle = server.engine.submit(
            job.prompt_ids,
            job.params,
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),  # type: ignore[arg-type]  # the engine ignores what the listener returns
        )
    except RuntimeError as exc:
        return _error(path, 503, f"{exc}; retry against a running server", version)
    try:
        return await unless_disconnected(http_request, _answer(path, version, events, handle, job))
    except ClientDisconnected:
        logger.info("%s: the client went away before its answer was ready; its generation was cancelled", path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _request_body(http_request: Request) -> Any:
    """The request's JSON, or a :class:`BadRequest`: not JSON, or nested too deeply (the parser meets that as
    a ``RecursionError``, which the server answered with a bare 500)."""
    try:
        body = await http_request.json()
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    require_shallow(body)
    return body


async def _answer(path: str, version: int, events: asyncio.Queue[Any], handle: Any, job: _Job) -> Response:
    """The response to a submitted request: its stream, or the finished answer (the generation is cancelled
    if this ends otherwise).

    ``_generate`` runs it under :func:`~agl._util.disconnect.unless_disconnected`, which cancels it when the
    client leaves: Starlette does not cancel a handler then, and a non-streamed request whose client timed
    out stayed in the batch until ``max_tokens``, each SDK retry adding one more. A stream, once started,
    is stopped by its own loop (Starlette cancels it when the client leaves).
    """
    finished = False
    try:
        first = await events.get()
        if isinstance(first, Failed):
            finished = True
            return _generation_failed(path, first.error, version)
        assert isinstance(first, Started)
        writer = job.writer(first.version)
        headers = {VERSION_HEADER: str(first.version)}
        if job.stream:
            finished = True  # the stream owns the request from here
            stream = _stream(events, handle, writer, job)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        while True:
            event = await events.get()
            if isinstance(event, Finished):
                finished = True
                gen = event.generation
                return _versioned(writer.final(gen, job.parse(gen)), first.version)
            if isinstance(event, Failed):
                finished = True
                return _generation_failed(path, event.error, first.version)
    finally:
        if not finished:
            handle.cancel()  # the client went away (or the server stops): stop generating for it


async def _stream(events: asyncio.Queue[Any], handle: Any, writer: AnswerWriter, job: _Job) -> AsyncIterator[str]:
    """SSE as tokens arrive, for any API's writer; text is sent only once nothing the model writes next can
    take it back (``job.streamable``: a stop string, or on the chat path a tool call), the rest with the
    parsed output at the end."""
    finished = False
    try:
        for line in writer.stream_start(job.prompt_ids):
            yield line
        sent = ""
        pending: List[Token] = []
        while True:
            event = await events.get()
            if isinstance(event, Step):
                pending.append(event.token)
                safe = job.streamable(event.text)
                if len(safe) > len(sent):
                    for line in writer.stream_text(safe[len(sent) :], pending, first=not sent):
                        yield line
                    sent, pending = safe, []
            elif isinstance(event, Finished):
                finished = True
                gen = event.generation
                for line in writer.stream_finish(gen, job.parse(gen), sent, pending):
                    yield line
                return
            elif isinstance(event, Failed):
                finished = True
                yield writer.stream_error(error_body(f"generation failed: {event.error}", 500))
                return
    finally:
        if not finished:
            handle.cancel()


def _prompt_vocabulary(model: Any, tokenizer: Any) -> int:
    """How many token ids a prompt may use: the tokenizer's, within the rows of the model's embedding."""
    return min(len(tokenizer), model.get_input_embeddings().num_embeddings)


def _versioned(payload: Dict[str, Any], version: int, status: int = 200) -> JSONResponse:
    """Every response says which policy version it comes from, in a header too."""
    return JSONResponse(payload, status_code=status, headers={VERSION_HEADER: str(version)})


def _generation_failed(path: str, error: BaseException, version: int) -> JSONResponse:
    """A 500 for a generation that failed; one the server's stop ended is not logged here (the engine says how
    many in one line as it closes: a Ctrl-C mid-step made a line per agent's request)."""
    message = f"generation failed: {error}"
    if isinstance(error, ServerStopped):
        return _versioned(error_body(message, 500), version, 500)
    return _error(path, 500, message, version)


def _error(
    path: str, status: int, message: str, version: int, param: Optional[str] = None, code: Optional[str] = None
) -> JSONResponse:
    """An error answer, logged once: a refused framework request can be diagnosed on the server too
    (the request body is never logged: it holds the user's conversation)."""
    logger.warning("%s answered %d: %s", path, status, message)
    return _versioned(error_body(message, status, param, code), version, status)
