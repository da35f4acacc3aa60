"""The Responses API (``POST /v1/responses``) on the wire: a request as the chat request it stands for, and the
``response`` object, its output items and its stream events.

The OpenAI Agents SDK talks Responses by default (as do ``ChatOpenAI(use_responses_api=True)``, AutoGen's
``OpenAIAgent``, AG2's ``OpenAIResponsesConfig`` and CrewAI's ``api="responses"``), so an agent must be able to
train against agl's own server without switching APIs. A Responses request is checked, mapped to the chat
request it stands for (``instructions`` → a system message, input items → chat messages, flat function
tools → chat tools) and generated exactly like one: the same conversation yields the same prompt token ids
whichever API carried it. The answer is a ``response`` object (or its event stream) with, as on the chat
path, top-level ``prompt_token_ids``, ``response_token_ids`` and ``agl_resources_version`` (streamed: the prompt ids
on ``response.created`` too, and each text delta's ids as its ``token_ids``, as vLLM puts them on chat chunks).
The policy server's writer is :mod:`agl.serving.responses_api`.

The server keeps no state: ``previous_response_id``, ``conversation`` and stored prompts get a 400 saying to
send the whole conversation as ``input``.

This module imports no torch: the input mapping also serves agl's fake OpenAI server (``agl.testing``) and
LightningRL's re-tokenizer, the objects and events the fake server's answers too.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Sequence

from agl.openai_wire.apis import (
    CHAT,
    LOGPROBS_INCLUDE,
    TOKEN_IDS_REQUEST,
    BadRequest,
    is_int,
    refuse_unknown,
    require_object,
)
from agl.openai_wire.chat_completions import message_text, tool_call
from agl.openai_wire.sampling import TOKEN_LIMIT_NAMES

# Accepted and ignored: they change nothing about the answer this server gives.
_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "truncation",
        "reasoning",
        "include",
        "stream_options",
        "max_tool_calls",
        "background",
        TOKEN_IDS_REQUEST,
    }
)
_SUPPORTED = (
    frozenset(
        {
            "model",
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "max_output_tokens",
            "top_logprobs",
            "text",
            "parallel_tool_calls",
        }
    )
    | _IGNORED
)
_STATEFUL = ("previous_response_id", "conversation", "prompt")


# --- requests ----------------------------------------------------------------------------------------------


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
        call = tool_call(name=item["name"], arguments=item["arguments"], call_id=item["call_id"])
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
    (temperature, top_p, vLLM's top_k, tool_choice, top_logprobs) with the same names.
    """
    require_object(body)
    for key in _STATEFUL:
        if body.get(key):
            raise BadRequest(
                f"{key} is not supported: agl's policy server stores no responses or prompts; send the whole "
                "conversation as 'input'",
                key,
            )
    refuse_unknown(body, _SUPPORTED, _IGNORED, passed=_STATEFUL)
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
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
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
    for key in ("temperature", "top_p", "top_k", "parallel_tool_calls"):
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
    elif param in TOKEN_LIMIT_NAMES[CHAT]:
        param = "max_output_tokens"
    elif param == "response_format":
        param = "text.format"
    param = param.replace(".function.parameters", ".parameters")  # Responses function tools are flat
    message = str(exc).replace("max_tokens", "max_output_tokens").replace("response_format", "text.format")
    message = message.replace(".function.parameters", ".parameters")
    return BadRequest(message, param or None, exc.code)


# --- answers -----------------------------------------------------------------------------------------------


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


def finish_response(
    result: Dict[str, Any], prompt_ids: List[int], response_ids: List[int], cut: bool = False, token_ids: bool = True
) -> Dict[str, Any]:
    """``result`` (a :func:`response_object`) made the finished one: ``incomplete`` when ``max_output_tokens``
    cut the answer (``cut``), else completed now; usage; and, with ``token_ids``, vLLM-style
    ``prompt_token_ids`` and ``response_token_ids``."""
    if cut:
        result["status"] = "incomplete"
        result["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        result["completed_at"] = time.time()
    prompt, answer = len(prompt_ids), len(response_ids)
    result["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": answer,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + answer,
    }
    if token_ids:
        result["prompt_token_ids"] = prompt_ids
        result["response_token_ids"] = response_ids
    return result


def output_text(text: str, logprobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A message's ``output_text`` content part (its logprobs: :mod:`agl.openai_wire.logprobs` entries)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str, logprobs: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part."""
    part = output_text(text, logprobs)
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str) -> Dict[str, Any]:
    """A completed ``function_call`` output item."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


# --- stream events (without their sequence numbers) -------------------------------------------------------


def opening_events(shell: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``response.created`` and ``response.in_progress``, both with the ``in_progress`` response ``shell``."""
    return [{"type": kind, "response": shell} for kind in ("response.created", "response.in_progress")]


def message_opened(item_id: str, index: int) -> List[Dict[str, Any]]:
    """The message item at ``index`` added, then its (empty) text part."""
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    item = {**message_item(item_id, "", [], "in_progress"), "content": []}
    return [
        {"type": "response.output_item.added", "output_index": index, "item": item},
        {"type": "response.content_part.added", **where, "part": output_text("", [])},
    ]


def text_delta(item_id: str, index: int, text: str, logprobs: List[Dict[str, Any]], **fields: Any) -> Dict[str, Any]:
    """A piece of the message's text (``fields``: what a server adds, agl's the ``token_ids`` behind it)."""
    where = {"item_id": item_id, "output_index": index, "content_index": 0}
    return {"type": "response.output_text.delta", **where, "delta": text, "logprobs": logprobs, **fields}


def message_closed(item: Dict[str, Any], index: int) -> List[Dict[str, Any]]:
    """The finished message ``item``'s text and text part done (the item itself: :func:`item_done`)."""
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]},
        {"type": "response.content_part.done", **where, "part": part},
    ]


def function_call_events(item: Dict[str, Any], index: int, pieces: Sequence[str]) -> List[Dict[str, Any]]:
    """The function call ``item`` added, its arguments in ``pieces``, then done (the item itself: :func:`item_done`)."""
    started = {**item, "status": "in_progress", "arguments": ""}
    where = {"item_id": item["id"], "output_index": index}
    return [
        {"type": "response.output_item.added", "output_index": index, "item": started},
        *({"type": "response.function_call_arguments.delta", **where, "delta": piece} for piece in pieces),
        {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
    ]


def item_done(item: Dict[str, Any], index: int) -> Dict[str, Any]:
    return {"type": "response.output_item.done", "output_index": index, "item": item}


__all__ = [
    "LOGPROBS_INCLUDE",
    "chat_tools",
    "conversation",
    "finish_response",
    "function_call_events",
    "function_call_item",
    "in_responses_terms",
    "item_done",
    "message_closed",
    "message_item",
    "message_opened",
    "message_text",
    "opening_events",
    "output_text",
    "response_object",
    "text_delta",
    "to_chat_body",
]
