"""The scripted fake *model* behind :class:`~agl.testing.FakeOpenAIServer`.

Tests and demos run real agent frameworks against a real HTTP server; only the model is fake. This module
holds everything model-side and independent of the wire format: the scripted :class:`FakeReply`, the
deterministic default policy, the byte-level :class:`FakeTokenizer` with its ChatML template, and
:class:`Generation` (one sampled answer with its token ids and logprobs). The HTTP layers only serialize it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.openai_wire.chat_completions import message_text
from agl.openai_wire.chat_format import assistant_text, call_text, call_text_prefix
from agl.openai_wire.logprobs import logprob_entry

ToolCallSpec = Mapping[str, Any]
"""A scripted call, ``{"name": "add", "arguments": {"a": 1} | '{"a": 1}', "id"?: "call_..."}``."""

ChatTool = Mapping[str, Any]
"""A tool in the chat completions format, ``{"type": "function", "function": {"name", "parameters"}}``."""

ToolChoice = str | Mapping[str, Any] | None
"""``"auto" | "none" | "required"`` or a named function, in the chat or the Responses spelling."""

#: A calculator tool for tests and examples: the default policy calls it with the question's numbers.
ADD_TOOL: ChatTool = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"\S+\s*|\s+")
_ARGUMENT_PIECE = 8  # characters of tool call arguments per streamed delta


@dataclass(frozen=True)
class FakeReply:
    """One scripted model reply, consumed by the next generation request (chat or responses).

    ``tool_calls`` entries are ``{"name": ..., "arguments": dict | str}``; a raw string is sent verbatim so
    tests can feed malformed JSON to a framework. A reply with neither ``content`` nor ``tool_calls`` lets
    the default policy choose the message, so ``FakeReply(delay=2)`` or ``FakeReply(break_stream_after=3)``
    only perturbs the transport. ``status_code >= 400`` answers an OpenAI-style error instead.
    """

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    status_code: int = 200
    error_message: str | None = None
    delay: float = 0.0
    break_stream_after: int | None = None

    @property
    def is_error(self) -> bool:
        return self.status_code >= 400

    @property
    def chooses_message(self) -> bool:
        """Whether the script fixes the message, rather than leaving it to the default policy."""
        return self.content is not None or bool(self.tool_calls)


@dataclass(frozen=True)
class GeneratedToolCall:
    """A tool call as the model "sampled" it: ``arguments`` is the exact JSON text it produced."""

    call_id: str
    name: str
    arguments: str

    def render(self) -> str:
        """The call as model text, ``{"name": ..., "arguments": ...}``.

        The arguments are embedded raw (not re-encoded), so malformed arguments stay malformed and a dict's
        rendering equals ``json.dumps({"name": name, "arguments": args})``. Streams send the prefix with the
        call's header, so the token ids of the deltas still concatenate to the ids of this text.
        """
        return call_text(self.name, self.arguments)

    def render_prefix(self) -> str:
        return call_text_prefix(self.name)

    def argument_pieces(self) -> list[str]:
        """The arguments as streamed: short fragments, at least one so every call gets a delta."""
        args = self.arguments
        return [args[i : i + _ARGUMENT_PIECE] for i in range(0, len(args), _ARGUMENT_PIECE)] or [""]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_from_spec(spec: ToolCallSpec) -> GeneratedToolCall:
    arguments = spec.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return GeneratedToolCall(call_id=spec.get("id") or new_call_id(), name=spec["name"], arguments=text)


def render_assistant(content: str | None, tool_calls: Sequence[GeneratedToolCall]) -> str:
    """The assistant turn as model text: the content, then one rendered call per line.

    Used for both the response token ids and the chat template, so a later prompt that replays this turn
    contains exactly the ids the model produced (the property RL training relies on).
    """
    return assistant_text(content, [call.render() for call in tool_calls])


class FakeTokenizer:
    """A deterministic byte-level tokenizer: one token per UTF-8 byte, so any text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def token_text(self, token_id: int) -> str:
        """The text of one byte token; bytes that are not whole characters read as ``\\xNN`` (as OpenAI)."""
        return bytes([token_id]).decode("utf-8", "backslashreplace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """ChatML with a tools preamble and the generation prompt, as the fake server tokenizes prompts."""
        blocks = [_chatml(m["role"], _template_content(m)) for m in messages]
        if tools:
            blocks.insert(0, _chatml("system", "# Tools\n\n" + "\n".join(json.dumps(t) for t in tools)))
        return "".join(blocks) + "<|im_start|>assistant\n"


def _chatml(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _template_content(message: Mapping[str, Any]) -> str:
    calls = [
        GeneratedToolCall(call.get("id", ""), call["function"]["name"], call["function"].get("arguments") or "")
        for call in message.get("tool_calls") or []
    ]
    return render_assistant(message_text(message.get("content")), calls)


def fake_logprob(index: int) -> float:
    """A deterministic, varying logprob for the response token at ``index``."""
    return -0.05 * (1 + index % 3)


@dataclass(frozen=True)
class Generation:
    """One model answer with the token ids and logprobs a vLLM-like server would report for it."""

    content: str | None
    tool_calls: list[GeneratedToolCall]
    prompt_ids: list[int]
    response_ids: list[int]
    tokenizer: FakeTokenizer = field(repr=False)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"

    def text_pieces(self) -> list[str]:
        """The content as streamed: one delta per word with its trailing whitespace."""
        return _WORD.findall(self.content or "")

    def logprobs(self, ids: Sequence[int], start: int) -> list[dict[str, Any]]:
        """Chat-style logprob entries for ``ids``, which begin at response position ``start``."""
        return [
            logprob_entry(self.tokenizer.token_text(token_id), fake_logprob(start + offset), [token_id], [])
            for offset, token_id in enumerate(ids)
        ]


def generate(
    reply: FakeReply | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[ChatTool],
    tool_choice: ToolChoice,
    tokenizer: FakeTokenizer,
) -> Generation:
    """Answer ``messages`` (chat format) with the scripted reply, or the default policy without one."""
    if reply is not None and reply.chooses_message:
        content, calls = reply.content, [tool_call_from_spec(spec) for spec in reply.tool_calls or []]
    else:
        content, calls = default_policy(messages, tools, tool_choice)
    prompt = tokenizer.apply_chat_template(messages, tools or None)
    return Generation(
        content=content,
        tool_calls=calls,
        prompt_ids=tokenizer.encode(prompt),
        response_ids=tokenizer.encode(render_assistant(content, calls)),
        tokenizer=tokenizer,
    )


def default_policy(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[ChatTool],
    tool_choice: ToolChoice,
) -> tuple[str | None, list[GeneratedToolCall]]:
    """Call a tool until one has answered the question, then answer from its result.

    The question is the last user message; in a tool loop (tools offered), one without numbers that follows
    a tool's answer is the framework's nudge (CrewAI's "Analyze the tool result..."), not a new question, so
    that answer still counts. The tool is the one ``tool_choice`` names, else the first offered;
    ``tool_choice="none"`` never calls.
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    user_text = message_text(messages[last_user].get("content")) if last_user >= 0 else ""
    nudge = bool(tools) and not _NUMBER.search(user_text)
    answered_from = 0 if nudge else last_user + 1
    tool_results = [m for m in messages[answered_from:] if m.get("role") == "tool"]
    if tool_results:
        return f"The answer is {message_text(tool_results[-1].get('content'))}.", []
    tool = _chosen_tool(tools, tool_choice)
    if tool is None:
        return f"FAKE: {user_text}", []
    function = tool["function"]
    arguments = _fill_arguments(function.get("parameters") or {}, user_text)
    return None, [GeneratedToolCall(new_call_id(), function["name"], json.dumps(arguments))]


def _chosen_tool(tools: Sequence[ChatTool], tool_choice: ToolChoice) -> ChatTool | None:
    functions = [t for t in tools if t.get("type", "function") == "function" and "function" in t]
    if not functions or tool_choice == "none":
        return None
    if isinstance(tool_choice, Mapping):
        wanted = (tool_choice.get("function") or tool_choice).get("name")
        return next((t for t in functions if t["function"]["name"] == wanted), functions[0])
    return functions[0]


def _fill_arguments(schema: Mapping[str, Any], user_text: str) -> dict[str, Any]:
    """Fill the schema's properties in order: numbers from the user text, the text itself for strings."""
    numbers = iter(_NUMBER.findall(user_text))
    properties = schema.get("properties") or {}
    return {name: _fake_value(_json_type(prop), numbers, user_text) for name, prop in properties.items()}


def _json_type(prop: Mapping[str, Any]) -> str:
    """The first non-null type of a property, also through ``anyOf`` (how pydantic writes ``Optional``)."""
    candidates = prop.get("type", [])
    candidates = [candidates] if isinstance(candidates, str) else list(candidates)
    candidates += [alt.get("type") for alt in prop.get("anyOf", []) + prop.get("oneOf", [])]
    return next((t for t in candidates if isinstance(t, str) and t != "null"), "string")


def _fake_value(json_type: str, numbers: Iterator[str], user_text: str) -> Any:
    if json_type in ("integer", "number"):
        number = next(numbers, "0")
        return float(number) if json_type == "number" and "." in number else int(float(number))
    return {"boolean": True, "array": [], "object": {}}.get(json_type, user_text)
