"""Chat Completions wire format (``POST /v1/chat/completions``) for the fake OpenAI server.

Serializes a :class:`~agl.testing.fake_policy.Generation` exactly as OpenAI does, plus vLLM's
``return_token_ids`` extension (``prompt_token_ids`` on the response or first chunk, ``token_ids`` on every
choice), because that is what agl's instrumentation reads when it trains on real vLLM servers.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from agl.testing.fake_policy import ChatTool, Generation, ToolChoice

Body = Mapping[str, Any]


def conversation(body: Body) -> tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]:
    """The messages, tools and tool choice the model sees."""
    return list(body["messages"]), list(body.get("tools") or []), body.get("tool_choice")


def missing_field(body: Body) -> str | None:
    return None if isinstance(body.get("messages"), list) else "messages"


def completion(gen: Generation, body: Body, token_ids: bool) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": gen.content,
        "refusal": None,
        "annotations": [],
    }
    if gen.tool_calls:
        message["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in gen.tool_calls
        ]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": _logprobs(gen, body, gen.response_ids, 0),
        "finish_reason": gen.finish_reason,
    }
    result = {**_header(body, "chat.completion"), "choices": [choice], "usage": _usage(gen)}
    if token_ids:
        choice["token_ids"] = gen.response_ids
        result["prompt_token_ids"] = gen.prompt_ids
    return result


def sse_events(gen: Generation, body: Body, token_ids: bool) -> Iterator[str]:
    """The streamed answer as SSE lines, ``data: [DONE]`` last."""
    for chunk in chunks(gen, body, token_ids):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def chunks(gen: Generation, body: Body, token_ids: bool) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects; their ``token_ids`` concatenate to the response ids."""
    header = _header(body, "chat.completion.chunk")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    deltas = _deltas(gen)
    position = 0
    for index, (delta, ids) in enumerate(deltas):
        last = index == len(deltas) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": _logprobs(gen, body, ids, position),
            "finish_reason": gen.finish_reason if last else None,
        }
        chunk: dict[str, Any] = {**header, "choices": [choice]}
        if token_ids:
            choice["token_ids"] = ids
            if index == 0:
                chunk["prompt_token_ids"] = gen.prompt_ids
        if include_usage:
            chunk["usage"] = None
        position += len(ids)
        yield chunk
    if include_usage:
        yield {**header, "choices": [], "usage": _usage(gen)}


def _deltas(gen: Generation) -> list[tuple[dict[str, Any], list[int]]]:
    """Each delta with the token ids that produced it: role, words, then per call its header and arguments.

    A call's header carries the ids of ``{"name": ..., "arguments": `` (and the newline before it), its
    last argument fragment the closing ``}``, so the ids follow the rendered text byte for byte.
    """
    encode = gen.tokenizer.encode
    deltas: list[tuple[dict[str, Any], list[int]]] = [({"role": "assistant", "content": ""}, [])]
    deltas += [({"content": piece}, encode(piece)) for piece in gen.text_pieces()]
    for index, call in enumerate(gen.tool_calls):
        separator = "\n" if index or gen.content else ""
        function = {"name": call.name, "arguments": ""}
        head = {"index": index, "id": call.call_id, "type": "function", "function": function}
        deltas.append(({"tool_calls": [head]}, encode(separator + call.render_prefix())))
        pieces = call.argument_pieces()
        for number, piece in enumerate(pieces):
            closing = "}" if number == len(pieces) - 1 else ""
            fragment = {"index": index, "function": {"arguments": piece}}
            deltas.append(({"tool_calls": [fragment]}, encode(piece + closing)))
    deltas.append(({}, []))
    return deltas


def _header(body: Body, object_type: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "object": object_type,
        "created": int(time.time()),
        "model": body.get("model") or "fake-model",
        "system_fingerprint": None,
    }


def _logprobs(gen: Generation, body: Body, ids: list[int], start: int) -> dict[str, Any] | None:
    return {"content": gen.logprobs(ids, start), "refusal": None} if body.get("logprobs") else None


def _usage(gen: Generation) -> dict[str, Any]:
    prompt, completion_tokens = len(gen.prompt_ids), len(gen.response_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
