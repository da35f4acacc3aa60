"""The Responses API (``POST /v1/responses``) of the policy server, on top of its chat completions path.

The OpenAI Agents SDK talks Responses by default (as do ``ChatOpenAI(use_responses_api=True)``, AutoGen's
``OpenAIAgent``, AG2's ``OpenAIResponsesConfig`` and CrewAI's ``api="responses"``), so an agent must be able to
train against agl's own server without switching APIs. A Responses request is checked, mapped to the chat
request it stands for (``instructions`` → a system message, input items → chat messages, flat function
tools → chat tools) and generated exactly like one: the same conversation yields the same prompt token ids
whichever API carried it. The answer is a ``response`` object (or its event stream) with, as on the chat
path, top-level ``prompt_token_ids``, ``response_token_ids`` and ``agl_resources_version`` (streamed: the prompt ids
on ``response.created`` too, and each text delta's ids as its ``token_ids``, as vLLM puts them on chat chunks).

The server keeps no state: ``previous_response_id``, ``conversation`` and stored prompts get a 400 saying to
send the whole conversation as ``input``.

This module imports no torch: the input mapping also serves agl's fake OpenAI server (``agl.testing``).
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Protocol, Sequence

from agl.openai_wire.chat_format import BadRequest, ParsedOutput

if TYPE_CHECKING:
    from agl.serving.engine import Generation, Token

LOGPROBS_INCLUDE = "message.output_text.logprobs"
VERSION_FIELD = "agl_resources_version"

# Accepted and ignored: they change nothing about the answer this server gives.
_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
     "truncation", "reasoning", "include", "stream_options", "max_tool_calls", "background", "return_token_ids"}
)
_SUPPORTED = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "stream", "temperature", "top_p", "max_output_tokens",
     "top_logprobs", "text", "parallel_tool_calls"}
) | _IGNORED
_STATEFUL = ("previous_response_id", "conversation", "prompt")


def token_logprobs(tokenizer: Any, tokens: Sequence["Token"]) -> List[Dict[str, Any]]:
    """Sampled tokens' logprob entries as both APIs carry them: text, logprob, UTF-8 bytes, top alternatives."""
    return [
        {**_logprob_entry(tokenizer, t.token_id, t.logprob),
         "top_logprobs": [_logprob_entry(tokenizer, i, lp) for i, lp in t.top_logprobs]}
        for t in tokens
    ]


def _logprob_entry(tokenizer: Any, token_id: int, logprob: float) -> Dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token_id, text))}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> bytes:
    """The token's own bytes, so that joining a response's ``bytes`` rebuilds its UTF-8 text (OpenAI's purpose
    for the field). ``text`` (the token decoded alone) serves unless it holds U+FFFD: the token is part of a
    multi-byte character, whose decoded text is the replacement character, not its bytes. Those come from
    the vocabulary piece: byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3) spells each byte as one character,
    SentencePiece writes a lone byte as ``<0xNN>``."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        decoder = _byte_decoder()
        if piece and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    return text.encode("utf-8")  # no byte-level view of this vocabulary: what it decodes to


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


def message_text(content: Any) -> str:
    """The text of a chat/responses message content, which is a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def conversation(body: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The request's ``instructions`` and ``input`` as chat messages."""
    messages: List[Dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": message_text(body["instructions"])})
    items = body["input"]
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        _append_input_item(messages, item)
    return messages


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Flat Responses function tools (``{"type": "function", "name", ...}``) in the chat format."""
    return [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
        for t in tools
        if t.get("type") == "function"
    ]


def _append_input_item(messages: List[Dict[str, Any]], item: Mapping[str, Any]) -> None:
    """Map one input item; calls join the preceding assistant message, as they were one model turn."""
    kind = item.get("type", "message")
    if kind == "message":
        messages.append({"role": item["role"], "content": message_text(item.get("content"))})
    elif kind == "function_call":
        function = {"name": item["name"], "arguments": item["arguments"]}
        call = {"id": item["call_id"], "type": "function", "function": function}
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": None})
        messages[-1].setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else message_text(output)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
    else:
        raise BadRequest(
            f"input item type {kind!r} is not supported: agl's policy server takes messages, function_call and "
            "function_call_output items",
            "input",
        )


_TEXT_PARTS = ("input_text", "output_text", "text")


def _check_item(item: Any, index: int) -> None:
    """An input item is an object whose content parts, if any, are text (this server reads text only)."""
    if not isinstance(item, Mapping):
        raise BadRequest(f"input[{index}] must be an object", "input")
    content = item.get("content")
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind not in _TEXT_PARTS:
                raise BadRequest(
                    f"input[{index}].content has a {kind!r} part: agl's policy server reads text only "
                    f"({', '.join(_TEXT_PARTS)} parts)",
                    "input",
                )


def to_chat_body(body: Any) -> Dict[str, Any]:
    """Check a ``/v1/responses`` body and return the ``/v1/chat/completions`` body it stands for.

    Raises :class:`BadRequest` naming the Responses parameter; the chat path then checks the shared ones
    (temperature, top_p, tool_choice, top_logprobs) with the same names.
    """
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    for key in _STATEFUL:
        if body.get(key):
            raise BadRequest(
                f"{key} is not supported: agl's policy server stores no responses or prompts; send the whole "
                "conversation as 'input'",
                key,
            )
    unknown = sorted(k for k in set(body) - _SUPPORTED if k not in _STATEFUL)
    if unknown:
        raise BadRequest(
            f"unsupported parameter(s) {', '.join(map(repr, unknown))}: agl's policy server accepts "
            f"{', '.join(sorted(_SUPPORTED - _IGNORED))}",
            unknown[0],
        )
    if body.get("background"):
        raise BadRequest("background responses are not supported: leave 'background' out", "background")
    items = body.get("input")
    if not (isinstance(items, str) and items) and not (isinstance(items, list) and items):
        raise BadRequest("'input' must be a non-empty string or a non-empty list of input items", "input")
    if not isinstance(items, str):
        for index, item in enumerate(items):
            _check_item(item, index)
    text = body.get("text")
    if text is not None and not isinstance(text, Mapping):
        raise BadRequest("'text' must be an object such as {'format': {'type': 'text'}}", "text")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or any(not isinstance(t, Mapping) or t.get("type") != "function" for t in tools):
        raise BadRequest("'tools' must be a list of function tools ({'type': 'function', 'name': ...})", "tools")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise BadRequest("max_output_tokens must be a positive integer", "max_output_tokens")
    try:
        messages = conversation(body)
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"an input item is missing a field or has a wrong type: {exc!r}", "input") from None
    top_logprobs = body.get("top_logprobs") or 0
    chat: Dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "tools": chat_tools(tools),
        "stream": body.get("stream"),
        "top_logprobs": top_logprobs,
    }
    if max_tokens is not None:  # (left out, the server's default for requests that leave it out applies)
        chat["max_tokens"] = max_tokens
    if LOGPROBS_INCLUDE in (body.get("include") or []) or top_logprobs:
        chat["logprobs"] = True
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if text and text.get("format") is not None:
        chat["response_format"] = _chat_response_format(text["format"])
    return chat


def _chat_tool_choice(choice: Any) -> Any:
    """A flat named-function ``tool_choice`` (``{"type": "function", "name": ...}``) in the chat form."""
    if isinstance(choice, Mapping) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _chat_response_format(text_format: Any) -> Any:
    """``text.format`` as the chat ``response_format`` it stands for (flat json_schema fields are nested)."""
    if isinstance(text_format, Mapping) and text_format.get("type") == "json_schema":
        spec = {k: text_format[k] for k in ("name", "description", "schema", "strict") if k in text_format}
        return {"type": "json_schema", "json_schema": spec}
    return text_format


def in_responses_terms(exc: BadRequest) -> BadRequest:
    """A 400 from the chat path, named as a Responses client sent it (``input``, ``max_output_tokens``,
    ``text.format``).

    Chat messages stand for input items, but not one to one (``instructions`` comes first, calls join the
    assistant turn), so ``messages[3].role`` becomes ``input``, not an index into it.
    """
    param = exc.param or ""
    if param.startswith("messages"):
        param = "input"
    elif param in ("max_tokens", "max_completion_tokens"):
        param = "max_output_tokens"
    elif param == "response_format":
        param = "text.format"
    param = param.replace(".function.parameters", ".parameters")  # Responses function tools are flat
    message = str(exc).replace("max_tokens", "max_output_tokens").replace("response_format", "text.format")
    message = message.replace(".function.parameters", ".parameters")
    return BadRequest(message, param or None, exc.code)


class AnswerWriter(Protocol):
    """What the server asks of either API's writer (the chat ``openai_api.ResponseWriter`` and
    :class:`ResponsesWriter`): the finished object, and a stream as SSE lines."""

    def final(self, gen: "Generation", parsed: ParsedOutput) -> Dict[str, Any]: ...

    def stream_start(self, prompt_ids: List[int]) -> List[str]: ...

    def stream_text(self, text: str, tokens: Sequence["Token"], first: bool) -> List[str]: ...

    def stream_finish(self, gen: "Generation", parsed: ParsedOutput, sent: str, pending: Sequence["Token"]) -> List[str]: ...

    def stream_error(self, error: Dict[str, Any]) -> str: ...


def response_object(
    body: Mapping[str, Any], response_id: str, created_at: float, model: str, status: str, output: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """A ``response`` object's fields, most echoed from the request (also the fake server's)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "model": model,
        "output": output,
        "instructions": body.get("instructions"),
        "tools": list(body.get("tools") or []),
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "metadata": body.get("metadata") or {},
        "text": body.get("text") or {"format": {"type": "text"}},
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


class ResponsesWriter:
    """The ``response`` object and stream events of one request (one response id, item ids fixed once)."""

    def __init__(self, body: Mapping[str, Any], model_name: str, tokenizer: Any, version: int, with_logprobs: bool) -> None:
        self.body = body
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.version = version
        self.with_logprobs = with_logprobs
        self.response_id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created_at = time.time()
        self._sequence = 0

    # --- objects ----------------------------------------------------------------------------------------------

    def final(self, gen: "Generation", parsed: ParsedOutput) -> Dict[str, Any]:
        """The finished ``response`` object."""
        result = self._shell("completed", self.items(gen, parsed))
        if gen.finish_reason == "length":
            result["status"] = "incomplete"
            result["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            result["completed_at"] = time.time()
        prompt, answer = len(gen.prompt_ids), len(gen.response_ids)
        result["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + answer,
        }
        result["prompt_token_ids"] = gen.prompt_ids
        result["response_token_ids"] = gen.response_ids
        return result

    def items(self, gen: "Generation", parsed: ParsedOutput) -> List[Dict[str, Any]]:
        """The output items: the message, then the function calls.

        The answer's logprobs (of all its tokens, the calls' included) ride on the message's ``output_text``
        part, the one place the Responses format has for them. An answer of calls only therefore gets a
        message with empty text ahead of its calls when logprobs were asked for (a trainer asks for them):
        without it, the recorder found no logprobs for a tool-call turn and the trainer lost the server's
        (those of grammar-forced tokens among them). Sent back as input, an empty message followed by the
        calls renders the same prompt as the calls alone.
        """
        items: List[Dict[str, Any]] = []
        logprobs = self.logprobs(gen.tokens)
        if parsed.content or not parsed.tool_calls or logprobs:
            items.append(self._message(parsed.content or "", logprobs, "completed"))
        for call in parsed.tool_calls:
            items.append(
                {"id": "fc_" + call.call_id, "type": "function_call", "call_id": call.call_id, "name": call.name,
                 "arguments": call.arguments, "status": "completed"}
            )
        return items

    def logprobs(self, tokens: Sequence["Token"]) -> List[Dict[str, Any]]:
        return token_logprobs(self.tokenizer, tokens) if self.with_logprobs else []

    def _message(self, text: str, logprobs: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": [part]}

    def _shell(self, status: str, output: List[Dict[str, Any]]) -> Dict[str, Any]:
        shell = response_object(self.body, self.response_id, self.created_at, self.model_name, status, output)
        shell[VERSION_FIELD] = self.version
        return shell

    # --- the stream, as the server's streaming loop drives it (``AnswerWriter``) ------------------------------

    def stream_start(self, prompt_ids: List[int]) -> List[str]:
        """``response.created`` and ``response.in_progress``, with the prompt's ids; each text delta carries
        its tokens' ids (``token_ids``), so a stream the agent stops reading still has the ids of what it read
        (the final response carries them all again)."""
        shell = self._shell("in_progress", [])
        shell["prompt_token_ids"] = prompt_ids
        return [self.sse({"type": kind, "response": shell}) for kind in ("response.created", "response.in_progress")]

    def stream_text(self, text: str, tokens: Sequence["Token"], first: bool) -> List[str]:
        """A text delta; the first one opens the message item and its text part."""
        return [self.sse(event) for event in (self._message_opened() if first else []) + [self._text_delta(text, tokens)]]

    def stream_finish(self, gen: "Generation", parsed: ParsedOutput, sent: str, pending: Sequence["Token"]) -> List[str]:
        """After the streamed text (a prefix of the final content): its rest, the message closed, each tool
        call, then ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``)."""
        final = self.final(gen, parsed)
        events: List[Dict[str, Any]] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                part = item["content"][0]
                events += [] if sent else self._message_opened()
                rest = part["text"][len(sent) :]
                events += [self._text_delta(rest, pending)] if rest else []
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                events.append({"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]})
                events.append({"type": "response.content_part.done", **where, "part": part})
            else:
                started = {**item, "status": "in_progress", "arguments": ""}
                where = {"item_id": item["id"], "output_index": index}
                events += [
                    {"type": "response.output_item.added", "output_index": index, "item": started},
                    {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
                ]
            events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append({"type": kind, "response": final})
        return [self.sse(event) for event in events]

    def stream_error(self, error: Dict[str, Any]) -> str:
        """An ``error`` event; its top-level ``error`` makes the ``openai`` client raise ``APIError``."""
        return self.sse({"type": "error", **error})

    def _message_opened(self) -> List[Dict[str, Any]]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        item = {**self._message("", [], "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.content_part.added", **where, "part": part},
        ]

    def _text_delta(self, text: str, tokens: Sequence["Token"]) -> Dict[str, Any]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return {"type": "response.output_text.delta", **where, "delta": text, "logprobs": self.logprobs(tokens),
                "token_ids": [t.token_id for t in tokens]}

    def sse(self, event: Dict[str, Any]) -> str:
        """One named SSE event with its sequence number (Responses streams end without ``[DONE]``)."""
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
