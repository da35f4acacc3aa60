"""Chat messages and tools to prompt text, and generated text back to content and tool calls.

The prompt is the tokenizer's own chat template (``tokenizer.apply_chat_template``) applied to messages
agl first rewrites into plain ``{"role", "content"}`` text, so any template works, including ones that know
nothing of tools. Tools use one documented format (Hermes / Qwen2.5 style), whatever the model:

- the tool definitions go into the system message (appended to the first system message, or a new one),
  inside ``<tools></tools>`` with instructions to answer calls as below;
- the model calls a tool by writing, anywhere in its answer, one block per call::

      <tool_call>
      {"name": "add", "arguments": {"a": 2, "b": 3}}
      </tool_call>

- an assistant message with ``tool_calls`` in the history is rendered the same way (its content, a newline,
  then the blocks separated by newlines), so a model that wrote its calls in this canonical form sees its
  own tokens again in the next prompt;
- ``tool`` results become a user turn ``<tool_response>\\n...\\n</tool_response>`` (consecutive results
  share one turn), as Qwen2.5's template does.

Parsing is all-or-nothing: if every ``<tool_call>`` block holds a JSON object with a string ``name`` (and
``arguments`` an object or a JSON string of one), or a list of such objects (SmolLM2's own format), the
calls are returned and the text outside the blocks
becomes the content (``None`` when empty); if any block fails, no call is returned and the whole text stays
content, so nothing the model wrote is lost. A last block left unclosed still counts, also when its
closing tag was cut short (``...}\\n</tool``). An answer cut by ``max_tokens`` may end in half a call: that
unfinished tail is dropped and the whole calls before it are kept (:func:`parse_output`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agl.openai_wire.apis import CONTEXT_LENGTH_EXCEEDED, BadRequest
from agl.openai_wire.chat_completions import message_text
from agl.openai_wire.stops import partial_suffix_start

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)
_ROLES = ("system", "developer", "user", "assistant", "tool")

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it
    call_id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ParsedOutput:
    content: Optional[str]
    tool_calls: List[ToolCall]


# --- prompt ------------------------------------------------------------------------------------------------


def render_prompt(tokenizer: Any, messages: Sequence[Any], tools: Optional[Sequence[Any]] = None) -> str:
    """The prompt text for ``messages`` (OpenAI chat format) and ``tools``, ending with the assistant cue."""
    plain = to_plain_messages(messages)
    if tools:
        plain = _with_tools(plain, [tool_function(tool, i) for i, tool in enumerate(tools)])
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise BadRequest("the tokenizer's chat template did not produce text", "messages")
    return text


def to_plain_messages(messages: Sequence[Any]) -> List[Dict[str, str]]:
    """OpenAI chat messages as ``{"role", "content"}`` text only (tool calls and results written out)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadRequest("'messages' must be a non-empty list of chat messages", "messages")
    plain: List[Dict[str, str]] = []
    pending_results: List[str] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise BadRequest(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role {role!r} is not one of {', '.join(_ROLES)}", f"{where}.role")
        content = _text(message.get("content"), f"{where}.content")
        if role == "tool":
            pending_results.append(f"<tool_response>\n{content}\n</tool_response>")
            continue
        if pending_results:
            plain.append({"role": "user", "content": "\n".join(pending_results)})
            pending_results = []
        if role == "assistant" and message.get("tool_calls"):
            content = render_assistant(content, _history_calls(message["tool_calls"], where))
        plain.append({"role": "system" if role == "developer" else role, "content": content})
    if pending_results:
        plain.append({"role": "user", "content": "\n".join(pending_results)})
    return plain


def render_assistant(content: str, calls: Sequence[Tuple[str, Any]]) -> str:
    """An assistant turn with tool calls, in the canonical form the model is asked to write."""
    return assistant_text(content, [render_tool_call(name, arguments) for name, arguments in calls])


def render_tool_call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def assistant_text(content: Optional[str], calls: Sequence[str]) -> str:
    """An assistant turn as model text: the content, then each call written out, one per line."""
    return "\n".join(([content] if content else []) + list(calls))


def call_text_prefix(name: str) -> str:
    """What a call written as a bare JSON line (:func:`call_text`) starts with, up to its arguments."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def call_text(name: str, arguments: str) -> str:
    """A tool call as one bare JSON line, its ``arguments`` text embedded as it is (not re-encoded): how agl's
    fake model writes its calls and LightningRL's re-tokenizer renders them for a tokenizer without a chat
    template of its own."""
    return call_text_prefix(name) + arguments + "}"


def _with_tools(plain: List[Dict[str, str]], functions: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    block = f"{TOOLS_PREAMBLE}\n{listing}\n{TOOLS_INSTRUCTIONS}"
    if plain and plain[0]["role"] == "system":
        first = {"role": "system", "content": f"{plain[0]['content']}\n\n{block}" if plain[0]["content"] else block}
        return [first] + plain[1:]
    return [{"role": "system", "content": block}] + plain


def tool_function(tool: Any, index: int) -> Dict[str, Any]:
    """The ``function`` of ``tools[index]``, checked: a named function whose ``parameters``, if sent, are a
    JSON schema object (a string there was rendered into the prompt as it was, and served with a 200)."""
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise BadRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where}.function must be an object with a string 'name'", f"{where}.function")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise BadRequest(
            f"{where}.function.parameters must be a JSON schema object, e.g. {{'type': 'object', 'properties': "
            f"{{...}}}}, not {json.dumps(parameters)[:60]}",
            f"{where}.function.parameters",
        )
    return dict(function)


def _history_calls(calls: Any, where: str) -> List[Tuple[str, Any]]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out: List[Tuple[str, Any]] = []
    for number, call in enumerate(calls):
        at = f"{where}.tool_calls[{number}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{at} must have a 'function' with a string 'name'", at)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # rendered as the string it is: the model sees what it wrote
        out.append((function["name"], arguments if arguments is not None else {}))
    return out


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, list):
        for part in content:
            is_text = isinstance(part, Mapping) and part.get("type") in ("text", "input_text")
            if not (is_text and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise BadRequest(
                    f"{where} has a {kind!r} part: this server's model reads text only; send text parts", where
                )
    elif content is not None and not isinstance(content, str):
        raise BadRequest(f"{where} must be a string, null or a list of text parts", where)
    return message_text(content)


# --- output ------------------------------------------------------------------------------------------------


def parse_output(text: str, tools_offered: bool, cut: bool = False) -> ParsedOutput:
    """Split generated text into content and tool calls (module docs); without tools it is all content.

    ``cut``: ``max_tokens`` cut the answer, so it may end in half a call (often: a forced ``tool_choice``
    writes calls until the limit). That tail is dropped (:func:`_cut_tail_start`) and the whole calls before
    it are kept: a cut answer neither loses its complete calls nor returns ``<tool_call>`` markup as content.
    """
    if not tools_offered:
        return ParsedOutput(_content(text), [])
    if cut:
        kept = _cut_tail_start(text)
        text = text if kept == len(text) else text[:kept].rstrip()  # (the blank before the cut call goes too)
    if TOOL_CALL_OPEN not in text:
        return ParsedOutput(_content(text), [])
    calls: List[ToolCall] = []
    for match in _BLOCK.finditer(text):
        block = _block_calls(match.group(1), closed=bool(match.group(2)))
        if block is None:
            return ParsedOutput(_content(text), [])
        calls.extend(block)
    return ParsedOutput(_content(_BLOCK.sub("", text).rstrip()), calls)  # (the blank before a call goes)


def _cut_tail_start(text: str) -> int:
    """Where the unfinished end of a cut answer starts (``len(text)`` when there is none): a partial
    ``<tool_call>`` tag, and before it a last block that is unclosed and holds no whole call."""
    end = partial_suffix_start(text, (TOOL_CALL_OPEN,))
    opened = text.rfind(TOOL_CALL_OPEN, 0, end)
    if opened < 0 or TOOL_CALL_CLOSE in text[opened:end]:
        return end
    return end if _block_calls(text[opened + len(TOOL_CALL_OPEN) : end], closed=False) is not None else opened


def _block_calls(body: str, closed: bool) -> Optional[List[ToolCall]]:
    """The calls one block holds (an object, or a list of them as SmolLM2 writes); None if it holds none.

    An unclosed block may end in part of its closing tag (``\\n</tool``), where a limit cut it."""
    if not closed:
        body = body[: partial_suffix_start(body, (TOOL_CALL_CLOSE,))]
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = [_parse_call(v) for v in (value if isinstance(value, list) and value else [value])]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _parse_call(value: Any) -> Optional[ToolCall]:
    """One call object, ``{"name": str, "arguments": object or JSON string of one}``; None if malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> Optional[str]:
    """The answer's text as the model wrote it (None if there is none), as vLLM returns it: an agent sends it
    back in its next prompt, which re-tokenizes to the sampled ids only if nothing was stripped (a stripped
    leading or trailing blank broke LightningRL's merging of consecutive calls, ``aggregate=true``)."""
    return text or None


def streamable_prefix(text: str, tools_offered: bool, stops: Sequence[str] = ()) -> str:
    """How much of the text generated so far a stream may send as content without taking anything back.

    Held back: trailing whitespace (a tool call may follow, and the blank before it is dropped), a trailing
    partial character
    (``\\ufffd``), a tail that could still grow into a stop string, and, when tools were offered,
    everything from ``<tool_call>`` (or a tail that could become it) on. What is returned is always a
    prefix of the final content, whatever the model writes next.
    """
    text = text.rstrip("\ufffd")
    end = len(text)
    if tools_offered:
        opened = text.find(TOOL_CALL_OPEN)
        if opened >= 0:
            end = opened
        end = min(end, partial_suffix_start(text[:end], (TOOL_CALL_OPEN,)))
    end = min(end, partial_suffix_start(text[:end], stops))
    return text[:end].rstrip()


__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "BadRequest",
    "ParsedOutput",
    "ToolCall",
    "assistant_text",
    "call_text",
    "call_text_prefix",
    "parse_output",
    "partial_suffix_start",
    "render_assistant",
    "render_prompt",
    "render_tool_call",
    "streamable_prefix",
    "to_plain_messages",
    "tool_function",
]
