"""The Responses API (``POST /v1/responses``) of the policy server: the ``response`` object and the event stream
of one request, written from its generation. The request is checked and mapped to the chat request it
stands for, and the objects and events are built, by :mod:`agl.openai_wire.responses`; this module also
holds :class:`AnswerWriter`, what the server's generation loop asks of each API's writer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Protocol, Sequence

from agl.openai_wire import responses
from agl.openai_wire.apis import RESOURCES_VERSION_FIELD
from agl.openai_wire.chat_format import ParsedOutput
from agl.openai_wire.logprobs import token_logprobs
from agl.openai_wire.sse import named_event
from agl.serving.generation import Generation, Token


class AnswerWriter(Protocol):
    """What the server asks of each API's writer (the chat ``openai_api.ResponseWriter``, the completions
    ``completions_api.CompletionWriter`` and :class:`ResponsesWriter`): the finished object, and a stream as
    SSE lines."""

    def final(self, gen: Generation, parsed: ParsedOutput) -> Dict[str, Any]: ...

    def stream_start(self, prompt_ids: List[int]) -> List[str]: ...

    def stream_text(self, text: str, tokens: Sequence[Token], first: bool) -> List[str]: ...

    def stream_finish(
        self, gen: Generation, parsed: ParsedOutput, sent: str, pending: Sequence[Token]
    ) -> List[str]: ...

    def stream_error(self, error: Dict[str, Any]) -> str: ...


@dataclass
class ResponsesWriter:
    """The ``response`` object and stream events of one request (one response id, item ids fixed once)."""

    body: Mapping[str, Any]
    model_name: str
    tokenizer: Any
    version: int
    with_logprobs: bool
    response_id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    _sequence: int = 0

    # --- objects ----------------------------------------------------------------------------------------------

    def final(self, gen: Generation, parsed: ParsedOutput) -> Dict[str, Any]:
        """The finished ``response`` object."""
        result = self._shell("completed", self.items(gen, parsed))
        return responses.finish_response(result, gen.prompt_ids, gen.response_ids, cut=gen.finish_reason == "length")

    def items(self, gen: Generation, parsed: ParsedOutput) -> List[Dict[str, Any]]:
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
            items.append(responses.message_item(self.message_id, parsed.content or "", logprobs, "completed"))
        for call in parsed.tool_calls:
            items.append(responses.function_call_item("fc_" + call.call_id, call.call_id, call.name, call.arguments))
        return items

    def logprobs(self, tokens: Sequence[Token]) -> List[Dict[str, Any]]:
        return token_logprobs(self.tokenizer, tokens) if self.with_logprobs else []

    def _shell(self, status: str, output: List[Dict[str, Any]]) -> Dict[str, Any]:
        shell = responses.response_object(self.body, self.response_id, self.created_at, self.model_name, status, output)
        shell[RESOURCES_VERSION_FIELD] = self.version
        return shell

    # --- the stream, as the server's streaming loop drives it (``AnswerWriter``) ------------------------------

    def stream_start(self, prompt_ids: List[int]) -> List[str]:
        """``response.created`` and ``response.in_progress``, with the prompt's ids; each text delta carries
        its tokens' ids (``token_ids``), so a stream the agent stops reading still has the ids of what it read
        (the final response carries them all again)."""
        shell = self._shell("in_progress", [])
        shell["prompt_token_ids"] = prompt_ids
        return [self.sse(event) for event in responses.opening_events(shell)]

    def stream_text(self, text: str, tokens: Sequence[Token], first: bool) -> List[str]:
        """A text delta; the first one opens the message item and its text part."""
        opened = responses.message_opened(self.message_id, 0) if first else []
        return [self.sse(event) for event in opened + [self._text_delta(text, tokens)]]

    def stream_finish(self, gen: Generation, parsed: ParsedOutput, sent: str, pending: Sequence[Token]) -> List[str]:
        """After the streamed text (a prefix of the final content): its rest, the message closed, each tool
        call, then ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``)."""
        final = self.final(gen, parsed)
        events: List[Dict[str, Any]] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":  # (the first item: index 0)
                events += [] if sent else responses.message_opened(self.message_id, 0)
                rest = item["content"][0]["text"][len(sent) :]
                events += [self._text_delta(rest, pending)] if rest else []
                events += responses.message_closed(item, index)
            else:
                events += responses.function_call_events(item, index, [item["arguments"]])
            events.append(responses.item_done(item, index))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append({"type": kind, "response": final})
        return [self.sse(event) for event in events]

    def stream_error(self, error: Dict[str, Any]) -> str:
        """An ``error`` event; its top-level ``error`` makes the ``openai`` client raise ``APIError``."""
        return self.sse({"type": "error", **error})

    def _text_delta(self, text: str, tokens: Sequence[Token]) -> Dict[str, Any]:
        token_ids = [t.token_id for t in tokens]
        return responses.text_delta(self.message_id, 0, text, self.logprobs(tokens), token_ids=token_ids)

    def sse(self, event: Dict[str, Any]) -> str:
        """One named SSE event with its sequence number (Responses streams end without ``[DONE]``)."""
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return named_event(event)
