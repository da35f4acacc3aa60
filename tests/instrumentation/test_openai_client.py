"""The OpenAI client instrumentation, with the real ``openai`` client against the fake OpenAI server."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Dict, List

import openai
import pytest
from instr_stream_keys import STREAMED_AS_PLAIN
from openai.resources.chat.completions import AsyncCompletions, Completions
from openai.resources.responses import AsyncResponses, Responses

import agl.instrumentation
from agl import semconv
from agl._util.safety import internal_error_count
from agl.instrumentation import openai_client
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.openai_wire import payloads, streams
from agl.testing import FakeReply
from agl.testing.fake_policy import fake_logprob, render_assistant, tool_call_from_spec
from agl.tracing.context import propagate
from agl.tracing.context_keys import llm_span_already_open
from agl.tracing.tracer import get_tracer

MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = {"id": "call_1", "name": "add", "arguments": {"a": 2, "b": 3}}
WITH_CALL = FakeReply(content="Let me add.", tool_calls=[CALL])


def prompt_ids(server: Any, messages: List[Dict[str, Any]], tools: Any = None) -> List[int]:
    return server.tokenizer.encode(server.tokenizer.apply_chat_template(messages, tools))


def response_ids(server: Any, content: Any, calls: Any = ()) -> List[int]:
    return server.tokenizer.encode(render_assistant(content, [tool_call_from_spec(c) for c in calls]))


def output_message(span: Any) -> Dict[str, Any]:
    (message,) = json.loads(span.attributes[semconv.OUTPUT_MESSAGES])
    return message


def sent_token_id_flags(server: Any) -> List[Any]:
    return [r["body"].get("return_token_ids") for r in server.requests]


# --- chat completions ---------------------------------------------------------------------------------------


def test_sync_chat_span_has_request_response_and_server_token_ids(client, fake_openai, sink, rollout):
    fake_openai.script(WITH_CALL)
    with rollout() as scope:
        completion = client.chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=TOOLS, temperature=0.7, top_p=0.9, max_tokens=64
        )
    (span,) = sink.of(scope.rollout_id)
    a = span.attributes
    assert span.name == "chat fake-model" and span.kind == "llm" and span.status == "unset"
    assert a[semconv.OPERATION_NAME] == "chat" and a[semconv.PROVIDER_NAME] == "openai"
    assert a[semconv.REQUEST_MODEL] == "fake-model" and a[semconv.REQUEST_MAX_TOKENS] == 64
    assert (a[semconv.REQUEST_TEMPERATURE], a[semconv.REQUEST_TOP_P]) == (0.7, 0.9)
    assert a[semconv.LLM_API] == "chat.completions" and a[semconv.LLM_STREAM] is False
    assert json.loads(a[semconv.INPUT_MESSAGES]) == MESSAGES
    assert json.loads(a[semconv.TOOL_DEFINITIONS]) == TOOLS
    assert a[semconv.RESPONSE_ID] == completion.id and a[semconv.RESPONSE_MODEL] == completion.model
    assert a[semconv.RESPONSE_FINISH_REASONS] == ["tool_calls"]
    assert a[semconv.USAGE_INPUT_TOKENS] == completion.usage.prompt_tokens
    assert a[semconv.USAGE_OUTPUT_TOKENS] == completion.usage.completion_tokens
    message = output_message(span)
    assert message["content"] == "Let me add."
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    assert a[semconv.TOKEN_IDS_SOURCE] == "server"
    assert a[semconv.PROMPT_TOKEN_IDS] == prompt_ids(fake_openai, MESSAGES, TOOLS)
    assert a[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "Let me add.", [CALL])
    assert a[semconv.RESPONSE_TOKEN_IDS] == completion.choices[0].model_extra["token_ids"]
    assert semconv.RESPONSE_LOGPROBS not in a  # not asked for


def test_input_messages_are_a_snapshot_taken_at_call_time(client, fake_openai, sink, rollout):
    messages = list(MESSAGES)
    with rollout() as scope:
        completion = client.chat.completions.create(model="fake-model", messages=messages)
        messages.append(completion.choices[0].message)  # agents keep appending to their list
        messages.append({"role": "user", "content": "and now?"})
    (span,) = sink.of(scope.rollout_id)
    assert json.loads(span.attributes[semconv.INPUT_MESSAGES]) == MESSAGES


def test_generator_of_messages_is_sent_whole_and_recorded(client, fake_openai, sink, rollout):
    with rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=(m for m in MESSAGES))
    assert fake_openai.requests[0]["body"]["messages"] == MESSAGES
    (span,) = sink.of(scope.rollout_id)
    assert json.loads(span.attributes[semconv.INPUT_MESSAGES]) == MESSAGES


async def test_async_chat(aclient, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="five"))
    with rollout() as scope:
        completion = await aclient.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.choices[0].message.content == "five"
    (span,) = sink.of(scope.rollout_id)
    assert output_message(span)["content"] == "five"
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "five")
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == prompt_ids(fake_openai, MESSAGES)


def test_logprobs_are_recorded_one_per_response_token(client, fake_openai, sink, rollout):
    with rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, logprobs=True)
    (span,) = sink.of(scope.rollout_id)
    ids = span.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert span.attributes[semconv.RESPONSE_LOGPROBS] == [fake_logprob(i) for i in range(len(ids))]


# --- chat streams -------------------------------------------------------------------------------------------


def test_stream_reassembles_exactly_what_the_non_streamed_call_returns(client, fake_openai, sink, rollout):
    fake_openai.script(WITH_CALL, WITH_CALL)
    with rollout() as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, logprobs=True)
        stream = client.chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            tools=TOOLS,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert isinstance(stream, openai.Stream)
        chunks = list(stream)
    assert len(chunks) > 5 and all(type(c).__name__ == "ChatCompletionChunk" for c in chunks)
    plain, streamed = sink.of(scope.rollout_id)
    assert streamed.attributes[semconv.LLM_STREAM] is True and streamed.status == "unset"
    expected = output_message(plain)
    got = output_message(streamed)
    assert got["content"] == expected["content"] == "Let me add."
    assert got["tool_calls"] == expected["tool_calls"]
    for key in (*STREAMED_AS_PLAIN, semconv.TOKEN_IDS_SOURCE):
        assert streamed.attributes[key] == plain.attributes[key], key
    assert streamed.attributes[semconv.RESPONSE_ID] == chunks[0].id


def test_stream_as_context_manager_and_early_close_end_the_span(client, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="one two three four"), FakeReply(content="one two three four"))
    with rollout() as scope:
        with client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True) as stream:
            texts = [c.choices[0].delta.content for c in stream if c.choices]
        stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        next(stream)
        next(stream)
        stream.close()
    assert "".join(t or "" for t in texts) == "one two three four"
    whole, closed = sink.of(scope.rollout_id)
    assert output_message(whole)["content"] == "one two three four"
    assert closed.status == "unset" and output_message(closed)["content"] == "one "
    assert semconv.STREAM_ABANDONED not in whole.attributes
    assert closed.attributes[semconv.STREAM_ABANDONED] is True  # was stored as a complete answer


def test_a_stream_closed_before_its_end_is_marked_abandoned_every_way_it_can_be_closed(
    client, fake_openai, sink, rollout
):
    """Breaking out of a ``with`` block, ``close()``, or a Responses stream closed mid-answer ended the span
    as if the answer were complete (no flag): inspect and export showed a cut answer as a whole one."""
    fake_openai.script(*[FakeReply(content="one two three four")] * 4)
    with rollout() as scope:
        with client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True) as stream:
            for _ in stream:
                break
        with client.responses.create(model="fake-model", input="hi", stream=True) as events:
            next(iter(events))
        finished = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        chunks = iter(finished)
        while not (chunk := next(chunks)).choices or not chunk.choices[0].finish_reason:
            pass  # read up to the finish reason, then stop before the end of the stream
        finished.close()
        whole = list(client.responses.create(model="fake-model", input="hi", stream=True))
    assert whole[-1].type == "response.completed"
    spans = sink.of(scope.rollout_id)
    assert [s.attributes.get(semconv.STREAM_ABANDONED) for s in spans] == [True, True, None, None]


async def test_an_async_stream_closed_before_its_end_is_marked_abandoned(aclient, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="one two three four"), FakeReply(content="one two three four"))
    with rollout() as scope:
        stream = await aclient.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        async with stream as s:
            async for _ in s:
                break
        stream = await aclient.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        await stream.__anext__()
        await stream.close()
    assert [s.attributes.get(semconv.STREAM_ABANDONED) for s in sink.of(scope.rollout_id)] == [True, True]


def test_abandoned_stream_still_ends_its_span(client, fake_openai, sink, rollout):
    with rollout() as scope:
        stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        for _ in stream:
            break
        del stream
        gc.collect()
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.LLM_STREAM] is True
    assert span.attributes[semconv.STREAM_ABANDONED] is True


def test_a_stream_still_referenced_when_its_rollout_ends_ends_with_it(client, fake_openai, sink, rollout):
    """A stream the agent broke out of but still holds (a framework's object, a list) ended its span only when
    collected, after the attempt was reported (a batch built at once missed the call) or in a later attempt
    (the store refused it). It now ends with its rollout, marked abandoned, with what had arrived."""
    fake_openai.script(FakeReply(content="one two three four"))
    kept = []
    with rollout() as scope:
        stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
        for _ in stream:
            break
        kept.append(stream)
        assert sink.of(scope.rollout_id) == []  # still open
    assert get_tracer().flush(5)
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.STREAM_ABANDONED] is True and semconv.RESPONSE_FINISH_REASONS not in span.attributes
    full = response_ids(fake_openai, "one two three four")
    assert full[: len(span.attributes[semconv.RESPONSE_TOKEN_IDS])] == span.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert len(span.attributes[semconv.RESPONSE_TOKEN_IDS]) < len(full)
    del kept[:]
    gc.collect()
    assert len(sink.of(scope.rollout_id)) == 1  # ended once
    with rollout() as scope:  # a stream read to its end is not abandoned
        for _ in client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True):
            pass
    (span,) = sink.of(scope.rollout_id)
    assert semconv.STREAM_ABANDONED not in span.attributes


async def test_async_stream(aclient, fake_openai, sink, rollout):
    fake_openai.script(WITH_CALL)
    with rollout() as scope:
        stream = await aclient.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS, stream=True)
        assert isinstance(stream, openai.AsyncStream)
        async with stream as s:
            chunks = [c async for c in s]
    assert chunks
    (span,) = sink.of(scope.rollout_id)
    assert output_message(span)["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "Let me add.", [CALL])


def test_stream_helpers_of_the_sdk_are_traced(client, chat_helpers, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="helped"), FakeReply(content="helped"))
    with rollout() as scope:
        with chat_helpers.stream(model="fake-model", messages=MESSAGES) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        with client.responses.stream(model="fake-model", input="hi") as events:
            for _ in events:
                pass
            final_response = events.get_final_response()
    assert final.choices[0].message.content == final_response.output_text == "helped"
    chat, responses = sink.of(scope.rollout_id)
    for span in (chat, responses):
        assert span.attributes[semconv.LLM_STREAM] is True
        assert output_message(span)["content"] == "helped"
        assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "helped")


# --- responses API ------------------------------------------------------------------------------------------


def test_responses_plain(client, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="five"))
    with rollout() as scope:
        response = client.responses.create(
            model="fake-model", instructions="You add numbers.", input="What is 2 + 3?", max_output_tokens=32
        )
    assert response.output_text == "five"
    (span,) = sink.of(scope.rollout_id)
    a = span.attributes
    assert span.name == "responses fake-model" and a[semconv.LLM_API] == "responses"
    assert a[semconv.REQUEST_MAX_TOKENS] == 32
    assert json.loads(a[semconv.INPUT_MESSAGES]) == {"instructions": "You add numbers.", "input": "What is 2 + 3?"}
    assert output_message(span) == {"role": "assistant", "content": "five"}
    assert a[semconv.RESPONSE_ID] == response.id and a[semconv.RESPONSE_FINISH_REASONS] == ["completed"]
    assert a[semconv.USAGE_OUTPUT_TOKENS] == response.usage.output_tokens
    # the fake maps Responses input to the chat template: same conversation, same prompt ids
    assert a[semconv.PROMPT_TOKEN_IDS] == prompt_ids(fake_openai, MESSAGES)
    assert a[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "five")
    assert a[semconv.TOKEN_IDS_SOURCE] == "server"


def test_responses_function_call_and_logprobs(client, fake_openai, sink, rollout):
    tools = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]
    fake_openai.script(FakeReply(tool_calls=[CALL]), FakeReply(content="five"))
    with rollout() as scope:
        client.responses.create(model="fake-model", input=MESSAGES[1:], tools=tools)
        client.responses.create(model="fake-model", input="hi", include=["message.output_text.logprobs"])
    call, answer = sink.of(scope.rollout_id)
    assert json.loads(call.attributes[semconv.INPUT_MESSAGES]) == {"instructions": None, "input": MESSAGES[1:]}
    assert json.loads(call.attributes[semconv.TOOL_DEFINITIONS]) == tools
    assert output_message(call)["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    assert call.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, None, [CALL])
    assert answer.attributes[semconv.RESPONSE_LOGPROBS] == [fake_logprob(i) for i in range(len("five"))]


def test_responses_logprobs_the_server_sends_unasked_are_recorded(client, fake_openai, sink, rollout):
    """Logprobs were recorded only when the request had include=[...logprobs]: a client asking with
    top_logprobs alone (AG2), or agl's policy server filling in its trainer's logprobs default, sent them
    and the span had none (the Agents SDK's default model trained without its old logprobs)."""
    fake_openai.script(FakeReply(content="five"), FakeReply(content="five"), FakeReply(content="five"))
    with rollout() as scope:
        asked = {"extra_body": {"top_logprobs": 2}}  # an argument of the SDK only since openai 1.9x
        client.responses.create(model="fake-model", input="hi", **asked)
        list(client.responses.create(model="fake-model", input="hi", stream=True, **asked))
        client.responses.create(model="fake-model", input="hi")  # none sent: none recorded
    plain, streamed, without = sink.of(scope.rollout_id)
    expected = [fake_logprob(i) for i in range(len("five"))]
    assert plain.attributes[semconv.RESPONSE_LOGPROBS] == expected
    assert streamed.attributes[semconv.RESPONSE_LOGPROBS] == expected
    assert semconv.RESPONSE_LOGPROBS not in without.attributes


def test_responses_stream_equals_plain(client, fake_openai, sink, rollout):
    fake_openai.script(WITH_CALL, WITH_CALL)
    with rollout() as scope:
        client.responses.create(model="fake-model", input="What is 2 + 3?")
        events = list(client.responses.create(model="fake-model", input="What is 2 + 3?", stream=True))
    assert events[-1].type == "response.completed"
    plain, streamed = sink.of(scope.rollout_id)
    assert streamed.attributes[semconv.LLM_STREAM] is True and streamed.status == "unset"
    assert output_message(streamed) == output_message(plain)
    assert output_message(streamed)["content"] == "Let me add."
    for key in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.USAGE_OUTPUT_TOKENS):
        assert streamed.attributes[key] == plain.attributes[key], key
    assert streamed.attributes[semconv.RESPONSE_ID] == events[-1].response.id


async def test_async_responses_stream(aclient, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="five"))
    with rollout() as scope:
        stream = await aclient.responses.create(model="fake-model", input="hi", stream=True)
        events = [e async for e in stream]
    assert events[-1].type == "response.completed"
    (span,) = sink.of(scope.rollout_id)
    assert output_message(span)["content"] == "five"
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "five")


# --- asking for token ids -----------------------------------------------------------------------------------


def test_return_token_ids_is_sent_inside_a_rollout_only(client, fake_openai, sink, rollout):
    client.chat.completions.create(model="fake-model", messages=MESSAGES)
    client.responses.create(model="fake-model", input="hi")
    with rollout():
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        client.responses.create(model="fake-model", input="hi")
    with rollout(request_token_ids=False):
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert sent_token_id_flags(fake_openai) == [None, None, True, True, None]


def test_absent_token_ids_are_said_to_be_absent(client, fake_openai, sink, rollout):
    with rollout(request_token_ids=False) as scope:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "absent"
    assert semconv.PROMPT_TOKEN_IDS not in span.attributes and semconv.RESPONSE_TOKEN_IDS not in span.attributes


def test_request_token_ids_option_overrides_the_scope(fake_openai, sink, rollout):
    agl_client = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    for option, expected in ((True, [True, True]), (False, [None, None])):
        inst = OpenAIInstrumentor()
        inst.instrument(request_token_ids=option)
        try:
            fake_openai.reset()
            agl_client.chat.completions.create(model="fake-model", messages=MESSAGES)
            with rollout():
                agl_client.chat.completions.create(model="fake-model", messages=MESSAGES)
            assert sent_token_id_flags(fake_openai) == expected
        finally:
            inst.uninstrument()


def test_user_extra_body_is_kept_and_not_mutated(client, fake_openai, sink, rollout):
    extra = {"top_k": 5}
    mine = {"return_token_ids": False}
    with rollout():
        client.chat.completions.create(model="fake-model", messages=MESSAGES, extra_body=extra)
        client.chat.completions.create(model="fake-model", messages=MESSAGES, extra_body=mine)
    assert extra == {"top_k": 5} and mine == {"return_token_ids": False}
    first, second = (r["body"] for r in fake_openai.requests)
    assert first["top_k"] == 5 and first["return_token_ids"] is True
    assert second["return_token_ids"] is False  # the user's explicit choice wins


# --- the user's call is never changed -----------------------------------------------------------------------


def test_result_and_exception_objects_pass_through_unchanged(client, monkeypatch, rollout):
    completions = client.chat.completions
    sentinel_result = object()
    monkeypatch.setattr(completions, "_post", lambda *a, **k: sentinel_result)
    with rollout():
        assert completions.create(model="fake-model", messages=MESSAGES) is sentinel_result

    boom = ValueError("from the transport")

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise boom

    monkeypatch.setattr(completions, "_post", fail)
    with rollout(), pytest.raises(ValueError) as info:
        completions.create(model="fake-model", messages=MESSAGES)
    assert info.value is boom


def _error_type(call: Any) -> type:
    with pytest.raises(Exception) as info:
        call()
    return type(info.value)


def test_server_error_raises_what_the_plain_client_raises_and_marks_the_span(
    client, fake_openai, instrumentor, sink, rollout
):
    def call() -> Any:
        return client.chat.completions.create(model="fake-model", messages=MESSAGES)

    instrumentor.uninstrument()
    fake_openai.script(FakeReply(status_code=500, error_message="the GPU caught fire"))
    plain = _error_type(call)
    instrumentor.instrument()
    fake_openai.script(FakeReply(status_code=500, error_message="the GPU caught fire"))
    with rollout() as scope:
        assert _error_type(call) is plain is openai.InternalServerError
    (span,) = sink.of(scope.rollout_id)
    assert span.status == "error" and "the GPU caught fire" in span.error
    assert span.attributes[semconv.ERROR_TYPE] == "InternalServerError"
    assert json.loads(span.attributes[semconv.INPUT_MESSAGES]) == MESSAGES


async def test_async_server_error_raises_what_the_plain_client_raises_and_marks_the_span(
    aclient, fake_openai, instrumentor, sink, rollout
):
    async def error_type() -> type:
        fake_openai.script(FakeReply(status_code=500, error_message="the GPU caught fire"))
        with pytest.raises(Exception) as info:
            await aclient.chat.completions.create(model="fake-model", messages=MESSAGES)
        return type(info.value)

    instrumentor.uninstrument()
    plain = await error_type()
    instrumentor.instrument()
    with rollout() as scope:
        assert await error_type() is plain is openai.InternalServerError
    (span,) = sink.of(scope.rollout_id)
    assert span.status == "error" and "the GPU caught fire" in span.error
    assert span.attributes[semconv.ERROR_TYPE] == "InternalServerError"


def test_broken_stream_raises_what_the_plain_client_raises_and_marks_the_span(
    client, fake_openai, instrumentor, sink, rollout
):
    def consume() -> Any:
        fake_openai.script(FakeReply(content="a b c d e f g h", break_stream_after=3))
        return list(client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True))

    instrumentor.uninstrument()
    plain = _error_type(consume)
    instrumentor.instrument()
    with rollout() as scope:
        assert _error_type(consume) is plain
    (span,) = sink.of(scope.rollout_id)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == plain.__name__
    assert output_message(span)["content"] == "a b "  # what arrived before the break


def test_a_failing_store_never_affects_the_call(client, fake_openai, sink, rollout):
    class BrokenStore:
        def add_spans(self, spans: Any) -> None:
            raise OSError("disk full")

    tracer = get_tracer()
    tracer.set_store(BrokenStore())
    with rollout() as scope:
        completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.choices[0].message.content.startswith("FAKE")
    tracer.flush(0.3)  # the writer fails and retries
    tracer.set_store(sink)
    (span,) = sink.of(scope.rollout_id)  # delivered once the store works again
    assert span.attributes[semconv.RESPONSE_ID] == completion.id


def test_internal_error_before_the_call_sends_the_original_request(client, fake_openai, sink, rollout, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug in agl")

    monkeypatch.setattr(openai_client, "request_attributes", broken)
    before = internal_error_count("openai.request")
    with rollout() as scope:
        completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.choices[0].message.content
    assert internal_error_count("openai.request") == before + 1
    assert sent_token_id_flags(fake_openai) == [None]  # the user's own arguments
    assert sink.of(scope.rollout_id) == []


def test_internal_error_after_the_call_still_returns_and_ends_the_span(client, fake_openai, sink, rollout, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug in agl")

    monkeypatch.setattr(openai_client, "record_response", broken)
    before = internal_error_count()
    with rollout() as scope:
        completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.choices[0].message.content
    assert internal_error_count() == before + 1
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.REQUEST_MODEL] == "fake-model"


def test_internal_errors_in_streams_and_on_the_writer_thread_are_contained(
    client, fake_openai, sink, rollout, monkeypatch
):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug in agl")

    monkeypatch.setattr(streams.ChatStreamAccumulator, "add", broken)  # on the caller's thread
    monkeypatch.setattr(payloads, "_responses_output_messages", broken)  # on the writer thread
    fake_openai.script(FakeReply(content="one two"), FakeReply(content="three"))
    before = internal_error_count()
    with rollout() as scope:
        chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True))
        response = client.responses.create(model="fake-model", input="hi")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two"
    assert response.output_text == "three"
    streamed, responses_span = sink.of(scope.rollout_id)
    assert streamed.status == "unset"
    assert internal_error_count() == before + 1
    # the writer marks the one value it could not build and keeps the rest of the span
    assert responses_span.attributes[semconv.OUTPUT_MESSAGES] == "agl-encode-error: RuntimeError: bug in agl"
    assert responses_span.attributes[semconv.RESPONSE_TOKEN_IDS]


def test_with_raw_response_and_with_streaming_response_still_work(client, fake_openai, sink, rollout):
    with rollout() as scope:
        raw = client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
        assert raw.http_response.status_code == 200
        completion = raw.parse()
        with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES) as r:
            body = r.json()
    assert body["choices"][0]["message"]["content"]
    raw_span, streaming_span = sink.of(scope.rollout_id)
    assert raw_span.attributes[semconv.RESPONSE_TOKEN_IDS] == completion.choices[0].model_extra["token_ids"]
    assert streaming_span.attributes[semconv.REQUEST_MODEL] == "fake-model"


# --- hooking and unhooking ----------------------------------------------------------------------------------


def test_instrumenting_twice_equals_once(client, fake_openai, instrumentor, sink, rollout):
    assert instrumentor.instrument()
    other = OpenAIInstrumentor()
    other.instrument()
    try:
        with rollout() as scope:
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
            list(client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True))
            client.responses.create(model="fake-model", input="hi")
        assert len(sink.of(scope.rollout_id)) == len(fake_openai.requests) == 3
    finally:
        other.uninstrument()


def test_uninstrument_restores_the_exact_original_functions(fake_openai, sink, rollout):
    agl.instrumentation.uninstrument()
    originals = {cls: vars(cls)["create"] for cls in (Completions, AsyncCompletions, Responses, AsyncResponses)}
    inst = OpenAIInstrumentor()
    inst.instrument()
    for cls, original in originals.items():
        assert vars(cls)["create"] is not original and cls.create.__wrapped__ is original
    inst.uninstrument()
    for cls, original in originals.items():
        assert vars(cls)["create"] is original
    assert Completions.create is originals[Completions]
    with rollout() as scope:
        openai.OpenAI(base_url=fake_openai.base_url, api_key="x").chat.completions.create(
            model="fake-model", messages=MESSAGES
        )
    assert sink.of(scope.rollout_id) == [] and sent_token_id_flags(fake_openai) == [None]


def _warm_up(client: Any) -> None:
    """What LangChain's ChatOpenAI and LiteLLM do for every request: call through ``with_raw_response``."""
    client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES).parse()
    with client.chat.completions.with_streaming_response.create(model="fake-model", messages=MESSAGES) as r:
        r.read()
    client.responses.with_raw_response.create(model="fake-model", input="hi").parse()


def test_a_client_used_before_instrumenting_is_traced_after(fake_openai, sink, rollout):
    """The SDK caches its raw-response views per resource, binding ``create`` at first use: a client that
    made a warm-up call before agl.instrument() (then trainer.dev) had every later call go unrecorded."""
    agl.instrumentation.uninstrument()
    client = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    _warm_up(client)
    inst = OpenAIInstrumentor()
    inst.instrument()
    try:
        with rollout() as scope:
            _warm_up(client)
        assert [s.attributes[semconv.REQUEST_MODEL] for s in sink.of(scope.rollout_id)] == ["fake-model"] * 3
        assert sent_token_id_flags(fake_openai)[3:] == [True] * 3
    finally:
        inst.uninstrument()
    with rollout() as scope:  # and after uninstrumenting, the views it had before are back
        _warm_up(client)
    assert sink.of(scope.rollout_id) == [] and sent_token_id_flags(fake_openai)[6:] == [None] * 3


async def test_an_async_client_used_before_instrumenting_is_traced_after(fake_openai, sink, rollout):
    agl.instrumentation.uninstrument()
    async with openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0) as client:
        await client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
        inst = OpenAIInstrumentor()
        inst.instrument()
        try:
            with rollout() as scope:
                raw = await client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
                completion = raw.parse()
        finally:
            inst.uninstrument()
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == completion.choices[0].model_extra["token_ids"]


def test_methods_bound_while_instrumented_record_nothing_after_uninstrumenting(fake_openai, sink, rollout):
    agl.instrumentation.uninstrument()
    inst = OpenAIInstrumentor()
    inst.instrument()
    client = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    create = client.chat.completions.create  # bound (and a raw view built) while hooked
    raw = client.chat.completions.with_raw_response
    inst.uninstrument()
    with rollout() as scope:
        create(model="fake-model", messages=MESSAGES)
        raw.create(model="fake-model", messages=MESSAGES)
        client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
    assert sink.of(scope.rollout_id) == [] and sent_token_id_flags(fake_openai) == [None] * 3
    inst.instrument()  # hooked again: each call is recorded once, whichever way it was bound
    try:
        with rollout() as scope:
            create(model="fake-model", messages=MESSAGES)
            raw.create(model="fake-model", messages=MESSAGES)
            client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
        assert len(sink.of(scope.rollout_id)) == 3
    finally:
        inst.uninstrument()


async def test_exactly_one_llm_span_per_http_request(client, aclient, fake_openai, sink, rollout):
    with rollout() as scope:
        for _ in range(3):
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        list(client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True))
        await aclient.chat.completions.create(model="fake-model", messages=MESSAGES)
        await asyncio.gather(*(aclient.responses.create(model="fake-model", input="hi") for _ in range(3)))
    spans = sink.of(scope.rollout_id)
    assert len(spans) == len(fake_openai.requests) == 8
    assert len({s.attributes[semconv.RESPONSE_ID] for s in spans}) == 8  # one span per distinct answer


def test_spans_outside_rollouts_are_not_stored(client, fake_openai, sink):
    before = get_tracer().stats().unscoped
    completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert get_tracer().flush(10)
    assert get_tracer().stats().unscoped == before + 1
    assert not [s for s in sink.spans if s.attributes.get(semconv.RESPONSE_ID) == completion.id]


def test_suppressed_llm_span_gets_the_attributes_instead_of_a_second_span(client, fake_openai, sink, rollout):
    with rollout() as scope:
        with get_tracer().span("adapter model call", "llm"), llm_span_already_open():
            completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    (span,) = sink.of(scope.rollout_id)
    assert span.name == "adapter model call"
    assert span.attributes[semconv.REQUEST_MODEL] == "fake-model"
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == completion.choices[0].model_extra["token_ids"]
    assert json.loads(span.attributes[semconv.INPUT_MESSAGES]) == MESSAGES


# --- concurrency --------------------------------------------------------------------------------------------


def test_concurrent_rollouts_in_threads_land_in_their_own_rollouts(client, fake_openai, sink, rollout):
    ids = ["ro-thread-a", "ro-thread-b"]
    barrier = threading.Barrier(2)

    def run(rollout_id: str) -> None:
        messages = [{"role": "user", "content": rollout_id}]
        with rollout(rollout_id):
            barrier.wait()
            ask = propagate(lambda: client.chat.completions.create(model="fake-model", messages=messages))
            with ThreadPoolExecutor(2) as pool:
                for future in [pool.submit(ask) for _ in range(3)]:
                    future.result()

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid in ids:
        spans = sink.of(rid)
        assert len(spans) == 3
        assert all(json.loads(s.attributes[semconv.INPUT_MESSAGES])[0]["content"] == rid for s in spans)
        assert sorted(s.sequence_id for s in spans) == [0, 1, 2]


def test_a_call_made_in_a_thread_without_the_rollouts_context_is_said_once(
    client, fake_openai, sink, caplog, monkeypatch
):
    """A thread of the agent's own does not inherit contextvars: its calls are outside the rollout and lost.
    Before, only a debug line said so (users saw 'no llm calls' and empty triplets); now a warning says how
    to carry the context, once. agl.propagate's call lands in the rollout."""
    from agl.tracing import tracer as tracer_module

    monkeypatch.setattr(tracer_module.get_tracer().processor, "_warned_stray_call", False)
    ask = lambda: client.chat.completions.create(model="fake-model", messages=MESSAGES)  # noqa: E731 - a one-line callable handed on

    def in_thread(fn) -> None:
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()

    with caplog.at_level("WARNING", logger="agl.tracing.tracer"):
        with agl.rollout_scope("ro-stray", "at-1"):
            in_thread(ask)
            in_thread(ask)
            in_thread(agl.propagate(ask))
        ask()  # no rollout running: an ordinary call outside training, nothing said
    assert len(sink.of("ro-stray")) == 1  # only agl.propagate's call
    warnings = [r.getMessage() for r in caplog.records if "outside every rollout" in r.getMessage()]
    assert len(warnings) == 1
    assert "wrap the function with agl.propagate(fn), or submit with agl.submit(executor, fn, ...)" in warnings[0]


def test_thread_pool_tasks_submitted_in_a_rollout_stay_in_it(client, fake_openai, sink):
    """agl.instrument() hooks ThreadPoolExecutor.submit: a task carries the rollout of the code that submitted
    it (the pool's workers inherit nothing), captured per submit, so one pool serves two rollouts correctly;
    loop.run_in_executor goes through submit too. uninstrument() puts submit back."""
    import asyncio

    ask = lambda: client.chat.completions.create(model="fake-model", messages=MESSAGES)  # noqa: E731 - a one-line callable handed on
    agl.instrument(frameworks=[])
    try:
        with ThreadPoolExecutor(2) as pool:
            for rollout_id in ("ro-pool-a", "ro-pool-b"):
                with agl.rollout_scope(rollout_id, "at-1"):
                    for future in [pool.submit(ask) for _ in range(2)] + [pool.submit(ask)]:
                        future.result()
                    list(pool.map(lambda _: ask(), range(2)))

            async def in_executor() -> None:
                await asyncio.get_running_loop().run_in_executor(pool, ask)

            with agl.rollout_scope("ro-pool-c", "at-1"):
                asyncio.run(in_executor())
            pool.submit(ask).result()  # outside rollouts: unchanged, stored nowhere
    finally:
        agl.uninstrument()
    assert [len(sink.of(r)) for r in ("ro-pool-a", "ro-pool-b", "ro-pool-c")] == [5, 5, 1]
    assert not hasattr(ThreadPoolExecutor.submit, "__wrapped__")


async def test_concurrent_rollouts_in_asyncio_tasks_land_in_their_own_rollouts(aclient, fake_openai, sink, rollout):
    async def run(rollout_id: str) -> None:
        with rollout(rollout_id):
            for _ in range(2):
                await aclient.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": rollout_id}]
                )
                await asyncio.sleep(0)

    ids = ["ro-task-a", "ro-task-b"]
    await asyncio.gather(*(asyncio.create_task(run(rid)) for rid in ids))
    for rid in ids:
        spans = sink.of(rid)
        assert len(spans) == 2
        assert all(json.loads(s.attributes[semconv.INPUT_MESSAGES])[0]["content"] == rid for s in spans)


def test_a_failure_reported_inside_a_responses_stream_marks_the_span(sink, rollout):
    """``response.failed`` arrives as an event, not an exception (the fake server cannot send one)."""
    failed = SimpleNamespace(
        id="resp_1",
        model="fake-model",
        status="failed",
        usage=None,
        output=[],
        incomplete_details=None,
        error=SimpleNamespace(code="server_error", message="the model crashed"),
    )
    with rollout() as scope:
        call, _ = openai_client._begin("responses", None, {"model": "fake-model", "input": "hi", "stream": True}, None)
        accumulator = streams.ResponsesStreamAccumulator(with_logprobs=False)
        accumulator.add(SimpleNamespace(type="response.failed", response=failed))
        call.end_stream(accumulator, None)
    (span,) = sink.of(scope.rollout_id)
    assert span.status == "error" and span.error == "the model crashed"
    assert span.attributes[semconv.ERROR_TYPE] == "server_error"
    assert span.attributes[semconv.RESPONSE_ID] == "resp_1"


def test_structured_output_parse_is_one_llm_span(chat_helpers, fake_openai, sink, rollout):
    """`chat.completions.parse` does not go through `create`; it must still be traced, once."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    fake_openai.script(FakeReply(content='{"value": 42}'))
    with rollout() as scope:
        parsed = chat_helpers.parse(model="fake-model", messages=MESSAGES, response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(value=42)
    (span,) = sink.of(scope.rollout_id)
    assert span.kind == "llm" and span.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert len([r for r in fake_openai.requests if r["path"].endswith("/chat/completions")]) == 1


def _assert_recorded_unparsed(span: Any, fake_openai: Any, content: str) -> None:
    assert span.status != "error" and span.attributes[semconv.PARSE_ERROR].startswith("ValidationError: ")
    assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, content)
    assert output_message(span)["content"] == content


def test_structured_output_that_does_not_parse_raises_as_before_and_is_recorded(
    chat_helpers, client, fake_openai, sink, rollout
):
    """A structured answer that is not valid JSON raised inside the SDK's ``parse`` and took the completion
    with it: the span had no response and no token ids (`agl export` refused the rollout, the AutoGen path
    even marked the call failed), though that is exactly a sample an RL run must learn from (CrewAI retries
    such answers; a small model writes them). Both ``parse`` and ``with_raw_response...parse()``."""
    from pydantic import BaseModel, ValidationError

    class Answer(BaseModel):
        value: int

    bad = "The value is seven"
    errors = internal_error_count()
    with rollout() as scope:
        fake_openai.script(FakeReply(content=bad))
        with pytest.raises(ValidationError):
            chat_helpers.parse(model="fake-model", messages=MESSAGES, response_format=Answer)
        fake_openai.script(FakeReply(content=bad))
        raw = chat_helpers.with_raw_response.parse(model="fake-model", messages=MESSAGES, response_format=Answer)
        with pytest.raises(ValidationError):
            raw.parse()
        fake_openai.script(FakeReply(content='{"value": 7}'))
        parsed = chat_helpers.parse(model="fake-model", messages=MESSAGES, response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(value=7)
    first, second, third = sink.of(scope.rollout_id)
    for span in (first, second):
        _assert_recorded_unparsed(span, fake_openai, bad)
    assert semconv.PARSE_ERROR not in third.attributes and third.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert len(fake_openai.requests) == 3 and internal_error_count() == errors


def test_responses_structured_output_that_does_not_parse_is_recorded(client, fake_openai, sink, rollout):
    from pydantic import BaseModel, ValidationError

    class Answer(BaseModel):
        value: int

    fake_openai.script(FakeReply(content="seven"), FakeReply(content='{"value": 7}'))
    with rollout() as scope:
        with pytest.raises(ValidationError):
            client.responses.parse(model="fake-model", input="hi", text_format=Answer)
        assert client.responses.parse(model="fake-model", input="hi", text_format=Answer).output_parsed == Answer(
            value=7
        )
    bad, good = sink.of(scope.rollout_id)
    assert bad.attributes[semconv.PARSE_ERROR].startswith("ValidationError: ") and bad.status != "error"
    assert bad.attributes[semconv.RESPONSE_TOKEN_IDS] == response_ids(fake_openai, "seven")
    assert semconv.PARSE_ERROR not in good.attributes and good.attributes[semconv.RESPONSE_TOKEN_IDS]


def test_async_structured_output_that_does_not_parse_is_recorded(fake_openai, instrumentor, sink, rollout):
    from pydantic import BaseModel, ValidationError

    class Answer(BaseModel):
        value: int

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0) as aclient:
            helpers = (
                aclient.chat.completions
                if hasattr(aclient.chat.completions, "parse")
                else aclient.beta.chat.completions
            )
            with pytest.raises(ValidationError):
                await helpers.parse(model="fake-model", messages=MESSAGES, response_format=Answer)

    fake_openai.script(FakeReply(content="seven"))
    with rollout() as scope:
        asyncio.run(main())
    (span,) = sink.of(scope.rollout_id)
    _assert_recorded_unparsed(span, fake_openai, "seven")


def test_streamed_raw_responses_are_reassembled_when_parsed(client, fake_openai, sink, rollout):
    """The Agents SDK streams the Responses API with with_streaming_response.create(stream=True) + parse()."""
    with rollout() as scope:
        with client.responses.with_streaming_response.create(model="fake-model", input="hi", stream=True) as raw:
            events = [event.type for event in raw.parse()]
        with client.chat.completions.with_streaming_response.create(
            model="fake-model", messages=MESSAGES, stream=True
        ) as raw:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert "response.completed" in events and text
    responses_span, chat_span = sink.of(scope.rollout_id)
    for span in (responses_span, chat_span):
        assert span.attributes[semconv.LLM_STREAM] is True
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] and span.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert fake_openai.tokenizer.decode(chat_span.attributes[semconv.RESPONSE_TOKEN_IDS]) == text


def test_outside_rollouts_a_call_goes_as_written_without_a_span(client, fake_openai, sink, rollout):
    """Outside every rollout nothing would store the call's span, so agl starts none (its cost was ~30 us a
    call): the request carries the user's own arguments, and the user's spans see no agl span as parent."""
    from opentelemetry import trace as otel_trace

    seen: List[Any] = []

    def request_hook(request: Any) -> None:  # runs on the calling thread, inside the SDK's call
        seen.append((otel_trace.get_current_span(), json.loads(request.content)))

    http = type(client._client)(event_hooks={"request": [request_hook]})
    hooked = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0, http_client=http)
    before = get_tracer().stats().unscoped
    hooked.chat.completions.create(model="fake-model", messages=MESSAGES)
    with rollout() as scope:
        hooked.chat.completions.create(model="fake-model", messages=MESSAGES)
    (outside_span, outside_body), (inside_span, inside_body) = seen
    assert not outside_span.get_span_context().is_valid and "return_token_ids" not in outside_body
    assert inside_span.get_span_context().is_valid and inside_body.get("return_token_ids") is True
    assert get_tracer().stats().unscoped == before + 1 and len(sink.of(scope.rollout_id)) == 1


def test_queued_spans_keep_no_answer_objects_alive(client, fake_openai, rollout):
    """While a span waits for the writer (a CPU-bound agent starves its thread), it holds plain values only: a
    span that kept the answer's logprob objects made the collector walk them at every collection until then."""
    from openai.types.chat import ChatCompletionTokenLogprob

    released = threading.Event()

    class SlowSink:
        def add_spans(self, spans: List[Any]) -> int:
            released.wait(10)
            return len(spans)

    tracer = get_tracer()
    previous = tracer.store
    tracer.set_store(SlowSink())
    try:
        with rollout():
            for _ in range(5):
                client.chat.completions.create(model="fake-model", messages=MESSAGES, logprobs=True)
        gc.collect()
        alive = sum(type(o) is ChatCompletionTokenLogprob for o in gc.get_objects())  # type(): lazy proxies raise
    finally:
        released.set()
        tracer.flush(10)
        tracer.set_store(previous)
    assert alive == 0
