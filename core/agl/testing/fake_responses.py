"""Responses API wire format (``POST /v1/responses``) for the fake OpenAI server.

The OpenAI Agents SDK talks Responses by default, so the fake model must understand Responses input items
and answer with output items and the exact event sequence the ``openai`` client's stream helpers accumulate.
Input is mapped to chat messages so one policy and one chat template serve both APIs: the same conversation
yields the same prompt token ids whichever API carried it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from agl.openai_wire import responses
from agl.openai_wire.apis import LOGPROBS_INCLUDE
from agl.openai_wire.sse import named_event
from agl.testing.fake_policy import ChatTool, Generation, ToolChoice

Body = Mapping[str, Any]
Item = dict[str, Any]


def conversation(body: Body) -> tuple[list[Mapping[str, Any]], list[ChatTool], ToolChoice]:
    """The Responses request as chat messages, chat-format tools and the tool choice (the policy server's
    own mapping, :mod:`agl.openai_wire.responses`)."""
    return responses.conversation(body), responses.chat_tools(body.get("tools") or []), body.get("tool_choice")  # type: ignore[return-value]  # lists of dicts, read as Mappings


def missing_field(body: Body) -> str | None:
    return None if isinstance(body.get("input"), (str, list)) else "input"


def response(gen: Generation, body: Body, token_ids: bool) -> dict[str, Any]:
    """The completed, non-streamed ``response`` object."""
    return _completed(_Rendering(gen, body), token_ids)


def sse_events(gen: Generation, body: Body, token_ids: bool) -> Iterator[str]:
    """The streamed answer as named SSE events (Responses streams end without ``[DONE]``)."""
    for number, event in enumerate(events(gen, body, token_ids)):
        event["sequence_number"] = number
        yield named_event(event)


def events(gen: Generation, body: Body, token_ids: bool) -> Iterator[dict[str, Any]]:
    """The event sequence OpenAI sends, without sequence numbers."""
    rendering = _Rendering(gen, body)
    yield from responses.opening_events(rendering.response("in_progress", []))
    for index, item in enumerate(rendering.items()):
        yield from (_message_events if item["type"] == "message" else _call_events)(rendering, item, index)
        yield responses.item_done(item, index)
    yield {"type": "response.completed", "response": _completed(rendering, token_ids)}


def _message_events(rendering: _Rendering, item: Item, index: int) -> Iterator[dict[str, Any]]:
    yield from responses.message_opened(item["id"], index)
    position = 0
    for piece in rendering.gen.text_pieces():
        ids = rendering.gen.tokenizer.encode(piece)
        yield responses.text_delta(item["id"], index, piece, rendering.logprobs(ids, position))
        position += len(ids)
    yield from responses.message_closed(item, index)


def _call_events(rendering: _Rendering, item: Item, index: int) -> Iterator[dict[str, Any]]:
    call = next(c for c in rendering.gen.tool_calls if c.call_id == item["call_id"])
    yield from responses.function_call_events(item, index, call.argument_pieces())


def _completed(rendering: _Rendering, token_ids: bool) -> dict[str, Any]:
    gen = rendering.gen
    result = rendering.response("completed", rendering.items())
    return responses.finish_response(result, gen.prompt_ids, gen.response_ids, token_ids=token_ids)


class _Rendering:
    """One generation's ids (response, items) fixed once, so every event and the final object agree."""

    def __init__(self, gen: Generation, body: Body) -> None:
        self.gen = gen
        self.body = body
        self.response_id = "resp_" + uuid.uuid4().hex
        self.created_at = time.time()
        # As agl's policy server: asked with include, or with top_logprobs alone (which OpenAI ignores)
        self.with_logprobs = LOGPROBS_INCLUDE in (body.get("include") or []) or body.get("top_logprobs") is not None
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
            items.append(responses.message_item("msg_" + uuid.uuid4().hex, gen.content, logprobs, "completed"))
        for call in gen.tool_calls:
            item_id = "fc_" + uuid.uuid4().hex
            items.append(responses.function_call_item(item_id, call.call_id, call.name, call.arguments))
        return items
