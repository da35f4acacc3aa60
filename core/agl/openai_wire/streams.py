"""Streamed OpenAI answers reassembled: accumulators that read a stream's items (the SDK's chunk and event
objects) and record the answer they add up to, as a non-streamed one is recorded (:mod:`agl.openai_wire.
payloads`), also when the stream ended early.

The client hook feeds them from the SDK's streams (:mod:`agl.instrumentation.openai_stream_proxies`), the
recording proxy from the SSE lines it relays (:func:`sdk_stream_item`). Per item they do a few attribute
reads and list appends; joining text and building messages waits for the writer thread (a callable deferred
attribute).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Protocol, Tuple

from agl import semconv
from agl.openai_wire.apis import CHAT, COMPLETIONS, RESOURCES_VERSION_FIELD, RESPONSES
from agl.openai_wire.chat_completions import assistant_message, tool_call
from agl.openai_wire.logprobs import chat_logprob_values, logprob_of
from agl.openai_wire.payloads import (
    record_completion_header,
    record_completion_token_ids,
    record_resources_version,
    record_token_ids,
    response_attributes,
)
from agl.tracing.encoding import Computed

Failure = Tuple[str, str]  # (error.type, message) of a failure the server reported inside the stream


class Accumulator(Protocol):
    failure: Optional[Failure]

    def add(self, item: Any) -> None: ...

    def finished(self) -> bool:
        """Whether the server said the response is complete (every choice has its finish reason, or the
        Responses API's last snapshot is final): a stream closed before that was abandoned by the agent."""
        ...

    def record(self, deferred: Dict[str, Any]) -> List[str]:
        """Put what the stream carried into the span's deferred attributes; return the finish reasons.

        Called also for a stream that ended before the server finished (``finished()`` False): what arrived
        is recorded, and no token id source unless ids arrived (see ``record_token_ids``)."""
        ...


# --- chat completions --------------------------------------------------------------------------------------


class _ToolCall:
    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id: Optional[str] = None
        self.name: Optional[str] = None
        self.arguments: List[str] = []


class _Choice:
    __slots__ = ("content", "tool_calls", "finish_reason")

    def __init__(self) -> None:
        self.content: List[str] = []
        self.tool_calls: Dict[int, _ToolCall] = {}
        self.finish_reason: Optional[str] = None

    def add_tool_calls(self, deltas: Any) -> None:
        """Tool calls arrive by index: the first delta has id and name, later ones argument fragments."""
        for delta in deltas:
            call = self.tool_calls.get(delta.index)
            if call is None:
                call = self.tool_calls[delta.index] = _ToolCall()
            if delta.id:
                call.id = delta.id
            function = delta.function
            if function is not None:
                if function.name:
                    call.name = function.name
                if function.arguments:
                    call.arguments.append(function.arguments)

    def message(self) -> Dict[str, Any]:
        """The assistant message as the non-streamed API would have returned it."""
        message: Dict[str, Any] = {"role": "assistant"}
        if self.content:
            message["content"] = "".join(self.content)
        if self.tool_calls:
            message["tool_calls"] = [
                tool_call(call.id, call.name, "".join(call.arguments)) for _, call in sorted(self.tool_calls.items())
            ]
        return message


class _TokenStream:
    """What chat and completions streams share: the response's id, model and usage, the policy version, and
    choice 0's token ids and logprobs (vLLM sends the ids of each chunk's delta)."""

    __slots__ = ("response_id", "model", "usage", "prompt_ids", "response_ids", "logprobs", "failure", "version")

    def __init__(self) -> None:
        self.response_id: Optional[str] = None
        self.model: Optional[str] = None
        self.usage: Any = None
        self.prompt_ids: Optional[List[int]] = None
        self.response_ids: Optional[List[int]] = None
        self.logprobs: List[float] = []
        self.failure: Optional[Failure] = None
        self.version: Any = None  # agl's policy server: the policy version that answered

    def _add_header(self, chunk: Any) -> None:
        if self.response_id is None:
            self.response_id = chunk.id
            self.model = chunk.model
            extra = chunk.model_extra
            self.version = extra.get(RESOURCES_VERSION_FIELD) if extra else None
        if chunk.usage is not None:
            self.usage = chunk.usage

    def _add_ids(self, source: Any) -> None:
        """``prompt_token_ids`` (the first time a chunk or choice has them) and ``token_ids`` of ``source``."""
        extra = source.model_extra
        if not extra:
            return
        if self.prompt_ids is None:
            self.prompt_ids = extra.get("prompt_token_ids")
        ids = extra.get("token_ids")
        if ids is not None:
            if self.response_ids is None:
                self.response_ids = []
            self.response_ids.extend(ids)

    def _record_header(self, deferred: Dict[str, Any]) -> None:
        record_completion_header(self.response_id, self.model, self.usage, deferred)
        record_resources_version(self.version, deferred)
        if self.logprobs:
            deferred[semconv.RESPONSE_LOGPROBS] = self.logprobs


class ChatStreamAccumulator(_TokenStream):
    """Rebuilds a chat completion from ``ChatCompletionChunk`` objects (token ids of choice 0; the prompt ids
    are on the first chunk)."""

    __slots__ = ("choices",)

    def __init__(self) -> None:
        super().__init__()
        self.choices: Dict[int, _Choice] = {}

    def add(self, chunk: Any) -> None:
        self._add_header(chunk)
        if self.prompt_ids is None:
            extra = chunk.model_extra
            if extra:
                self.prompt_ids = extra.get("prompt_token_ids")
        for choice in chunk.choices:
            index = choice.index
            state = self.choices.get(index)
            if state is None:
                state = self.choices[index] = _Choice()
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    state.content.append(delta.content)
                if delta.tool_calls:
                    state.add_tool_calls(delta.tool_calls)
            if choice.finish_reason:
                state.finish_reason = choice.finish_reason
            if index == 0:
                self._add_ids(choice)
                logprobs = choice.logprobs
                if logprobs is not None and logprobs.content:
                    self.logprobs.extend(chat_logprob_values(logprobs.content))

    def finished(self) -> bool:
        return bool(self.choices) and all(state.finish_reason for state in self.choices.values())

    def record(self, deferred: Dict[str, Any]) -> List[str]:
        self._record_header(deferred)
        choices = [state for _, state in sorted(self.choices.items())]
        if choices:
            deferred[semconv.OUTPUT_MESSAGES] = Computed(functools.partial(_messages, choices))
        record_token_ids(self.prompt_ids, self.response_ids, deferred, self.finished())
        return [state.finish_reason for state in choices if state.finish_reason]


def _messages(choices: List[_Choice]) -> List[Dict[str, Any]]:
    return [state.message() for state in choices]


# --- completions (legacy text API) ------------------------------------------------------------------------


class CompletionStreamAccumulator(_TokenStream):
    """Rebuilds a (legacy) ``Completion`` from its streamed chunks: text per choice, choice 0's ids (the
    prompt ids are on the first chunk's choice) and logprobs."""

    __slots__ = ("texts", "reasons")

    def __init__(self) -> None:
        super().__init__()
        self.texts: Dict[int, List[str]] = {}
        self.reasons: Dict[int, str] = {}

    def add(self, chunk: Any) -> None:
        self._add_header(chunk)
        for choice in chunk.choices:
            index = choice.index
            if choice.text:
                self.texts.setdefault(index, []).append(choice.text)
            if choice.finish_reason:
                self.reasons[index] = choice.finish_reason
            if index == 0:
                self._add_ids(choice)
                logprobs = choice.logprobs
                if logprobs is not None and logprobs.token_logprobs:
                    self.logprobs.extend(logprobs.token_logprobs)

    def finished(self) -> bool:
        return bool(self.reasons) and set(self.texts) <= set(self.reasons)

    def record(self, deferred: Dict[str, Any]) -> List[str]:
        self._record_header(deferred)
        indexes = sorted(set(self.texts) | set(self.reasons))
        deferred[semconv.OUTPUT_MESSAGES] = Computed(
            functools.partial(_completion_messages, [self.texts.get(i, []) for i in indexes])
        )
        record_completion_token_ids(self.prompt_ids, self.response_ids, deferred, self.finished())
        return [self.reasons[i] for i in indexes if i in self.reasons]


def _completion_messages(texts: List[List[str]]) -> List[Dict[str, Any]]:
    return [{"role": "assistant", "content": "".join(parts)} for parts in texts]


# --- responses ---------------------------------------------------------------------------------------------

_SNAPSHOT_EVENTS = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)


_FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


def _field(value: Any, name: str) -> Any:
    """``value.name``, or ``value[name]`` for a dict: older ``openai`` SDKs (1.66) build a Responses event whose
    snapshot lacks fields their model requires (an ``in_progress`` shell) as another event type, whose
    ``response`` (or ``item``) then stays a plain dict."""
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


class _OutputItem:
    """One output item of a Responses stream as it arrives: a message's text, or a function call's arguments."""

    __slots__ = ("kind", "call_id", "name", "parts")

    def __init__(self, item: Any) -> None:
        self.kind = _field(item, "type")
        self.call_id = _field(item, "call_id")
        self.name = _field(item, "name")
        self.parts: List[str] = []  # text deltas (message) or argument fragments (function call)


class ResponsesStreamAccumulator:
    """Keeps the latest ``response`` snapshot of a Responses stream (``response.completed`` has it all) and,
    for a stream that ends before that, what its events carried: the output items' text and argument deltas,
    text logprobs, and the token ids of a server that puts them on its deltas (``token_ids``, as vLLM does
    per chat chunk; agl's servers send the ids with the final response only)."""

    __slots__ = ("response", "failure", "with_logprobs", "items", "tokens")

    def __init__(self, with_logprobs: bool) -> None:
        self.response: Any = None
        self.failure: Optional[Failure] = None
        self.with_logprobs = with_logprobs
        self.items: Dict[int, _OutputItem] = {}
        self.tokens = _TokenStream()  # prompt / response ids and logprobs that arrived before the final snapshot

    def add(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        if kind in _SNAPSHOT_EVENTS:
            self.response = event.response
            if kind == "response.failed":
                error = _field(event.response, "error")
                self.failure = (_field(error, "code") or kind, _field(error, "message") or kind)
        elif kind == "error":
            self.failure = (getattr(event, "code", None) or kind, getattr(event, "message", None) or kind)
        elif kind == "response.output_item.added":
            self.items[event.output_index] = _OutputItem(event.item)
        elif kind in _DELTA_EVENTS:
            self._add_delta(event)

    def _add_delta(self, event: Any) -> None:
        item = self.items.get(event.output_index)
        if item is None:  # a delta without its output_item.added: keep it anyway
            item = self.items[event.output_index] = _OutputItem(None)
            item.kind = "message" if event.type == "response.output_text.delta" else "function_call"
        item.parts.append(event.delta)
        self.tokens._add_ids(event)
        for entry in getattr(event, "logprobs", None) or ():
            self.tokens.logprobs.append(logprob_of(entry))

    def finished(self) -> bool:
        return (
            self.response is not None
            and not isinstance(self.response, dict)
            and (getattr(self.response, "status", None) in _FINAL_STATUSES)
        )

    def record(self, deferred: Dict[str, Any]) -> List[str]:
        if self.finished():
            return response_attributes(self.response, deferred, self.with_logprobs)
        self._record_partial(deferred)
        return []

    def _record_partial(self, deferred: Dict[str, Any]) -> None:
        """A stream that ended before its final event (abandoned, cut): recorded like a chat stream cut at the
        same point, from the last snapshot's header and the deltas that arrived."""
        tokens = self.tokens
        if self.response is not None:
            tokens.response_id, tokens.model = _field(self.response, "id"), _field(self.response, "model")
            extra = self.response if isinstance(self.response, dict) else (self.response.model_extra or {})
            tokens.version = extra.get(RESOURCES_VERSION_FIELD)
            if tokens.prompt_ids is None:
                tokens.prompt_ids = extra.get("prompt_token_ids")
        tokens._record_header(deferred)
        if self.items:
            items = [item for _, item in sorted(self.items.items())]
            deferred[semconv.OUTPUT_MESSAGES] = Computed(functools.partial(_partial_messages, items))
        record_token_ids(tokens.prompt_ids, tokens.response_ids, deferred, complete=False)


_DELTA_EVENTS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


def _partial_messages(items: List[_OutputItem]) -> List[Dict[str, Any]]:
    texts = ["".join(item.parts) for item in items if item.kind == "message"]
    calls = [tool_call(item.call_id, item.name, "".join(item.parts)) for item in items if item.kind == "function_call"]
    return [assistant_message("".join(texts) or None, calls)]


def new_accumulator(api: str, with_logprobs: bool) -> Accumulator:
    """The accumulator for a stream of ``api`` (``with_logprobs``: the request asked for logprobs)."""
    if api == CHAT:
        return ChatStreamAccumulator()
    if api == COMPLETIONS:
        return CompletionStreamAccumulator()
    return ResponsesStreamAccumulator(with_logprobs)


def sdk_stream_item(api: str, data: Dict[str, Any], event: Optional[str] = None) -> Any:
    """A streamed item's JSON as the SDK object the accumulator reads on the client side, built without
    validation as the SDK builds it: a chat or completions chunk, or a Responses event as its typed model, so
    every field the accumulator reads (the snapshot's ``response``, a delta's ``output_index`` and
    ``logprobs``, a server's extra ``token_ids``) is there. ``event``: the SSE ``event:`` name, the type of a
    Responses event whose data does not say it."""
    if api == RESPONSES:
        from openai._models import construct_type
        from openai.types.responses import ResponseStreamEvent

        if not data.get("type") and event:
            data = {**data, "type": event}
        return construct_type(type_=ResponseStreamEvent, value=data)
    if api == CHAT:
        from openai.types.chat import ChatCompletionChunk

        return ChatCompletionChunk.construct(**data)
    from openai.types import Completion

    return Completion.construct(**data)
