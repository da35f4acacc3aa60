"""Chat Completions wire format (``POST /v1/chat/completions``) for the fake OpenAI server.

Serializes a :class:`~agl.testing.fake_policy.Generation` exactly as OpenAI does, plus vLLM's
``return_token_ids`` extension (``prompt_token_ids`` on the response or first chunk, ``token_ids`` on every
choice), because that is what agl's instrumentation reads when it trains on real vLLM servers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from agl.openai_wire import chat_completions as chat
from agl.openai_wire.apis import response_header
from agl.openai_wire.sse import DONE, data_event
from agl.testing.fake_policy import ChatTool, Generation, ToolChoice

Body = Mapping[str, Any]


def conversation(body: Body) -> tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]:
    """The messages, tools and tool choice the model sees."""
    return list(body["messages"]), list(body.get("tools") or []), body.get("tool_choice")


def missing_field(body: Body) -> str | None:
    return None if isinstance(body.get("messages"), list) else "messages"


def completion(gen: Generation, body: Body, token_ids: bool) -> dict[str, Any]:
    """The non-streamed ``chat.completion`` object."""
    calls = [chat.tool_call(c.call_id, c.name, c.arguments) for c in gen.tool_calls]
    message = chat.assistant_message(gen.content, calls, refusal=None, annotations=[])
    choice = chat.choice(message, _logprobs(gen, body, gen.response_ids, 0), gen.finish_reason)
    result = {**_header(body, "chat.completion"), "choices": [choice], "usage": _usage(gen)}
    if token_ids:
        choice["token_ids"] = gen.response_ids
        result["prompt_token_ids"] = gen.prompt_ids
    return result


def sse_events(gen: Generation, body: Body, token_ids: bool) -> Iterator[str]:
    """The streamed answer as SSE lines, ``data: [DONE]`` last."""
    for chunk in chunks(gen, body, token_ids):
        yield data_event(chunk)
    yield DONE


def chunks(gen: Generation, body: Body, token_ids: bool) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` objects; their ``token_ids`` concatenate to the response ids."""
    header = _header(body, "chat.completion.chunk")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    deltas = _deltas(gen)
    position = 0
    for index, (delta, ids) in enumerate(deltas):
        last = index == len(deltas) - 1
        choice = chat.chunk_choice(delta, _logprobs(gen, body, ids, position), gen.finish_reason if last else None)
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
        head = {"index": index, **chat.tool_call(call.call_id, call.name, "")}
        deltas.append(({"tool_calls": [head]}, encode(separator + call.render_prefix())))
        pieces = call.argument_pieces()
        for number, piece in enumerate(pieces):
            closing = "}" if number == len(pieces) - 1 else ""
            fragment = {"index": index, "function": {"arguments": piece}}
            deltas.append(({"tool_calls": [fragment]}, encode(piece + closing)))
    deltas.append(({}, []))
    return deltas


def _header(body: Body, object_type: str) -> dict[str, Any]:
    return response_header("chatcmpl-", body.get("model") or "fake-model", object_type)


def _logprobs(gen: Generation, body: Body, ids: list[int], start: int) -> dict[str, Any] | None:
    return {"content": gen.logprobs(ids, start), "refusal": None} if body.get("logprobs") else None


def _usage(gen: Generation) -> dict[str, Any]:
    return {
        **chat.usage(len(gen.prompt_ids), len(gen.response_ids)),
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
