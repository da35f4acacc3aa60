"""The OpenAI client instrumentation: one ``llm`` span per ``create`` call, with the token ids to train on.

Every framework agl supports reaches the model through the ``openai`` client, so this is where prompts,
answers and (inside rollouts) the server's token ids are captured. ``chat.completions.create``,
``responses.create`` and the legacy text API's ``completions.create``, sync and async, are wrapped on their
classes with ``wrapt``; everything built on them goes through the wrapper too: ``with_raw_response``,
``with_streaming_response`` (also of a client used before instrumenting: :mod:`agl.instrumentation.
openai_views`) and the SDK's ``chat.completions.stream()`` / ``responses.stream()`` helpers. After
uninstrumenting, a method bound while hooked passes its calls through unrecorded. Streams are proxied by
:mod:`agl.instrumentation.openai_stream_proxies`, raw and streaming responses by
:mod:`~agl.instrumentation.openai_raw_responses`; what is recorded is built by :mod:`agl.openai_wire`.

Past a rollout's timeout, its agent's calls are refused (:func:`agl.tracing.context.refuse_calls_after_timeout`), also
through a method bound while hooked and called after uninstrumenting, and so is each retry the SDK sends for a
call that was in flight at the timeout (:func:`_refuse_timed_out_attempt`).

Guarantees to the user's program:
- arguments, return values and exceptions pass through unchanged (same objects), except that inside a
  rollout ``extra_body`` gains ``return_token_ids`` (in a new dict, the user's own value winning); a server
  that rejects that parameter gets the call again as the user wrote it
  (:mod:`agl.instrumentation.token_id_refusals`);
- an error in agl's code is reported through :mod:`agl._util.safety` and the call goes on;
- the caller's thread only reads a few fields; JSON and per-token work happen on the tracer's writer.

If a framework adapter already opened an ``llm`` span for the request (see
:mod:`agl.tracing.context_keys`), the attributes go onto that span instead of a new one.
"""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.trace import StatusCode

from agl import semconv
from agl._util.safety import report_internal_error
from agl.instrumentation.base import Instrumentor
from agl.instrumentation.openai_raw_responses import RawStreamResponse, UnreadResponse, body_read, body_untouched
from agl.instrumentation.openai_stream_proxies import AsyncStreamProxy, StreamProxy
from agl.instrumentation.openai_views import CurrentView, hook_views, unhook_views
from agl.instrumentation.token_id_refusals import is_refusal, refuses, remember, server_of
from agl.openai_wire.apis import CHAT, CLIENT_TRACED_HEADER, COMPLETIONS, RESPONSES, TOKEN_IDS_REQUEST
from agl.openai_wire.payloads import (
    SPAN_PREFIX,
    add_request_payloads,
    logprobs_requested,
    record_response,
    request_attributes,
)
from agl.openai_wire.streams import Accumulator, new_accumulator
from agl.tracing.context import RolloutScope, current_scope, refuse_calls_after_timeout
from agl.tracing.context_keys import SUPPRESS_LLM_SPAN
from agl.tracing.tracer import get_tracer, record_exception

logger = logging.getLogger("agl.instrumentation")

# (module, class, api, is_async): where ``create`` (and the structured-output ``parse``, which does not go
# through ``create``) live in openai 1.60 up to 3.x. The Responses API appeared in openai 1.66; up to openai
# 1.91 structured output was ``client.beta.chat.completions.parse``, a class of its own (1.92 made
# ``beta.chat`` the plain ``Chat``). The legacy Completions API (a prompt string or token ids in, text out) is
# what token-in agents and LangChain's ``OpenAI`` LLM call. A class or method that is not there is skipped.
_TARGETS: Tuple[Tuple[str, str, str, bool], ...] = (
    ("openai.resources.chat.completions", "Completions", CHAT, False),
    ("openai.resources.chat.completions", "AsyncCompletions", CHAT, True),
    ("openai.resources.beta.chat.completions", "Completions", CHAT, False),
    ("openai.resources.beta.chat.completions", "AsyncCompletions", CHAT, True),
    ("openai.resources.responses", "Responses", RESPONSES, False),
    ("openai.resources.responses", "AsyncResponses", RESPONSES, True),
    ("openai.resources.completions", "Completions", COMPLETIONS, False),
    ("openai.resources.completions", "AsyncCompletions", COMPLETIONS, True),
)
_METHODS = ("create", "parse")
# Where the SDK builds each HTTP attempt of a call, the first and every retry, sync and async clients alike:
# ``BaseClient._build_request``, a private method, in openai 1.66 up to 3.x. Its retry loop calls it before
# the ``try`` around the send, so an error raised there ends the call at once instead of being retried.
# (``_prepare_request``, the SDK's documented per-request hook, is not usable: ``OpenAI`` and ``AsyncOpenAI``
# override it without calling ``super()`` since openai 2.x.) A release without it is not hooked: see
# :func:`_refuse_timed_out_attempt`.
_ATTEMPT_TARGET = ("openai._base_client", "BaseClient", "_build_request")
_RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"  # set by with_raw_response ("true") / with_streaming_response
_STREAMING_RESPONSE = "stream"  # the header's value from with_streaming_response: the body is read later
_MARK = "_agl_openai_wrapper"  # on our wrapper functions, to recognise a class another instance hooked


class LlmCall:
    """One instrumented request: its span (own, or the adapter's when suppressed) and what to record."""

    __slots__ = (
        "api",
        "span",
        "owned",
        "context",
        "deferred",
        "stream",
        "raw",
        "with_logprobs",
        "ended",
        "resource",
        "retry",
        "refused",
        "raw_for_parse",
    )

    def __init__(self, api: str, span: Any, owned: bool, deferred: Dict[str, Any], kwargs: Dict[str, Any]) -> None:
        self.api = api
        self.span = span
        self.owned = owned
        # Our span is current while the request runs, so spans made underneath (HTTP, retries) nest in it.
        self.context = otel_trace.set_span_in_context(span) if owned else None
        self.deferred = deferred
        self.stream = bool(kwargs.get("stream"))
        headers = kwargs.get("extra_headers")
        self.raw = headers.get(_RAW_RESPONSE_HEADER) if headers else None
        self.with_logprobs = logprobs_requested(api, kwargs)
        self.ended = False
        self.resource: Any = None  # the SDK resource called (its client's base_url names the server)
        self.retry: Optional[Dict[str, Any]] = None  # the call as sent without agl's token id flag
        self.refused = False  # the server refused return_token_ids (this call, or earlier in the process)
        self.raw_for_parse = False  # a structured-output call agl made raw (see _ask_raw_for_parse)

    def refused_by(self, error: BaseException) -> bool:
        """Whether ``error`` is the server refusing the token id flag agl added: then the call goes again
        with ``self.retry``, and the server is remembered."""
        try:
            if self.retry is None or not is_refusal(error):
                return False
            remember(server_of(self.resource))
            self.refused = True
            return True
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("openai.refusal", exc)
            return False

    def succeed(self, result: Any, is_async: bool) -> Any:
        """The call returned: record the response and end the span, or hand back a proxied stream."""
        if self.raw_for_parse:
            return self._parse_for_user(result)
        reasons: List[str] = []
        try:
            if self.raw is not None and self.stream:
                return RawStreamResponse(result, self, is_async)  # the span ends with the parsed stream
            if self.raw == _STREAMING_RESPONSE:
                return UnreadResponse(result, self, is_async)  # the span ends when the body is read
            if self.raw is not None:
                reasons = self._record_body(result)
            elif self.stream:
                proxy = self._proxy_stream(result, is_async)
                if proxy is not None:
                    return proxy
            else:
                reasons = record_response(self.api, result, self.deferred, self.with_logprobs)
        except Exception as exc:  # noqa: BLE001 - the user gets the result whatever we failed to read
            report_internal_error("openai.response", exc)
        self._end(reasons, None, None)
        return result

    def fail(self, error: BaseException) -> None:
        self._end(None, error, None)

    def end_stream(
        self, accumulator: Optional[Accumulator], error: Optional[BaseException], unfinished: Optional[str] = None
    ) -> None:
        """End the span of a streamed call with what its ``accumulator`` gathered; ``unfinished`` names the flag
        saying why the answer is incomplete (abandoned by the agent, truncated by the server)."""
        if self.ended:  # the deferred attributes are the writer's now
            return
        reasons: List[str] = []
        failure = None
        if unfinished is not None:
            self.deferred[unfinished] = True
        if accumulator is not None:
            try:
                reasons = accumulator.record(self.deferred)
                failure = accumulator.failure
            except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
                report_internal_error("openai.stream_end", exc)
        self._end(reasons, error, failure)

    def _proxy_stream(self, result: Any, is_async: bool) -> Any:
        accumulator = new_accumulator(self.api, self.with_logprobs)
        if is_async and hasattr(result, "__anext__"):
            return AsyncStreamProxy(result, self, accumulator)
        if not is_async and hasattr(result, "__next__"):
            return StreamProxy(result, self, accumulator)
        return None

    def end_unread(self, response: Any) -> None:
        """A ``with_streaming_response`` response closed: its span ends with the body if the user read it
        (``read``/``text``/``json``/``parse`` cache it). Closed unread, nothing arrived for the agent: marked
        ``agl.llm.stream_abandoned``, with no output and no token id source (LightningRL skips it as an empty
        response). Read in pieces (``iter_bytes``, ...), the body is gone: the span ends without it."""
        if self.ended:
            return
        if body_read(response):
            self.end_read(response)
        elif body_untouched(response):
            self.end_stream(None, None, semconv.STREAM_ABANDONED)
        else:
            self._end(None, None, None)

    def end_read(self, response: Any) -> None:
        """The user read a ``with_streaming_response`` body (or tried to: a structured-output answer that does
        not parse raises after reading it): record it, as ``with_raw_response`` does, and end the span.

        An async response's ``parse()`` is a coroutine; its ``_parse()`` (the SDK's parse without the
        structured-output post-parser, present since openai 1.0) reads the same body at once."""
        if self.ended or not body_read(response):
            return
        reasons: List[str] = []
        try:
            if inspect.iscoroutinefunction(response.parse):
                reasons = record_response(self.api, response._parse(), self.deferred, self.with_logprobs)
            else:
                reasons = self._record_body(response)
        except Exception as exc:  # noqa: BLE001 - the user gets the body whatever we failed to read
            report_internal_error("openai.response", exc)
        self._end(reasons, None, None)

    def _record_body(self, result: Any) -> List[str]:
        """A raw response's body: its ``parse()`` caches, so parsing here costs the user nothing later. An
        answer that does not parse is recorded all the same; the user's own ``parse()`` raises as before."""
        try:
            parsed = result.parse()
        except Exception as exc:  # noqa: BLE001 - the user's parse() raises it again
            return self._record_unparsed(result, exc)
        return record_response(self.api, parsed, self.deferred, self.with_logprobs)

    def _parse_for_user(self, raw: Any) -> Any:
        """What the SDK's ``parse`` would have returned, from the raw response agl asked for instead. The
        span is ended first; an answer that does not parse is recorded, and the SDK's error raised."""
        try:
            parsed = raw.parse()
        except BaseException as exc:
            reasons: List[str] = []
            try:
                reasons = self._record_unparsed(raw, exc)
            except Exception as internal:  # noqa: BLE001 - reported; agl's failure never reaches the agent
                report_internal_error("openai.response", internal)
            self._end(reasons, None, None)
            raise
        try:
            reasons = record_response(self.api, parsed, self.deferred, self.with_logprobs)
        except Exception as exc:  # noqa: BLE001 - the user gets the result whatever we failed to read
            report_internal_error("openai.response", exc)
            reasons = []
        self._end(reasons, None, None)
        return parsed

    def _record_unparsed(self, raw: Any, error: BaseException) -> List[str]:
        """Structured output whose answer did not parse (invalid JSON, a truncated answer): the model did
        answer, and an RL run needs exactly those samples, so the completion is read without the SDK's
        post-parser (``_parse``, present since openai 1.0) and the span says why the call raised."""
        self.span.set_attribute(semconv.PARSE_ERROR, f"{type(error).__name__}: {error}"[:2000])
        return record_response(self.api, raw._parse(), self.deferred, self.with_logprobs)

    def _end(
        self, reasons: Optional[List[str]], error: Optional[BaseException], failure: Optional[Tuple[str, str]]
    ) -> None:
        if self.ended:
            return
        self.ended = True
        span = self.span
        try:
            if reasons:
                span.set_attribute(semconv.RESPONSE_FINISH_REASONS, reasons)
            if self.refused and self.deferred.get(semconv.TOKEN_IDS_SOURCE) != "server":
                self.deferred[semconv.TOKEN_IDS_SOURCE] = "refused"
            if error is not None:
                if self.owned:
                    record_exception(span, error)
                else:  # the adapter records the exception on its span; say only that the request failed
                    span.set_attribute(semconv.ERROR_TYPE, type(error).__name__)
                    span.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
            elif failure is not None:
                span.set_attribute(semconv.ERROR_TYPE, failure[0])
                span.set_status(StatusCode.ERROR, failure[1])
            if self.deferred and span.is_recording():
                get_tracer().set_deferred(span, self.deferred)
        except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
            report_internal_error("openai.end", exc)
        if self.owned:
            try:
                span.end()
            except Exception as exc:  # noqa: BLE001 - may run while the user's own exception propagates
                report_internal_error("openai.end", exc)


def ask_for_token_ids(call_kwargs: Dict[str, Any]) -> bool:
    """Add ``return_token_ids`` to the call's ``extra_body``, in a new dict; the user's own value wins.

    Returns whether agl added it (False: the user set it themselves, or ``extra_body`` is not a mapping).
    """
    extra = call_kwargs.get("extra_body")
    if extra is None:
        call_kwargs["extra_body"] = {TOKEN_IDS_REQUEST: True}
        return True
    if isinstance(extra, collections.abc.Mapping) and TOKEN_IDS_REQUEST not in extra:
        call_kwargs["extra_body"] = {TOKEN_IDS_REQUEST: True, **extra}
        return True
    return False


def mark_client_traced(call_kwargs: Dict[str, Any]) -> None:
    """Add ``CLIENT_TRACED_HEADER`` to the call's ``extra_headers``, in a new dict; the user's own value wins."""
    headers = call_kwargs.get("extra_headers")
    if headers is None:
        call_kwargs["extra_headers"] = {CLIENT_TRACED_HEADER: "1"}
    elif isinstance(headers, collections.abc.Mapping):
        call_kwargs["extra_headers"] = {CLIENT_TRACED_HEADER: "1", **headers}


def _ask_raw_for_parse(call_kwargs: Dict[str, Any]) -> None:
    """Structured output (``parse``) validates the answer inside the SDK, after the response arrived: an
    answer that does not parse raises there, and the completion is lost with it. Asking for the raw
    response (what ``with_raw_response`` does) lets agl read the completion whatever ``parse()`` then says;
    :meth:`LlmCall._parse_for_user` hands the user exactly what the SDK's ``parse`` returns or raises."""
    headers = dict(call_kwargs.get("extra_headers") or {})
    headers[_RAW_RESPONSE_HEADER] = "true"
    call_kwargs["extra_headers"] = headers


def _begin(
    api: str, resource: Any, kwargs: Dict[str, Any], request_token_ids: Optional[bool], parse: bool = False
) -> Tuple[LlmCall, Dict[str, Any]]:
    """Everything before the request: attributes, payload snapshots, the token id flag, then the span.

    The span starts last: if anything here fails, nothing is left open and the wrapper sends the user's
    own arguments.
    """
    call_kwargs = dict(kwargs)
    deferred = request_attributes(api, kwargs, bool(kwargs.get("stream")))
    add_request_payloads(api, call_kwargs, deferred)
    scope = current_scope()
    if scope is not None:  # this call's span will be stored: a proxy must not record it again
        mark_client_traced(call_kwargs)
    raw_for_parse = (
        parse and not kwargs.get("stream") and _RAW_RESPONSE_HEADER not in (kwargs.get("extra_headers") or {})
    )
    if raw_for_parse:
        _ask_raw_for_parse(call_kwargs)
    retry: Optional[Dict[str, Any]] = None
    refused = False
    if _wants_token_ids(request_token_ids, scope):
        if refuses(resource):
            refused = True
        else:
            retry = dict(call_kwargs)  # the call as the user wrote it (and marked), should the server refuse
            if not ask_for_token_ids(call_kwargs):
                retry = None
    span = None
    owned = True
    if otel_context.get_value(SUPPRESS_LLM_SPAN):
        current = otel_trace.get_current_span()
        if current.is_recording():
            span, owned = current, False
    if span is None:
        model = deferred.get(semconv.REQUEST_MODEL)
        prefix = SPAN_PREFIX[api]
        span = get_tracer().start_span(f"{prefix} {model}" if model else prefix, "llm")  # parent: see start_span
    call = LlmCall(api, span, owned, deferred, kwargs)
    call.resource, call.retry, call.refused, call.raw_for_parse = resource, retry, refused, raw_for_parse
    return call, call_kwargs


def _is_parse(wrapped: Callable[..., Any]) -> bool:
    return getattr(wrapped, "__name__", "") == "parse"


def _wants_token_ids(request_token_ids: Optional[bool], scope: Optional[RolloutScope]) -> bool:
    """An explicit True/False wins; by default token ids are asked for inside rollouts that want them."""
    if request_token_ids is not None:
        return request_token_ids
    return scope is not None and scope.request_token_ids


def _refuse_timed_out_attempt(
    wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """Refuse each attempt the SDK sends for a rollout that ran past its timeout, its own retries included.

    The ``create`` wrappers refuse a timed-out agent's *next* call, but a call already in flight at the
    timeout went on retrying inside the SDK (``max_retries``, LangChain's too), and each retry reached the
    model server beside the rollouts that replaced it. Outside such a scope this costs one context-variable
    read. Hooked on :data:`_ATTEMPT_TARGET`, a private SDK method: in an openai release without it, only the
    ``create`` wrappers refuse (a debug line says so when instrumenting)."""
    refuse_calls_after_timeout()
    return wrapped(*args, **kwargs)


setattr(_refuse_timed_out_attempt, _MARK, True)


def _start(
    api: str, instrumentor: OpenAIInstrumentor, wrapped: Callable[..., Any], instance: Any, kwargs: Dict[str, Any]
) -> Optional[Tuple[LlmCall, Dict[str, Any]]]:
    """What both wrappers do first: refuse a timed-out agent's call, then :func:`_begin` recording it. None:
    the call goes as the user wrote it, unrecorded (unhooked, or agl failed before the request)."""
    refuse_calls_after_timeout()  # before hooks_live: also once the Trainer has taken its hooks out
    if not instrumentor.hooks_live:  # a method bound while hooked, called after agl.uninstrument()
        return None
    if instrumentor.request_token_ids is not True and current_scope() is None:
        # Outside every rollout nothing stores the call's span: the call goes as written (no span, no payload
        # snapshots), ~1 us instead of ~30; only counted, and warned of as a stray call of an agent's thread.
        get_tracer().unrecorded(SPAN_PREFIX[api], "llm")
        return None
    try:
        return _begin(api, instance, kwargs, instrumentor.request_token_ids, _is_parse(wrapped))
    except Exception as exc:  # noqa: BLE001 - reported; agl's failure never reaches the agent
        report_internal_error("openai.request", exc)
        return None


def _sync_wrapper(api: str, instrumentor: OpenAIInstrumentor) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        started = _start(api, instrumentor, wrapped, instance, kwargs)
        if started is None:
            return wrapped(*args, **kwargs)
        call, call_kwargs = started
        token = otel_context.attach(call.context) if call.context is not None else None
        try:
            result = _send(wrapped, args, call_kwargs, call)
        except BaseException as exc:
            call.fail(exc)
            raise
        finally:
            if token is not None:
                otel_context.detach(token)
        return call.succeed(result, False)

    setattr(wrapper, _MARK, True)
    return wrapper


def _async_wrapper(api: str, instrumentor: OpenAIInstrumentor) -> Callable[..., Any]:
    """Returns the coroutine at once, like the SDK: argument errors still raise at call time, not at await."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        started = _start(api, instrumentor, wrapped, instance, kwargs)
        if started is None:
            return wrapped(*args, **kwargs)
        call, call_kwargs = started
        try:
            coroutine = wrapped(*args, **call_kwargs)
        except BaseException as exc:
            call.fail(exc)
            raise
        return _finish_async(coroutine, call, wrapped, args)

    setattr(wrapper, _MARK, True)
    return wrapper


def _send(wrapped: Callable[..., Any], args: Tuple[Any, ...], call_kwargs: Dict[str, Any], call: LlmCall) -> Any:
    """The request; again without agl's token id flag if the server refused it (outside the ``except``, so
    an error of the second request is not chained to the refusal)."""
    try:
        return wrapped(*args, **call_kwargs)
    except Exception as exc:
        if not call.refused_by(exc):
            raise
    assert call.retry is not None  # refused_by() is true only with a retry to send
    return wrapped(*args, **call.retry)


async def _send_async(coroutine: Any, call: LlmCall, wrapped: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
    try:
        return await coroutine
    except Exception as exc:
        if not call.refused_by(exc):
            raise
    assert call.retry is not None  # refused_by() is true only with a retry to send
    return await wrapped(*args, **call.retry)


async def _finish_async(coroutine: Any, call: LlmCall, wrapped: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
    token = otel_context.attach(call.context) if call.context is not None else None
    try:
        result = await _send_async(coroutine, call, wrapped, args)
    except BaseException as exc:
        call.fail(exc)
        raise
    finally:
        if token is not None:
            otel_context.detach(token)
    return call.succeed(result, True)


def _resolve(module_name: str, class_name: str) -> Optional[type]:
    try:
        return getattr(importlib.import_module(module_name), class_name, None)
    except ImportError:
        return None


def _hooked_by_agl(function: Any) -> bool:
    """Whether agl's wrapper is anywhere in ``function``'s chain of wrappers."""
    for _ in range(64):
        if function is None:
            return False
        if getattr(getattr(function, "_self_wrapper", None), _MARK, False):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _unwrap(cls: type, method: str, handle: Any) -> None:
    """Put back exactly what the method was; splice our wrapper out if someone wrapped on top of it."""
    if vars(cls).get(method) is handle:
        setattr(cls, method, handle.__wrapped__)  # type: ignore[union-attr]  # called with a hooked handle only
        return
    unwrap_object = getattr(wrapt, "unwrap_object", None)  # wrapt >= 2
    if unwrap_object is None:
        logger.warning("agl cannot unhook %s.%s: another wrapper was put over it (upgrade wrapt)", cls.__name__, method)
        return
    unwrap_object(cls, method, handle, missing_ok=True)


class OpenAIInstrumentor(Instrumentor):
    """Traces ``chat.completions.create``, ``responses.create`` and ``completions.create`` of every OpenAI
    client, sync and async.

    ``request_token_ids``: None (default) asks the server for token ids only inside rollouts whose scope
    wants them; True always asks (an agl or vLLM server outside rollouts); False never asks. A server that
    rejects the parameter (api.openai.com, an LLM judge's) gets the call again without it and is not asked
    again (:mod:`agl.instrumentation.token_id_refusals`).
    """

    name = "openai"
    instruments = ("openai>=1.66",)

    def __init__(self) -> None:
        super().__init__()
        self.request_token_ids: Optional[bool] = None
        self._hooks: List[Tuple[type, str, Any]] = []
        self._views: List[Tuple[type, str, CurrentView]] = []

    def _instrument(self, *, request_token_ids: Optional[bool] = None, **kwargs: Any) -> None:
        self.request_token_ids = request_token_ids
        for module_name, class_name, api, is_async in _TARGETS:
            cls = _resolve(module_name, class_name)
            make = _async_wrapper if is_async else _sync_wrapper
            for method in _METHODS:
                self._hook(module_name, class_name, cls, method, make(api, self))
            if cls is not None:
                self._views.extend(hook_views(cls))  # after the methods: views built from now on bind the hooks
        module_name, class_name, method = _ATTEMPT_TARGET
        self._hook(module_name, class_name, _resolve(module_name, class_name), method, _refuse_timed_out_attempt)

    def _hook(self, module_name: str, class_name: str, cls: Optional[type], method: str, wrapper: Any) -> None:
        """Wrap ``cls.method`` with ``wrapper`` (one of agl's, marked); skipped if the class or method is not
        there in this openai release, or agl's wrapper is on it already (another OpenAIInstrumentor's)."""
        if cls is None or method not in vars(cls):
            logger.debug("agl: openai has no %s.%s.%s here; not hooked", module_name, class_name, method)
            return
        if _hooked_by_agl(vars(cls)[method]):
            return  # another OpenAIInstrumentor already hooks it: one span (one check) per request
        handle = wrapt.wrap_function_wrapper(cls, method, wrapper)
        self._hooks.append((cls, method, handle))

    def _uninstrument(self) -> None:
        views, self._views = self._views, []
        try:
            unhook_views(views)
        except Exception as exc:  # noqa: BLE001 - unhooking must not raise into the user's shutdown
            report_internal_error("openai.uninstrument", exc)
        while self._hooks:
            cls, method, handle = self._hooks.pop()
            try:
                _unwrap(cls, method, handle)
            except Exception as exc:  # noqa: BLE001 - unhooking must not raise into the user's shutdown
                report_internal_error("openai.uninstrument", exc)
