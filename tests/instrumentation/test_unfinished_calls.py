"""Calls whose answer did not arrive whole: streams the agent stops reading (chat and Responses API), streams
closed unread, streams the server ends mid-answer, and ``with_streaming_response`` bodies. Each is recorded
with what arrived and flagged, and LightningRL trains it or skips it under a counted reason: one such call
never makes a batch raise ``MissingTokenIdsError`` (real ``openai`` client, real local servers)."""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from typing import Any, Dict, Iterator, List

import openai
import pytest

from agl import semconv
from agl.lightningrl.transitions import SKIP_EMPTY_RESPONSE, SKIP_STREAM_NO_IDS, Extraction, extract_transitions
from agl.lightningrl.tree import build_tree
from agl.testing import FakeReply

MESSAGES = [{"role": "user", "content": "Count to four."}]
ANSWER = "one two three four"


def extract(spans: List[Any]) -> Extraction:
    """What LightningRL makes of the recorded calls (it raises MissingTokenIdsError for a call it cannot use)."""
    out = extract_transitions(build_tree(spans), task_id="t")
    assert out.accounted
    return out


def output_text(span: Any) -> Any:
    (message,) = json.loads(span.attributes[semconv.OUTPUT_MESSAGES])
    return message.get("content")


# --- a server that sends what it is given, then closes the connection (no error, no [DONE]) -----------------


class _ScriptedSSE(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: a clean end of the stream
    events: List[Dict[str, Any]] = []

    def do_POST(self) -> None:  # http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for event in self.server.events:  # type: ignore[attr-defined]
            name = f"event: {event['type']}\n" if "type" in event else ""
            self.wfile.write(f"{name}data: {json.dumps(event)}\n\n".encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sse_server() -> Iterator[Any]:
    """``serve(events)`` gives the base URL of a server that streams ``events`` to every request and closes."""
    servers = []

    def serve(events: List[Dict[str, Any]]) -> str:
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ScriptedSSE)
        server.events = events  # type: ignore[attr-defined]
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def chat_chunk(content: str, token_ids: List[int], finish: Any = None, first: bool = False) -> Dict[str, Any]:
    chunk: Dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish, "token_ids": token_ids}],
    }
    if first:
        chunk["prompt_token_ids"] = [1, 2, 3]
    return chunk


# --- 1. a Responses API stream the agent stops reading ------------------------------------------------------


def test_an_abandoned_responses_stream_keeps_the_text_that_arrived_and_does_not_sink_the_batch(
    client, fake_openai, sink, rollout
):
    """The ids of a Responses stream come with its final event. Abandoned before it, the span said the server
    returned no token ids (``absent``) and held no text (``content: null``), and LightningRL raised
    MissingTokenIdsError for the whole batch, although the server returns ids."""
    fake_openai.script(FakeReply(content=ANSWER), FakeReply(content="done"))
    with rollout() as scope:
        texts = []
        with client.responses.create(
            model="fake-model", input="hi", stream=True, include=["message.output_text.logprobs"]
        ) as events:
            for event in events:
                if event.type == "response.output_text.delta":
                    texts.append(event.delta)
                    if len(texts) == 2:
                        break
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    abandoned, whole = sink.of(scope.rollout_id)
    assert abandoned.attributes[semconv.STREAM_ABANDONED] is True
    assert output_text(abandoned) == "".join(texts) == "one two "
    assert abandoned.attributes.get(semconv.TOKEN_IDS_SOURCE) != "absent"
    assert len(abandoned.attributes[semconv.RESPONSE_LOGPROBS]) == len(fake_openai.tokenizer.encode("one two "))
    assert abandoned.attributes[semconv.RESPONSE_ID].startswith("resp_")
    out = extract([abandoned, whole])
    assert out.skipped == {SKIP_STREAM_NO_IDS: 1} and [t.span_id for t in out.transitions] == [whole.span_id]


def test_an_abandoned_responses_stream_whose_deltas_carry_token_ids_is_trained_on_them(
    client, sink, rollout, sse_server
):
    """Like a chat stream: a server that puts each delta's ``token_ids`` on it (and the prompt's on the first
    snapshot) gives the abandoned call its exact ids, trained as what the agent acted on."""
    shell = {
        "id": "resp_1",
        "object": "response",
        "created_at": 0,
        "model": "m",
        "status": "in_progress",
        "output": [],
        "prompt_token_ids": [1, 2, 3],
    }
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    base_url = sse_server(
        [
            {"type": "response.created", "response": shell, "sequence_number": 0},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "sequence_number": 1,
                "item": {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []},
            },
            {
                "type": "response.output_text.delta",
                **where,
                "delta": "Hel",
                "token_ids": [10],
                "logprobs": [],
                "sequence_number": 2,
            },
            {
                "type": "response.output_text.delta",
                **where,
                "delta": "lo",
                "token_ids": [11],
                "logprobs": [],
                "sequence_number": 3,
            },
            {
                "type": "response.output_text.delta",
                **where,
                "delta": " there",
                "token_ids": [12],
                "logprobs": [],
                "sequence_number": 4,
            },
        ]
    )
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as c, rollout() as scope:
        with c.responses.create(model="m", input="hi", stream=True) as events:
            for event in events:
                if event.type == "response.output_text.delta" and event.delta == "lo":
                    break
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.STREAM_ABANDONED] is True and output_text(span) == "Hello"
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == [1, 2, 3]
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == [10, 11]
    assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "server"
    (transition,) = extract([span]).transitions
    assert (transition.prompt_ids, transition.response_ids) == ([1, 2, 3], [10, 11])


# --- 2. a stream closed before its first chunk -------------------------------------------------------------


def test_a_stream_closed_unread_is_abandoned_with_no_output_and_skipped_not_raised(client, fake_openai, sink, rollout):
    """``stream.close()`` before reading (a speculative request the agent did not need): the span said
    ``absent`` and LightningRL raised MissingTokenIdsError ("the server did not return token ids") for the
    batch. Nothing arrived, so nothing is trained: the call is skipped as an empty response."""
    with rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True).close()
    whole, unread = sink.of(scope.rollout_id)
    assert unread.attributes[semconv.STREAM_ABANDONED] is True
    assert semconv.TOKEN_IDS_SOURCE not in unread.attributes and semconv.OUTPUT_MESSAGES not in unread.attributes
    out = extract([whole, unread])
    assert out.skipped == {SKIP_EMPTY_RESPONSE: 1} and [t.span_id for t in out.transitions] == [whole.span_id]


# --- 5. with_streaming_response and raw streams closed unparsed ---------------------------------------------


def test_a_non_streamed_call_through_with_streaming_response_is_recorded_when_its_body_is_read(
    client, fake_openai, sink, rollout
):
    """The body of a ``with_streaming_response`` response is read by the user after ``create`` returned:
    the span had neither ids nor output (the server had sent both) and LightningRL raised for the batch."""
    fake_openai.script(FakeReply(content=ANSWER), FakeReply(content="parsed"))
    with rollout() as scope:
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES) as r:
            body = r.json()
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES) as r:
            parsed = r.parse()
    by_json, by_parse = sink.of(scope.rollout_id)
    assert output_text(by_json) == body["choices"][0]["message"]["content"] == ANSWER
    assert by_json.attributes[semconv.RESPONSE_TOKEN_IDS] == body["choices"][0]["token_ids"]
    assert by_json.attributes[semconv.PROMPT_TOKEN_IDS] == body["prompt_token_ids"]
    assert by_json.attributes[semconv.RESPONSE_FINISH_REASONS] == ["stop"]
    assert by_parse.attributes[semconv.RESPONSE_TOKEN_IDS] == parsed.choices[0].model_extra["token_ids"]
    assert len(extract([by_json, by_parse]).transitions) == 2


async def test_an_async_with_streaming_response_body_is_recorded(aclient, fake_openai, sink, rollout):
    with rollout() as scope:
        async with aclient.responses.with_streaming_response.create(model="fake-model", input="hi") as r:
            body = await r.json()
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == body["response_token_ids"]
    assert span.attributes[semconv.RESPONSE_ID] == body["id"]


def test_responses_closed_unread_or_unparsed_are_abandoned_with_what_arrived(client, fake_openai, sink, rollout):
    """A ``with_streaming_response`` body never read, and a raw stream closed without ``parse()``, ended their
    spans with nothing said; a raw stream parsed, read in part and closed lost what had arrived."""
    fake_openai.script(*[FakeReply(content=ANSWER)] * 3)
    with rollout() as scope:
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES):
            pass
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES, stream=True):
            pass
        with client.chat.completions.with_streaming_response.create(
            model="fake-model", messages=MESSAGES, stream=True
        ) as raw:
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    break
    unread, unparsed, partly = sink.of(scope.rollout_id)
    for span in (unread, unparsed):
        assert span.attributes[semconv.STREAM_ABANDONED] is True
        assert semconv.TOKEN_IDS_SOURCE not in span.attributes
    assert partly.attributes[semconv.STREAM_ABANDONED] is True and output_text(partly) == "one "
    assert partly.attributes[semconv.RESPONSE_TOKEN_IDS] == fake_openai.tokenizer.encode("one ")
    out = extract([unread, unparsed, partly])
    assert out.skipped == {SKIP_EMPTY_RESPONSE: 2} and [t.span_id for t in out.transitions] == [partly.span_id]


# --- 6. a stream the server ends mid-answer ----------------------------------------------------------------


def test_a_stream_the_server_ends_mid_answer_is_marked_truncated(client, sink, rollout, sse_server):
    """No finish reason, no ``[DONE]``: the SDK ends the iteration quietly, and the span looked complete."""
    base_url = sse_server([chat_chunk("", [], first=True), chat_chunk("Hello", [10]), chat_chunk(" wor", [11])])
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as c, rollout() as scope:
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        )
    (span,) = sink.of(scope.rollout_id)
    assert text == output_text(span) == "Hello wor"
    assert span.attributes[semconv.STREAM_TRUNCATED] is True and span.status == "unset"
    assert semconv.STREAM_ABANDONED not in span.attributes
    assert semconv.RESPONSE_FINISH_REASONS not in span.attributes
    (transition,) = extract([span]).transitions  # trained as what the agent acted on, with the ids that arrived
    assert transition.response_ids == [10, 11]


def test_a_stream_that_ends_with_its_finish_reason_is_not_truncated(client, fake_openai, sink, rollout, sse_server):
    base_url = sse_server([chat_chunk("Hi", [10], first=True), chat_chunk("", [2], finish="stop")])
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as c, rollout() as scope:
        list(c.chat.completions.create(model="m", messages=MESSAGES, stream=True))
        list(client.responses.create(model="fake-model", input="hi", stream=True))
    for span in sink.of(scope.rollout_id):
        assert semconv.STREAM_TRUNCATED not in span.attributes and span.attributes[semconv.RESPONSE_FINISH_REASONS]
