"""Responses API wire format (``POST /v1/responses``) for the fake OpenAI server.

The OpenAI Agents SDK talks Responses by default, so the fake model must understand Responses input items
and answer with output items and the exact event sequence the ``openai`` client's stream helpers accumulate.
Input is mapped to chat messages so one policy and one chat template serve both APIs: the same conversation
yields the same prompt token ids whichever API carried it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from agl.openai_wire import responses
from agl.testing.fake_policy import ChatTool, Generation, ToolChoice

Body = Mapping[str, Any]
Item = dict[str, Any]


def conversation(body: Body) -> tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]:
    """The Responses request as chat messages, chat-format tools and the tool choice (the policy server's
    own mapping, :mod:`agl.openai_wire.responses`)."""
    return responses.conversation(body), responses.chat_tools(body.get("tools") or []), body.get("tool_choice")


def missing_field(body: Body) -> str | None:
    return None if isinstance(body.get("input"), (str, list)) else "input"


def response(gen: Generation, body: Body, token_ids: bool) -> dict[str, Any]:
    """The completed, non-streamed ``response`` object."""
    return _completed(_Rendering(gen, body), token_ids)


def sse_events(gen: Generation, body: Body, token_ids: bool) -> Iterator[str]:
    """The streamed answer as named SSE events (Responses streams end without ``[DONE]``)."""
    for number, event in enumerate(events(gen, body, token_ids)):
        event["sequence_number"] = number
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def events(gen: Generation, body: Body, token_ids: bool) -> Iterator[dict[str, Any]]:
    """The event sequence OpenAI sends, without sequence numbers."""
    rendering = _Rendering(gen, body)
    in_progress = rendering.response("in_progress", [])
    yield {"type": "response.created", "response": in_progress}
    yield {"type": "response.in_progress", "response": in_progress}
    for index, item in enumerate(rendering.items()):
        is_message = item["type"] == "message"
        started = {**item, "status": "in_progress", **({"content": []} if is_message else {"arguments": ""})}
        yield {"type": "response.output_item.added", "output_index": index, "item": started}
        yield from (_message_events if is_message else _call_events)(rendering, item, index)
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    yield {"type": "response.completed", "response": _completed(rendering, token_ids)}


def _message_events(rendering: _Rendering, item: Item, index: int) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    part = item["content"][0]
    yield {"type": "response.content_part.added", **where, "part": {**part, "text": "", "logprobs": []}}
    position = 0
    for piece in rendering.gen.text_pieces():
        ids = rendering.gen.tokenizer.encode(piece)
        logprobs = rendering.logprobs(ids, position)
        yield {"type": "response.output_text.delta", **where, "delta": piece, "logprobs": logprobs}
        position += len(ids)
    yield {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]}
    yield {"type": "response.content_part.done", **where, "part": part}


def _call_events(rendering: _Rendering, item: Item, index: int) -> Iterator[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    call = next(c for c in rendering.gen.tool_calls if c.call_id == item["call_id"])
    for piece in call.argument_pieces():
        yield {"type": "response.function_call_arguments.delta", **where, "delta": piece}
    yield {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments}


def _completed(rendering: _Rendering, token_ids: bool) -> dict[str, Any]:
    result = rendering.response("completed", rendering.items())
    gen = rendering.gen
    result["completed_at"] = time.time()
    result["usage"] = {
        "input_tokens": len(gen.prompt_ids),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(gen.response_ids),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(gen.prompt_ids) + len(gen.response_ids),
    }
    if token_ids:
        result["prompt_token_ids"] = gen.prompt_ids
        result["response_token_ids"] = gen.response_ids
    return result


class _Rendering:
    """One generation's ids (response, items) fixed once, so every event and the final object agree."""

    def __init__(self, gen: Generation, body: Body) -> None:
        self.gen = gen
        self.body = body
        self.response_id = "resp_" + uuid.uuid4().hex
        self.created_at = time.time()
        # As agl's policy server: asked with include, or with top_logprobs alone (which OpenAI ignores)
        self.with_logprobs = (
            responses.LOGPROBS_INCLUDE in (body.get("include") or []) or body.get("top_logprobs") is not None
        )
        self._items = self._build_items()

    def items(self) -> list[Item]:
        return [dict(item) for item in self._items]

    def logprobs(self, ids: list[int], start: int) -> list[dict[str, Any]]:
        return self.gen.logprobs(ids, start) if self.with_logprobs else []

    def response(self, status: str, output: list[Item]) -> dict[str, Any]:
        model = self.body.get("model") or "fake-model"
        return responses.response_object(self.body, self.response_id, self.created_at, model, status, output)

    def _build_items(self) -> list[Item]:
        gen = self.gen
        items: list[Item] = []
        if gen.content is not None and (gen.content or not gen.tool_calls):
            logprobs = self.logprobs(gen.tokenizer.encode(gen.content), 0)
            text = {"type": "output_text", "text": gen.content, "annotations": [], "logprobs": logprobs}
            message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant"}
            items.append({**message, "status": "completed", "content": [text]})
        for call in gen.tool_calls:
            items.append(
                {
                    "id": "fc_" + uuid.uuid4().hex,
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return items
