"""An OpenAI-compatible proxy in front of vLLM that records every call, with its token ids, into the store.

Agents reach the trained model through this proxy and need no agl code at all: the ``ProxyLLM`` resource
gives each rollout a base URL ``http://proxy/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (clients that
cannot change their URL send the headers ``x-agl-rollout-id`` / ``x-agl-attempt-id`` to ``/v1`` instead).
For every ``chat/completions``, ``responses`` and (legacy) ``completions`` request the proxy

- asks the server for what training needs: ``return_token_ids: true`` (vLLM's flag) and, for chat,
  ``logprobs: true`` (completions: ``logprobs: 0``, the sampled tokens' only); the response goes back to the
  agent as the server sent it;
- forwards streams chunk by chunk while reassembling them, holding back only the final ``[DONE]``;
- writes one ``llm`` span per call to the store (:mod:`agl.instrumentation.proxy_calls`), in the same format
  and with the same attributes as agl's client-side OpenAI instrumentation (the same code builds them:
  :mod:`agl.openai_wire.payloads` and :mod:`~agl.openai_wire.streams`), before the agent sees the end of the
  response, so a
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
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agl._util.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, unless_disconnected
from agl._util.http_thread import ThreadedServer, advertised_url
from agl.instrumentation.proxy_calls import CLIENT_DISCONNECTED, FRAMEWORK_NAME, ProxyCall
from agl.openai_wire.apis import API_PATHS, CLIENT_TRACED_HEADER, NOT_AN_OBJECT, error_body, error_message
from agl.openai_wire.sampling import with_defaults, with_token_cap
from agl.openai_wire.sse import is_done
from agl.types import ProxyLLM, Span

logger = logging.getLogger("agl.proxy")

ROLLOUT_HEADER = "x-agl-rollout-id"
ATTEMPT_HEADER = "x-agl-attempt-id"
# Hop-by-hop and length headers are the proxy's own business on each side.
_DROP_REQUEST_HEADERS = {
    "host",
    "content-length",
    "connection",
    "accept-encoding",
    ROLLOUT_HEADER,
    ATTEMPT_HEADER,
    CLIENT_TRACED_HEADER,
}
_KEEP_RESPONSE_HEADERS = {"content-type", "x-request-id", "retry-after"}
_PROFILE_PREFIX = "/sampling"
_PROFILE_NAME = re.compile(r"[A-Za-z0-9_-]+")


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
    def start(self) -> LLMProxy:
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

    def __enter__(self) -> LLMProxy:
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
            raise ValueError(
                f"upstream must be one or more http(s) base URLs such as http://host:8000/v1, got {upstream!r}"
            )
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
            body = with_token_cap(body, api, cap)
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
                asked,
                temperature_from,
                expected,
                expected,
                temperature_from,
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
            api = API_PATHS.get(path.strip("/")) if request.method == "POST" else None
            if api is None:
                return await self._forward_plain(request, path)
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return _error(400, NOT_AN_OBJECT)
            if route is None:
                self.stats.unrouted += 1
            elif request.headers.get(CLIENT_TRACED_HEADER):
                self.stats.client_traced += 1
                route = None
            body = self._apply_sampling(api, body, profile)
            call = ProxyCall(self, api, body, route, request.headers.get("traceparent"))
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

    async def _complete(self, request: Request, path: str, call: ProxyCall) -> Response:
        assert self._client is not None
        url = self._upstream_url(path, request.url.query)
        try:
            upstream = await unless_disconnected(
                request, self._client.post(url, headers=self._headers(request), json=call.body)
            )
        except ClientDisconnected:
            return await self._client_gone(call)
        except httpx.HTTPError as exc:
            return await self._unreachable(call, url, exc)
        content = upstream.content
        if upstream.status_code >= 400:
            await self._upstream_failed(call, upstream.status_code, content)
        else:
            await self._record(call.completed(content))
        return _relay(upstream, content)

    async def _stream(self, request: Request, path: str, call: ProxyCall, gate: _Gate) -> Tuple[Response, bool]:
        """The relayed stream, or the error response; the flag says whether the caller still holds the gate."""
        assert self._client is not None
        url = self._upstream_url(path, request.url.query)
        upstream_request = self._client.build_request("POST", url, headers=self._headers(request), json=call.body)
        try:
            upstream = await unless_disconnected(request, self._client.send(upstream_request, stream=True))
        except ClientDisconnected:
            return await self._client_gone(call), True
        except httpx.HTTPError as exc:
            return await self._unreachable(call, url, exc), True
        if upstream.status_code >= 400:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            await self._upstream_failed(call, upstream.status_code, content)
            return _relay(upstream, content), True

        async def relay() -> AsyncIterator[bytes]:
            held: List[bytes] = []  # "data: [DONE]" and the lines after it: sent after the span is stored
            error: Optional[BaseException] = None
            try:
                async for line in upstream.aiter_lines():
                    if held or is_done(line):
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

    async def _unreachable(self, call: ProxyCall, url: str, exc: Exception) -> Response:
        """The model server could not be reached: a failed call, and a 502 for the agent."""
        self.stats.upstream_errors += 1
        message = f"the agl proxy could not reach the model server at {url}: {exc!r}"
        await self._record(call.failed("UpstreamUnreachable", message))
        return _error(502, message)

    async def _upstream_failed(self, call: ProxyCall, status: int, content: bytes) -> None:
        """The model server answered an error (relayed to the agent as it is): a failed call."""
        self.stats.upstream_errors += 1
        await self._record(call.failed(f"HTTP {status}", error_message(content)))

    async def _client_gone(self, call: ProxyCall) -> Response:
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
                "agl proxy could not store the llm span of rollout %s attempt %s: %s",
                span.rollout_id,
                span.attempt_id,
                exc,
            )


def _header_route(request: Request) -> Optional[Tuple[str, str]]:
    """The rollout and attempt a client that cannot change its URL names in headers, if it names both."""
    rollout_id, attempt_id = request.headers.get(ROLLOUT_HEADER), request.headers.get(ATTEMPT_HEADER)
    return (rollout_id, attempt_id) if rollout_id and attempt_id else None


def _relay(upstream: httpx.Response, content: bytes) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in _KEEP_RESPONSE_HEADERS}
    return Response(content=content, status_code=upstream.status_code, headers=headers)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, status, None, kind, kind), status_code=status)


__all__ = [
    "ATTEMPT_HEADER",
    "CLIENT_DISCONNECTED",
    "CLIENT_TRACED_HEADER",
    "FRAMEWORK_NAME",
    "LLMProxy",
    "ProxyStats",
    "ROLLOUT_HEADER",
]
