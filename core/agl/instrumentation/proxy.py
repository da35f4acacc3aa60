"""An OpenAI-compatible proxy in front of vLLM that records every call, with its token ids, into the store.

Agents reach the trained model through this proxy and need no agl code at all: the ``ProxyLLM`` resource
gives each rollout a base URL ``http://proxy/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (clients that
cannot change their URL send the headers ``x-agl-rollout-id`` / ``x-agl-attempt-id`` to ``/v1`` instead).
For every ``chat/completions``, ``responses`` and (legacy) ``completions`` request the proxy

- asks the server for what training needs: ``return_token_ids: true`` (vLLM's flag) and, for chat,
  ``logprobs: true`` (completions: ``logprobs: 0``, the sampled tokens' only); the response goes back to the
  agent as the server sent it;
- forwards streams chunk by chunk while reassembling them, holding back only the final ``[DONE]``;
- writes one ``llm`` span per call to the store, in the same format and with the same attributes as agl's
  client-side OpenAI instrumentation (the same code builds them: :mod:`agl.openai_wire.payloads`
  and :mod:`~agl.openai_wire.streams`), before the agent sees the end of the response, so a
  rollout that finished has all its spans stored; a request whose agent went away before the answer came
  (its client timed out, and an SDK retries it as a new request) is cancelled upstream and recorded as a
  failed call (``error.type`` ``ClientDisconnected``), which LightningRL skips: the agent never saw that
  answer, so training on it (with the reward its retry earned) would be wrong;
- with a W3C ``traceparent`` header, nests its span under the caller's span; with
  ``x-agl-client-traced`` (a client that records the call itself) it records nothing.

Other paths (``/v1/models``...) are forwarded unchanged and not recorded.

``set_sampling()`` makes the proxy hold requests to a trainer's sampling contract: what a request leaves
out is filled in, a larger token limit is lowered, and a request at another temperature than the one the
trainer computes log-probs at is warned about (once). ``set_sampling(..., profile="val")`` adds a second
contract served under its own base URL (``profile_url("val")``: ``http://proxy/sampling/val/v1``, routed the
same way), so rollouts of two kinds that run at once (training and validation) are each held to their own.

``pause()`` is for weight updates: new requests wait (they are not refused) while requests in flight
finish; ``resume()`` lets the waiting ones through, to the updated model.

Span ``sequence_id`` s are numbered per attempt in arrival order at the proxy. When the agent is also
traced on its side (``agl.instrument()``), both spans of a call carry the same ``gen_ai.response.id``;
``agl.framework`` is ``"agl.proxy"`` on the proxy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agl import semconv
from agl._util.http_thread import ThreadedServer, advertised_url
from agl.openai_wire.payloads import (
    CHAT,
    CLIENT_TRACED_HEADER,
    COMPLETIONS,
    RESPONSES,
    SPAN_PREFIX,
    TOKEN_IDS_REQUEST,
    add_request_payloads,
    logprobs_requested,
    record_response,
    record_token_ids,
    request_attributes,
)
from agl.openai_wire.streams import Accumulator, new_accumulator
from agl._util.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from agl.openai_wire.sampling import with_defaults
from agl.tracing.tracer import encode_attribute
from agl.types import ProxyLLM, Span

logger = logging.getLogger("agl.proxy")

ROLLOUT_HEADER = "x-agl-rollout-id"
ATTEMPT_HEADER = "x-agl-attempt-id"
FRAMEWORK_NAME = "agl.proxy"
_APIS = {"chat/completions": CHAT, "responses": RESPONSES, "completions": COMPLETIONS}
# Hop-by-hop and length headers are the proxy's own business on each side.
_DROP_REQUEST_HEADERS = {
    "host", "content-length", "connection", "accept-encoding", ROLLOUT_HEADER, ATTEMPT_HEADER, CLIENT_TRACED_HEADER
}
_KEEP_RESPONSE_HEADERS = {"content-type", "x-request-id", "retry-after"}
_PROFILE_PREFIX = "/sampling"
_PROFILE_NAME = re.compile(r"[A-Za-z0-9_-]+")
CLIENT_DISCONNECTED = "ClientDisconnected"  # error.type of a call whose agent went away before its answer


@dataclass
class ProxyStats:
    """Counters readable at any time (``proxy.stats``)."""

    requests: int = 0
    recorded: int = 0  # llm spans written to the store
    unrouted: int = 0  # generation requests without a rollout (forwarded, not recorded)
    client_traced: int = 0  # requests whose client records them itself (CLIENT_TRACED_HEADER): not recorded
    store_errors: int = 0  # spans the store refused (e.g. unknown rollout): logged, the agent still gets its answer
    upstream_errors: int = 0  # the model server could not be reached or answered >= 400
    client_disconnects: int = 0  # agents gone before their answer came: cancelled upstream, recorded as failed
    waited_on_pause: int = 0  # requests that arrived while paused


class _Gate:
    """Lets requests through unless paused; counts those in flight so a pause can wait for them to drain."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.in_flight = 0

    async def enter(self, stats: ProxyStats) -> None:
        if not self.open.is_set():
            stats.waited_on_pause += 1
        while not self.open.is_set():  # re-check: a pause may start again right after a resume
            await self.open.wait()
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def close(self, timeout: Optional[float]) -> None:
        self.open.clear()
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.in_flight} request(s) still in flight after {timeout} s; the proxy stays paused "
                "(call resume() to let requests through again)"
            ) from None


class LLMProxy:
    """The recording proxy. ``store`` is any LightningStore (``None``: forward without recording).

    ``upstream`` is the base URL of one or more OpenAI-compatible servers (``http://host:port/v1``);
    requests go round-robin. ``model`` replaces the model name of every request (vLLM serves the model
    under its path; agents may ask for any name).
    """

    def __init__(
        self,
        upstream: Union[str, Sequence[str]],
        store: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: Optional[str] = None,
        logprobs: bool = True,
        timeout: float = 600.0,
    ) -> None:
        self.store = store
        self.host = host
        self.model = model
        self.logprobs = logprobs
        self.timeout = timeout
        self.stats = ProxyStats()
        self._upstreams: List[str] = []
        self._next_upstream = itertools.count()
        self.set_upstreams(upstream)
        self.sampling: Dict[str, Any] = {}
        self._temperature_from: Optional[str] = None
        # Named contracts (set_sampling(profile=...)): sampling and temperature_from, served under profile_url().
        self._profiles: Dict[str, Tuple[Dict[str, Any], Optional[str]]] = {}
        self._temperature_warned = False
        self._sequences: Dict[Tuple[str, str], Iterator[int]] = {}
        self._sequence_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._gate: Optional[_Gate] = None
        self._client: Optional[httpx.AsyncClient] = None
        self.app = self._create_app()
        self._http = ThreadedServer(
            self.app, name="agl-llm-proxy", host=host, port=port, lifespan="on", graceful_shutdown_s=5, backlog=1024
        )

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> "LLMProxy":
        """Serve from a daemon thread; returns once the proxy accepts connections."""
        self._http.start()
        logger.info("agl LLM proxy on %s -> %s", self.base_url, ", ".join(self._upstreams))
        return self

    def stop(self) -> None:
        if not self._http.running:
            return
        if self._gate is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._gate.open.set)  # let paused requests finish, not hang
        self._http.stop()

    def __enter__(self) -> "LLMProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``; a ``ProxyLLM`` with this endpoint inserts the rollout route itself."""
        if self._http.port is None:
            raise RuntimeError("the proxy is not running: call start() or use it as a context manager")
        return advertised_url(self.host, self._http.port)  # runners on other machines reach a wildcard bind too

    def as_resource(self, model: Optional[str] = None, **sampling_parameters: Any) -> ProxyLLM:
        """The resource to publish: agents get their per-rollout URL from ``ProxyLLM.get_base_url()``."""
        name = model or self.model
        if not name:
            raise ValueError("as_resource() needs a model name (give model= here or to LLMProxy)")
        return ProxyLLM(endpoint=self.base_url, model=name, sampling_parameters=sampling_parameters)

    def set_upstreams(self, upstream: Union[str, Sequence[str]]) -> None:
        """Replace the model servers (e.g. after verl restarted its vLLM replicas)."""
        urls = [upstream] if isinstance(upstream, str) else list(upstream)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"upstream must be one or more http(s) base URLs such as http://host:8000/v1, got {upstream!r}")
        self._upstreams = [u.rstrip("/") for u in urls]

    def profile_url(self, profile: str) -> str:
        """The base URL of the sampling profile ``profile`` (``http://host:port/sampling/{profile}/v1``); a
        ``ProxyLLM`` with this endpoint routes by rollout as one with :attr:`base_url` does."""
        return self.base_url[: -len("/v1")] + f"{_PROFILE_PREFIX}/{profile}/v1"

    def set_sampling(
        self, sampling: Mapping[str, Any], temperature_from: Optional[str] = None, *, profile: Optional[str] = None
    ) -> None:
        """Hold generation requests to a trainer's sampling from now on (``{}``: forward them as sent).

        A request that leaves out one of ``sampling`` 's keys gets its value (e.g. ``top_k``, which the
        OpenAI SDK cannot send but vLLM reads from the body); ``max_tokens`` is also a cap, since the trainer
        keeps only that many response tokens: a larger limit (``max_tokens``, ``max_completion_tokens``, the
        Responses API's ``max_output_tokens``) is lowered to it. ``temperature_from`` names the setting the
        trainer computes log-probs at (``None``: no such trainer, e.g. during validation); a request at
        another temperature is then warned about, once, since training on it is silently off-policy.

        ``profile`` sets the contract of the requests sent to :meth:`profile_url` (``profile``) instead of
        :attr:`base_url`: a per-rollout choice, for rollouts that must not share one contract, e.g. a trainer's
        validation rollouts (greedy) running while its training rollouts still generate.
        """
        if profile is None:
            self.sampling = dict(sampling)
            self._temperature_from = temperature_from
            return
        if not _PROFILE_NAME.fullmatch(profile):
            raise ValueError(
                f"a sampling profile name is letters, digits, '_' and '-' (it goes in URLs), got {profile!r}"
            )
        self._profiles[profile] = (dict(sampling), temperature_from)

    def _apply_sampling(self, api: str, body: Dict[str, Any], profile: Optional[str] = None) -> Dict[str, Any]:
        if profile is None:
            sampling, temperature_from = self.sampling, self._temperature_from
        else:
            sampling, temperature_from = self._profiles[profile]
        if not sampling:
            return body
        body = with_defaults(body, sampling, [k for k in sampling if k != "max_tokens"])
        cap = sampling.get("max_tokens")
        if isinstance(cap, int):
            names = ("max_output_tokens",) if api == RESPONSES else ("max_tokens", "max_completion_tokens")
            given = [n for n in names if isinstance(body.get(n), int) and not isinstance(body.get(n), bool)]
            body = {**body, **{n: min(body[n], cap) for n in given}} if given else {**body, names[0]: cap}
        expected, asked = sampling.get("temperature"), body.get("temperature")
        if (
            temperature_from
            and not self._temperature_warned
            and isinstance(expected, (int, float))
            and isinstance(asked, (int, float))
            and float(asked) != float(expected)
        ):
            self._temperature_warned = True
            logger.warning(
                "an agent samples at temperature=%s, but the trainer computes the old log-probs at %s=%s: its "
                "samples are trained on as if drawn at %s (off-policy). Leave the temperature out of the agent's "
                "requests (the proxy fills it in) or pass llm.sampling_parameters on, or set %s to the agent's "
                "temperature. (Warned once.)",
                asked, temperature_from, expected, expected, temperature_from,
            )
        return body

    # -- weight updates ----------------------------------------------------------------------------------------
    def pause(self, timeout: Optional[float] = None) -> None:
        """Hold new requests and wait until those in flight are done (raises TimeoutError after ``timeout``)."""
        self._on_loop(self._gate_or_raise().close(timeout), None if timeout is None else timeout + 5)

    def resume(self) -> None:
        """Let requests through again (the ones that waited go first)."""
        gate = self._gate_or_raise()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(gate.open.set)

    @property
    def paused(self) -> bool:
        return self._gate is not None and not self._gate.open.is_set()

    @property
    def in_flight(self) -> int:
        return self._gate.in_flight if self._gate is not None else 0

    def _gate_or_raise(self) -> _Gate:
        if self._gate is None or self._loop is None:
            raise RuntimeError("the proxy is not running: start() it before pause()/resume()")
        return self._gate

    def _on_loop(self, coroutine: Any, timeout: Optional[float]) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # -- the app ---------------------------------------------------------------------------------------------
    def _create_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            self._gate = _Gate()
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10.0), limits=limits)
            try:
                yield
            finally:
                await self._client.aclose()
                self._client = None

        app = FastAPI(title="agl LLM proxy", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        methods = ["GET", "POST", "PUT", "DELETE"]

        @app.api_route("/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path:path}", methods=methods)
        async def _routed(request: Request, rollout_id: str, attempt_id: str, path: str) -> Response:
            return await self._handle(request, path, (rollout_id, attempt_id))

        @app.api_route("/v1/{path:path}", methods=methods)
        async def _plain(request: Request, path: str) -> Response:
            return await self._handle(request, path, _header_route(request))

        profile_route = _PROFILE_PREFIX + "/{profile}/rollout/{rollout_id}/attempt/{attempt_id}/v1/{path:path}"

        @app.api_route(profile_route, methods=methods)
        async def _profile_routed(
            request: Request, profile: str, rollout_id: str, attempt_id: str, path: str
        ) -> Response:
            return await self._handle(request, path, (rollout_id, attempt_id), profile)

        @app.api_route(_PROFILE_PREFIX + "/{profile}/v1/{path:path}", methods=methods)
        async def _profile_plain(request: Request, profile: str, path: str) -> Response:
            return await self._handle(request, path, _header_route(request), profile)

        return app

    async def _handle(
        self, request: Request, path: str, route: Optional[Tuple[str, str]], profile: Optional[str] = None
    ) -> Response:
        if profile is not None and profile not in self._profiles:
            return _error(
                404,
                f"this agl proxy has no sampling profile {profile!r} (known: {sorted(self._profiles)}): "
                f"call set_sampling(..., profile={profile!r}) before publishing its URL",
            )
        gate = self._gate_or_raise()
        self.stats.requests += 1
        await gate.enter(self.stats)
        release = True
        try:
            api = _APIS.get(path.strip("/")) if request.method == "POST" else None
            if api is None:
                return await self._forward_plain(request, path)
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            if route is None:
                self.stats.unrouted += 1
            elif request.headers.get(CLIENT_TRACED_HEADER):
                self.stats.client_traced += 1
                route = None
            body = self._apply_sampling(api, body, profile)
            call = _Call(self, api, body, route, request.headers.get("traceparent"))
            if body.get("stream"):
                response, release = await self._stream(request, path, call, gate)
                return response  # a relayed stream leaves the gate itself, when it ends
            return await self._complete(request, path, call)
        finally:
            if release:
                gate.leave()

    def _upstream_url(self, path: str, query: str) -> str:
        base = self._upstreams[next(self._next_upstream) % len(self._upstreams)]
        return f"{base}/{path.lstrip('/')}" + (f"?{query}" if query else "")

    @staticmethod
    def _headers(request: Request) -> Dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS}

    async def _forward_plain(self, request: Request, path: str) -> Response:
        assert self._client is not None
        url = self._upstream_url(path, request.url.query)
        try:
            upstream = await self._client.request(
                request.method, url, headers=self._headers(request), content=await request.body()
            )
        except httpx.HTTPError as exc:
            self.stats.upstream_errors += 1
            return _error(502, f"the agl proxy could not reach the model server at {url}: {exc!r}")
        return _relay(upstream, upstream.content)

    async def _complete(self, request: Request, path: str, call: "_Call") -> Response:
        assert self._client is not None
        url = self._upstream_url(path, request.url.query)
        try:
            upstream = await unless_disconnected(
                request, self._client.post(url, headers=self._headers(request), json=call.body)
            )
        except ClientDisconnected:
            return await self._client_gone(call)
        except httpx.HTTPError as exc:
            self.stats.upstream_errors += 1
            message = f"the agl proxy could not reach the model server at {url}: {exc!r}"
            await self._record(call.failed("UpstreamUnreachable", message))
            return _error(502, message)
        content = upstream.content
        if upstream.status_code >= 400:
            self.stats.upstream_errors += 1
            await self._record(call.failed(f"HTTP {upstream.status_code}", _error_message(content)))
        else:
            await self._record(call.completed(content))
        return _relay(upstream, content)

    async def _stream(self, request: Request, path: str, call: "_Call", gate: _Gate) -> Tuple[Response, bool]:
        """The relayed stream, or the error response; the flag says whether the caller still holds the gate."""
        assert self._client is not None
        url = self._upstream_url(path, request.url.query)
        upstream_request = self._client.build_request("POST", url, headers=self._headers(request), json=call.body)
        try:
            upstream = await unless_disconnected(request, self._client.send(upstream_request, stream=True))
        except ClientDisconnected:
            return await self._client_gone(call), True
        except httpx.HTTPError as exc:
            self.stats.upstream_errors += 1
            message = f"the agl proxy could not reach the model server at {url}: {exc!r}"
            await self._record(call.failed("UpstreamUnreachable", message))
            return _error(502, message), True
        if upstream.status_code >= 400:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            self.stats.upstream_errors += 1
            await self._record(call.failed(f"HTTP {upstream.status_code}", _error_message(content)))
            return _relay(upstream, content), True

        async def relay() -> AsyncIterator[bytes]:
            held: List[bytes] = []  # "data: [DONE]" and the lines after it: sent after the span is stored
            error: Optional[BaseException] = None
            try:
                async for line in upstream.aiter_lines():
                    if held or line.strip() == "data: [DONE]":
                        held.append(f"{line}\n".encode())  # with its blank line, or the event never ends
                        continue
                    call.add_sse_line(line)
                    yield f"{line}\n".encode()
            except BaseException as exc:  # the agent went away or the server broke the stream
                error = exc
                raise
            finally:
                # Shielded: when the agent disconnects, the server cancels this generator, and the span of
                # what was streamed so far must still be stored (and the gate released).
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
                    try:
                        await self._record(call.streamed(error))
                    finally:
                        gate.leave()
            for chunk in held:
                yield chunk

        headers = {k: v for k, v in upstream.headers.items() if k.lower() in _KEEP_RESPONSE_HEADERS}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=headers), False

    async def _client_gone(self, call: "_Call") -> Response:
        """The agent disconnected before the model server answered (its client timed out or gave up); the
        upstream request was cancelled with it.

        Recorded as a failed call, not left out: the span says a request was made and abandoned, as agl's
        client-side instrumentation records a call whose client gave up, and LightningRL skips failed calls.
        An SDK that retries sends a new request, recorded as its own call.
        """
        self.stats.client_disconnects += 1
        message = "the agent disconnected before the model server answered; the request to it was cancelled"
        await self._record(call.failed(CLIENT_DISCONNECTED, message))
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # read by no one: the connection is gone

    # -- spans -----------------------------------------------------------------------------------------------
    def next_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        with self._sequence_lock:
            counter = self._sequences.get((rollout_id, attempt_id))
            if counter is None:
                counter = self._sequences[(rollout_id, attempt_id)] = itertools.count()
            return next(counter)

    async def _record(self, span: Optional[Span]) -> None:
        if span is None or self.store is None:
            return
        try:
            await asyncio.to_thread(self.store.add_spans, [span])
            self.stats.recorded += 1
        except Exception as exc:  # noqa: BLE001 - the agent still gets its answer; the loss is counted
            self.stats.store_errors += 1
            logger.warning(
                "agl proxy could not store the llm span of rollout %s attempt %s: %s", span.rollout_id, span.attempt_id, exc
            )


class _Call:
    """One generation request: the body sent upstream and what becomes its span."""

    def __init__(
        self, proxy: LLMProxy, api: str, body: Dict[str, Any], route: Optional[Tuple[str, str]], traceparent: Optional[str]
    ) -> None:
        self.proxy = proxy
        self.api = api
        self.route = route
        self.start_ns = time.time_ns()
        stream = bool(body.get("stream"))
        if proxy.model:
            body["model"] = proxy.model
        body[TOKEN_IDS_REQUEST] = True
        if api == CHAT and proxy.logprobs and not body.get("logprobs"):
            body["logprobs"] = True
        elif api == COMPLETIONS and proxy.logprobs and body.get("logprobs") is None:
            body["logprobs"] = 0
        self.body = body
        self.with_logprobs = logprobs_requested(api, body)
        self.deferred: Dict[str, Any] = {}
        if route is not None:
            self.deferred = request_attributes(api, body, stream)
            add_request_payloads(api, body, self.deferred)
        self.accumulator: Optional[Accumulator] = None
        if stream and route is not None:
            self.accumulator = new_accumulator(api, self.with_logprobs)
        self.sse_event: Optional[str] = None
        self.trace_id, self.parent_id = _parse_traceparent(traceparent)

    def completed(self, content: bytes) -> Optional[Span]:
        if self.route is None:
            return None
        reasons: List[str] = []
        try:
            data = json.loads(content)
            reasons = record_response(self.api, _sdk_response(self.api, data), self.deferred, self.with_logprobs)
        except Exception as exc:  # noqa: BLE001 - a reply we cannot read is still the agent's reply
            logger.warning("agl proxy could not read the model's reply: %s", exc)
            record_token_ids(None, None, self.deferred)
            return self._span(reasons, ("UnreadableResponse", f"{type(exc).__name__}: {exc}"))
        return self._span(reasons, None)

    def add_sse_line(self, line: str) -> None:
        """Feed one SSE line of the upstream stream to the accumulator (``event:`` names the next data)."""
        if self.accumulator is None:
            return
        if line.startswith("event:"):
            self.sse_event = line[6:].strip()
            return
        if not line.startswith("data:"):
            return
        try:
            data = json.loads(line[5:].strip())
            if self.api == RESPONSES:
                self.accumulator.add(_responses_event(data, self.sse_event))
            else:
                self.accumulator.add(_sdk_chunk(self.api, data))
        except Exception as exc:  # noqa: BLE001 - keep relaying; the span says what could not be read
            logger.warning("agl proxy could not read a streamed chunk: %s", exc)
            self.accumulator = None

    def streamed(self, error: Optional[BaseException]) -> Optional[Span]:
        if self.route is None:
            return None
        accumulator = self.accumulator
        if accumulator is None:
            record_token_ids(None, None, self.deferred)
            return self._span([], ("UnreadableStream", "the proxy could not read the streamed reply"))
        reasons = accumulator.record(self.deferred)
        failure = accumulator.failure
        if error is not None:
            failure = (type(error).__name__, f"the stream ended early: {type(error).__name__}: {error}")
        return self._span(reasons, failure)

    def failed(self, error_type: str, message: str) -> Optional[Span]:
        if self.route is None:
            return None
        record_token_ids(None, None, self.deferred)
        return self._span([], (error_type, message))

    def _span(self, reasons: List[str], failure: Optional[Tuple[str, str]]) -> Span:
        assert self.route is not None
        rollout_id, attempt_id = self.route
        attributes: Dict[str, Any] = {semconv.SPAN_KIND: "llm", semconv.FRAMEWORK: FRAMEWORK_NAME}
        for key, value in self.deferred.items():
            attributes[key] = encode_attribute(value)
        if reasons:
            attributes[semconv.RESPONSE_FINISH_REASONS] = reasons
        if failure is not None:
            attributes[semconv.ERROR_TYPE] = failure[0]
        model = self.body.get("model")
        prefix = SPAN_PREFIX[self.api]
        return Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=self.proxy.next_sequence_id(rollout_id, attempt_id),
            trace_id=self.trace_id or secrets.token_hex(16),
            span_id=secrets.token_hex(8),
            parent_id=self.parent_id,
            name=f"{prefix} {model}" if isinstance(model, str) and model else prefix,
            kind="llm",
            start_time=self.start_ns,
            end_time=time.time_ns(),
            status="error" if failure is not None else "ok",
            error=failure[1] if failure is not None else None,
            attributes=attributes,
        )


def _sdk_response(api: str, data: Dict[str, Any]) -> Any:
    """A non-streamed reply as the SDK object the instrumentation reads (built without validation: the reply
    goes to the agent as sent, whatever the SDK would think of it)."""
    if api == CHAT:
        from openai.types.chat import ChatCompletion

        return ChatCompletion.construct(**data)
    if api == COMPLETIONS:
        from openai.types import Completion

        return Completion.construct(**data)
    from openai.types.responses import Response as ResponsesResponse

    return ResponsesResponse.construct(**data)


def _sdk_chunk(api: str, data: Dict[str, Any]) -> Any:
    """A chat or completions stream chunk as the SDK object the accumulator reads."""
    if api == CHAT:
        from openai.types.chat import ChatCompletionChunk

        return ChatCompletionChunk.construct(**data)
    from openai.types import Completion

    return Completion.construct(**data)


def _responses_event(data: Dict[str, Any], event: Optional[str]) -> Any:
    """A Responses stream event as the SDK hands it to the accumulator on the client side: its typed model
    (built without validation, as the SDK builds it), so every field the accumulator reads (the snapshot's
    ``response``, a delta's ``output_index`` and ``logprobs``, a server's extra ``token_ids``) is there. The
    SSE ``event:`` line names the type of a data line that does not."""
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    if not data.get("type") and event:
        data = {**data, "type": event}
    return construct_type(type_=ResponseStreamEvent, value=data)


def _header_route(request: Request) -> Optional[Tuple[str, str]]:
    """The rollout and attempt a client that cannot change its URL names in headers, if it names both."""
    rollout_id, attempt_id = request.headers.get(ROLLOUT_HEADER), request.headers.get(ATTEMPT_HEADER)
    return (rollout_id, attempt_id) if rollout_id and attempt_id else None


def _parse_traceparent(value: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """W3C ``traceparent`` (``00-<32 hex trace>-<16 hex span>-<flags>``) to (trace id, parent span id)."""
    if not value:
        return None, None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None, None
    try:
        int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None, None
    return parts[1], parts[2]


def _relay(upstream: httpx.Response, content: bytes) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in _KEEP_RESPONSE_HEADERS}
    return Response(content=content, status_code=upstream.status_code, headers=headers)


def _error_message(content: bytes) -> str:
    try:
        error = json.loads(content).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return content[:500].decode("utf-8", "replace")


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": kind}}, status_code=status)


__all__ = ["ATTEMPT_HEADER", "CLIENT_TRACED_HEADER", "LLMProxy", "ProxyStats", "ROLLOUT_HEADER"]
