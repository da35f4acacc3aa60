"""The Chat Completions wire format of the policy server: request checking and response objects.

Responses follow OpenAI's ``chat.completion`` / ``chat.completion.chunk`` objects plus, always (no request
flag needed), vLLM's ``return_token_ids`` fields and agl's policy version:

- top-level ``prompt_token_ids`` (streamed: on the first chunk) and ``choices[0].token_ids`` (streamed: the
  ids behind each chunk's delta; concatenated they are the response ids);
- top-level ``agl_resources_version`` on every response and chunk (the HTTP header
  ``x-agl-resources-version`` carries it too).

Requests are checked before anything runs: a parameter this server cannot honour gets a 400 naming it and
saying what to send instead, rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agl.openai_wire import chat_completions as chat
from agl.openai_wire.apis import (
    CHAT,
    TOKEN_IDS_REQUEST,
    BadRequest,
    error_body,
    is_int,
    refuse_unknown,
    require,
    require_object,
    response_header,
)
from agl.openai_wire.apis import RESOURCES_VERSION_FIELD as VERSION_FIELD
from agl.openai_wire.chat_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ParsedOutput, ToolCall, tool_function
from agl.openai_wire.logprobs import token_logprobs
from agl.openai_wire.sampling import TOKEN_LIMIT_NAMES
from agl.openai_wire.sse import DONE, data_event
from agl.openai_wire.stops import checked_stops
from agl.serving.generation import Generation, SamplingParams, Token
from agl.serving.structured import answer_schema, response_grammar

VERSION_HEADER = "x-agl-resources-version"
MAX_TOP_LOGPROBS = 20

# Accepted and ignored: they change nothing about the answer this server gives.
_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", TOKEN_IDS_REQUEST, "prompt_cache_key", "safety_identifier"}
)
_SUPPORTED = (
    frozenset(
        {
            "model",
            "messages",
            "tools",
            "tool_choice",
            "stream",
            "stream_options",
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "seed",
            "logprobs",
            "top_logprobs",
            "n",
            "presence_penalty",
            "frequency_penalty",
            "response_format",
            "logit_bias",
            "parallel_tool_calls",
        }
    )
    | _IGNORED
)
# What a trainer may publish as sampling parameters for this server to fill into requests that leave them out.
REQUEST_SETTINGS = _SUPPORTED - {"model", "messages", "stream", "stream_options"} - _IGNORED


@dataclasses.dataclass
class ChatRequest:
    """What a checked request asks for; ``max_tokens`` is None when the server should pick it."""

    model: str
    messages: List[Any]
    tools: List[Any]
    tool_choice: str  # "auto", "none" or "required" (a call is forced)
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    max_tokens: Optional[int]
    temperature: float
    top_p: float
    top_k: int  # 0: off (vLLM's extension, which verl's rollout.top_k sets)
    stop: Tuple[str, ...]
    seed: Optional[int]
    answer_schema: Optional[Dict[str, Any]] = None  # response_format's JSON schema; None: free text
    forced_tool: Optional[str] = None  # tool_choice named this function: every call is to it
    parallel_tool_calls: bool = True  # False: one call at most (enforced where a grammar is in force)

    @property
    def tools_offered(self) -> bool:
        """Whether tool calls are rendered into the prompt and parsed out of the answer."""
        return bool(self.tools) and self.tool_choice != "none"

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop,
            seed=self.seed,
            top_logprobs=self.top_logprobs if self.logprobs else 0,
            grammar=self._grammar(),
            stop_free_blocks=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if self.tools_offered else None,
        )

    def grammar_tools(self) -> List[Tuple[int, Any]]:
        """``(index in tools, tool)`` of the tools whose ``parameters`` the grammar holds."""
        if not self.tools_offered or (self.tool_choice != "required" and self.answer_schema is None):
            return []
        return [(i, t) for i, t in enumerate(self.tools) if self.forced_tool in (None, _tool_name(t))]

    def _grammar(self) -> Optional[str]:
        """A named function means exactly one call, as with OpenAI: allowed more, a model that likes its
        call may write it again until ``max_tokens`` (SmolLM2 does), and the tool runs twice."""
        tools = self.tools if self.tools_offered else []
        one_call = not self.parallel_tool_calls or self.forced_tool is not None
        if self.tool_choice == "required":
            forced = [t for t in tools if self.forced_tool in (None, _tool_name(t))]
            return response_grammar(None, forced, calls_only=True, one_call=one_call)
        return response_grammar(self.answer_schema, tools, one_call=one_call)


def parse_request(body: Any) -> ChatRequest:
    """Check a ``/v1/chat/completions`` body; raises :class:`BadRequest` with a message for the client."""
    require_object(body)
    refuse_unknown(body, _SUPPORTED, _IGNORED)
    n = body.get("n")
    require(n is None or (is_int(n) and n == 1), "n", "only n=1 is supported: send one request per sample")
    for penalty in ("presence_penalty", "frequency_penalty"):
        require(body.get(penalty) in (None, 0, 0.0), penalty, f"{penalty} is not supported: leave it out or send 0")
    require(not body.get("logit_bias"), "logit_bias", "logit_bias is not supported: leave it out")
    model = body.get("model")
    require(isinstance(model, str) and model != "", "model", "'model' must be a non-empty string")
    messages = body.get("messages")
    require(isinstance(messages, list) and bool(messages), "messages", "'messages' must be a non-empty list")
    tools = body.get("tools") or []
    require(isinstance(tools, list), "tools", "'tools' must be a list of function tools")
    for index, tool in enumerate(tools):
        tool_function(tool, index)  # checked even where the prompt leaves the tools out (tool_choice "none")
    tool_choice, forced_tool = _tool_choice(body.get("tool_choice"), tools)
    logprobs = optional_bool(body, "logprobs")
    top_logprobs = body.get("top_logprobs") or 0
    require(
        is_int(top_logprobs) and 0 <= top_logprobs <= MAX_TOP_LOGPROBS,
        "top_logprobs",
        f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}",
    )
    require(not top_logprobs or logprobs, "top_logprobs", "top_logprobs needs logprobs: true")
    stream_options = body.get("stream_options") or {}
    require(isinstance(stream_options, Mapping), "stream_options", "stream_options must be an object")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        stream=optional_bool(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=_top_k(body.get("top_k")),
        stop=checked_stops(body.get("stop")),
        seed=_seed(body.get("seed")),
        answer_schema=answer_schema(body.get("response_format")),
        forced_tool=forced_tool,
        parallel_tool_calls=body.get("parallel_tool_calls") is None or optional_bool(body, "parallel_tool_calls"),
    )


def optional_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    require(value is None or isinstance(value, bool), key, f"{key} must be true or false")
    return bool(value)


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    require(ok, key, f"{key} must be a number from {low:g} to {high:g}")
    return float(value)


def _top_p(body: Mapping[str, Any]) -> float:
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    require(top_p > 0, "top_p", "top_p must be greater than 0 (use temperature 0 for greedy decoding)")
    return top_p


def _top_k(value: Any) -> int:
    """vLLM's ``top_k``: sample among the k most likely tokens; 0 or -1 (vLLM's "off") samples among all."""
    ok = value is None or (is_int(value) and value >= -1)
    require(ok, "top_k", "top_k must be an integer: k >= 1, or 0 or -1 for off")
    return max(0, value or 0)


def _max_tokens(body: Mapping[str, Any]) -> Optional[int]:
    for key in TOKEN_LIMIT_NAMES[CHAT]:
        value = body.get(key)
        if value is not None:
            require(is_int(value) and value >= 1, key, f"{key} must be a positive integer")
            return int(value)
    return None


def _seed(seed: Any) -> Optional[int]:
    require(seed is None or is_int(seed), "seed", "seed must be an integer")
    return None if seed is None else int(seed) % (2**63)


def _tool_choice(choice: Any, tools: List[Any]) -> Tuple[str, Optional[str]]:
    """``(mode, forced function name)``: "required" and a named function are enforced by a grammar."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    named = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = named.get("name") if isinstance(named, Mapping) else None
    if choice != "required" and not isinstance(name, str):
        raise BadRequest(
            f"tool_choice {choice!r} is not supported: send 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    offered = [_tool_name(t) for t in tools]
    require(bool(tools), "tool_choice", f"tool_choice {choice!r} needs tools to call: send 'tools' too")
    require(
        name is None or name in offered, "tool_choice", f"tool_choice names {name!r}, not one of the tools {offered}"
    )
    return "required", name


def _tool_name(tool: Any) -> Optional[str]:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    return function.get("name") if isinstance(function, Mapping) else None


# --- responses ---------------------------------------------------------------------------------------------


class ResponseWriter:
    """Builds the response objects of one request (shared id, timestamps and model name)."""

    def __init__(self, request: ChatRequest, model_name: str, tokenizer: Any, version: int) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.version = version
        self.header = response_header("chatcmpl-", model_name)  # ("object" follows: completion or chunk)

    def final(self, gen: Generation, parsed: ParsedOutput) -> Dict[str, Any]:
        """The finished ``chat.completion`` object."""
        message = chat.assistant_message(parsed.content, [_tool_call(call) for call in parsed.tool_calls], refusal=None)
        logprobs = self._logprobs(gen.tokens)
        choice = chat.choice(message, logprobs, finish_reason(gen, parsed), token_ids=gen.response_ids)
        return {
            **self.header,
            "object": "chat.completion",
            "choices": [choice],
            "usage": usage(gen),
            "prompt_token_ids": gen.prompt_ids,
            VERSION_FIELD: self.version,
        }

    def chunk(
        self,
        delta: Dict[str, Any],
        tokens: Sequence[Token] = (),
        finish: Optional[str] = None,
        prompt_ids: Optional[List[int]] = None,
    ) -> Dict[str, Any]:
        choice = chat.chunk_choice(delta, self._logprobs(tokens), finish, token_ids=[t.token_id for t in tokens])
        chunk: Dict[str, Any] = {**self.header, "object": "chat.completion.chunk", "choices": [choice]}
        if prompt_ids is not None:
            chunk["prompt_token_ids"] = prompt_ids
        if self.request.include_usage:
            chunk["usage"] = None
        chunk[VERSION_FIELD] = self.version
        return chunk

    def usage_chunk(self, gen: Generation) -> Dict[str, Any]:
        return {
            **self.header,
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": usage(gen),
            VERSION_FIELD: self.version,
        }

    def stream_end(
        self, gen: Generation, parsed: ParsedOutput, sent: str, pending: Sequence[Token]
    ) -> List[Dict[str, Any]]:
        """The last chunks of a stream: the rest of the content, one chunk per tool call, the finish reason.

        ``sent`` is the content streamed so far (always a prefix of the final content, see
        ``chat_format.streamable_prefix``); ``pending`` the tokens not yet sent, which ride on the first of
        these chunks so that the chunks' ``token_ids`` add up to the response ids.
        """
        content = parsed.content or ""
        rest = content[len(sent) :] if content.startswith(sent) else ""
        deltas: List[Dict[str, Any]] = [{"content": rest}] if rest else []
        deltas += [{"tool_calls": [{"index": i, **_tool_call(call)}]} for i, call in enumerate(parsed.tool_calls)]
        chunks = [self.chunk(delta, pending if i == 0 else ()) for i, delta in enumerate(deltas)]
        chunks.append(self.chunk({}, () if deltas else pending, finish=finish_reason(gen, parsed)))
        if self.request.include_usage:
            chunks.append(self.usage_chunk(gen))
        return chunks

    # --- the stream, as the server's streaming loop drives it (``AnswerWriter``) ---------------------------

    def stream_start(self, prompt_ids: List[int]) -> List[str]:
        return [data_event(self.chunk({"role": "assistant", "content": ""}, prompt_ids=prompt_ids))]

    def stream_text(self, text: str, tokens: Sequence[Token], first: bool) -> List[str]:
        return [data_event(self.chunk({"content": text}, tokens))]

    def stream_finish(self, gen: Generation, parsed: ParsedOutput, sent: str, pending: Sequence[Token]) -> List[str]:
        return [data_event(chunk) for chunk in self.stream_end(gen, parsed, sent, pending)] + [DONE]

    def stream_error(self, error: Dict[str, Any]) -> str:
        return data_event(error)

    def _logprobs(self, tokens: Sequence[Token]) -> Optional[Dict[str, Any]]:
        if not self.request.logprobs:
            return None
        return {"content": token_logprobs(self.tokenizer, tokens), "refusal": None}


def finish_reason(gen: Generation, parsed: ParsedOutput) -> str:
    if parsed.tool_calls and gen.finish_reason == "stop":
        return "tool_calls"
    return gen.finish_reason


def usage(gen: Generation) -> Dict[str, Any]:
    return chat.usage(len(gen.prompt_ids), len(gen.response_ids))


def _tool_call(call: ToolCall) -> Dict[str, Any]:
    return chat.tool_call(call.call_id, call.name, call.arguments)


__all__ = [
    "MAX_TOP_LOGPROBS",
    "REQUEST_SETTINGS",
    "VERSION_FIELD",
    "VERSION_HEADER",
    "BadRequest",
    "ChatRequest",
    "ResponseWriter",
    "error_body",
    "finish_reason",
    "is_int",
    "optional_bool",
    "parse_request",
    "require",
    "usage",
]
