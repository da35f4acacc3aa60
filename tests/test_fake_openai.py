"""The fake OpenAI server, checked with the real ``openai`` client: if the client parses it, frameworks do."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from agl.testing import FakeOpenAIServer, FakeReply, FakeTokenizer

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ADD_FUNCTION = {
    "type": "function",
    "name": "add",
    "strict": True,
    **{k: ADD_TOOL["function"][k] for k in ("description", "parameters")},
}
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]
TOKEN_IDS = {"return_token_ids": True}
# openai 3 wraps a connection dropped mid-stream in APIConnectionError; openai 2 lets httpx's error through.
STREAM_BROKEN = (openai.APIConnectionError, httpx.TransportError)


@pytest.fixture
def client(fake_openai: FakeOpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)


@pytest.fixture
def async_client(fake_openai: FakeOpenAIServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)


def extra(model: Any, key: str) -> Any:
    """A vLLM extension field, which the client keeps in ``model_extra``."""
    return (model.model_extra or {})[key]


# --- chat completions ------------------------------------------------------------------------------------


def test_default_answer_echoes_the_user_and_requests_are_logged(
    fake_openai: FakeOpenAIServer, client: openai.OpenAI
) -> None:
    resp = client.chat.completions.create(model="m", messages=QUESTION)

    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.created > 0
    assert resp.choices[0].message.content == "FAKE: What is 3 + 4?"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    [logged] = fake_openai.requests
    assert logged["path"] == "/v1/chat/completions"
    assert logged["body"]["messages"] == QUESTION
    assert logged["headers"]["authorization"] == "Bearer x"


def test_models_are_listed(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-model"]


def test_script_is_consumed_in_order_across_endpoints_then_the_policy_answers(
    fake_openai: FakeOpenAIServer, client: openai.OpenAI
) -> None:
    fake_openai.script(FakeReply("first"), FakeReply("second"))

    first = client.chat.completions.create(model="m", messages=QUESTION)
    second = client.responses.create(model="m", input="hi")
    third = client.chat.completions.create(model="m", messages=QUESTION)

    assert first.choices[0].message.content == "first"
    assert second.output_text == "second"
    assert third.choices[0].message.content == "FAKE: What is 3 + 4?"
    fake_openai.reset()
    assert fake_openai.requests == []


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    call_resp = client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD_TOOL])
    [call] = call_resp.choices[0].message.tool_calls or []
    assert call_resp.choices[0].finish_reason == "tool_calls"
    assert call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}

    messages = [
        *QUESTION,
        call_resp.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "7"},
    ]
    final = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
    assert final.choices[0].message.content == "The answer is 7."
    assert final.choices[0].finish_reason == "stop"


def test_policy_answers_from_the_tool_after_a_frameworks_nudge_but_not_a_new_question(client: openai.OpenAI) -> None:
    """CrewAI follows each tool result with a user message ("Analyze the tool result..."): in a tool loop, a
    user message without numbers after a tool's answer is a nudge, and the answer stands; a new question
    (numbers) calls the tool again; without tools, the message is answered as text."""
    answered = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    nudge = {"role": "user", "content": "Analyze the tool result. If requirements are met, provide the Final Answer."}

    def reply(messages: list, tools: list) -> Any:
        return client.chat.completions.create(model="m", messages=messages, **({"tools": tools} if tools else {}))

    assert reply([*answered, nudge], [ADD_TOOL]).choices[0].message.content == "The answer is 7."
    again = reply([*answered, {"role": "user", "content": "And 5 + 6?"}], [ADD_TOOL]).choices[0].message
    assert json.loads(again.tool_calls[0].function.arguments) == {"a": 5, "b": 6}
    assert reply([*answered, nudge], []).choices[0].message.content == "FAKE: " + nudge["content"]


def test_policy_fills_strings_with_the_user_text_and_honours_tool_choice(client: openai.OpenAI) -> None:
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }

    resp = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        tools=[ADD_TOOL, search],
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    [call] = resp.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "search",
        {"query": "What is 3 + 4?"},
    )
    no_tools = client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD_TOOL], tool_choice="none")
    assert no_tools.choices[0].message.content == "FAKE: What is 3 + 4?"


def test_scripted_tool_calls_keep_malformed_arguments_verbatim(
    fake_openai: FakeOpenAIServer, client: openai.OpenAI
) -> None:
    fake_openai.script(
        FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": '{"a": 1,'}])
    )

    calls = client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD_TOOL]).choices[0].message.tool_calls

    assert [c.function.arguments for c in calls or []] == ['{"a": 1}', '{"a": 1,']


def test_streamed_answer_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, stream=True, stream_options={"include_usage": True}
        )
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "FAKE: What is 3 + 4?"
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(text.encode())


def test_streamed_tool_call_with_token_ids(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, tools=[ADD_TOOL], stream=True, extra_body=TOKEN_IDS
        )
    )

    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "add"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments) == {"a": 3, "b": 4}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    tokenizer = fake_openai.tokenizer
    response_ids = [i for c in chunks for i in extra(c.choices[0], "token_ids")]
    assert tokenizer.decode(response_ids) == json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}})
    assert tokenizer.decode(extra(chunks[0], "prompt_token_ids")) == tokenizer.apply_chat_template(QUESTION, [ADD_TOOL])
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])


def test_chat_stream_helper_accumulates(chat_helpers: Any) -> None:
    with chat_helpers.stream(model="m", messages=QUESTION, tools=[ADD_TOOL]) as stream:
        final = stream.get_final_completion()

    [call] = final.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    assert final.choices[0].finish_reason == "tool_calls"


def test_token_ids_match_the_chat_template_and_prefix_the_next_turn(
    fake_openai: FakeOpenAIServer, client: openai.OpenAI
) -> None:
    tokenizer = fake_openai.tokenizer
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD_TOOL], extra_body=TOKEN_IDS)
    prompt_ids, response_ids = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    assert tokenizer.decode(prompt_ids) == tokenizer.apply_chat_template(QUESTION, [ADD_TOOL])
    assert first.usage and (first.usage.prompt_tokens, first.usage.completion_tokens) == (
        len(prompt_ids),
        len(response_ids),
    )

    [call] = first.choices[0].message.tool_calls or []
    messages = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "7"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], extra_body=TOKEN_IDS)
    assert extra(second, "prompt_token_ids")[: len(prompt_ids) + len(response_ids)] == prompt_ids + response_ids
    assert tokenizer.decode(extra(second.choices[0], "token_ids")) == "The answer is 7."


def test_token_ids_only_when_asked_or_always_on(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="m", messages=QUESTION)
    assert "prompt_token_ids" not in (plain.model_extra or {})
    assert "token_ids" not in (plain.choices[0].model_extra or {})

    fake_openai.always_token_ids = True
    resp = client.chat.completions.create(model="m", messages=QUESTION)
    assert fake_openai.tokenizer.decode(extra(resp.choices[0], "token_ids")) == "FAKE: What is 3 + 4?"


def test_logprobs_one_per_token_plain_and_streamed(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="m", messages=QUESTION, logprobs=True, extra_body=TOKEN_IDS)
    entries = resp.choices[0].logprobs.content if resp.choices[0].logprobs else None
    assert entries is not None and len(entries) == len(extra(resp.choices[0], "token_ids"))
    assert [e.logprob for e in entries[:4]] == pytest.approx([-0.05, -0.1, -0.15, -0.05])
    assert "".join(e.token for e in entries) == "FAKE: What is 3 + 4?"

    chunks = client.chat.completions.create(model="m", messages=QUESTION, logprobs=True, stream=True)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


async def test_async_client_plain_and_streamed(fake_openai: FakeOpenAIServer, async_client: openai.AsyncOpenAI) -> None:
    fake_openai.script(FakeReply("hello async"))
    resp = await async_client.chat.completions.create(model="m", messages=QUESTION)
    assert resp.choices[0].message.content == "hello async"

    stream = await async_client.chat.completions.create(model="m", messages=QUESTION, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "FAKE: What is 3 + 4?"


# --- responses --------------------------------------------------------------------------------------------


def test_responses_plain_text_with_token_ids(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    resp = client.responses.create(model="m", input="hello", instructions="Be brief.", extra_body=TOKEN_IDS)

    assert resp.id.startswith("resp_") and resp.status == "completed"
    assert resp.output_text == "FAKE: hello"
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    tokenizer = fake_openai.tokenizer
    assert tokenizer.decode(extra(resp, "prompt_token_ids")) == tokenizer.apply_chat_template(chat)
    assert tokenizer.decode(extra(resp, "response_token_ids")) == "FAKE: hello"
    assert resp.usage and resp.usage.output_tokens == len(extra(resp, "response_token_ids"))


def test_responses_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(model="m", input=QUESTION, tools=[ADD_FUNCTION])
    [call] = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 3, "b": 4})

    follow_up = [
        *QUESTION,
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "7"},
    ]
    final = client.responses.create(model="m", input=follow_up, tools=[ADD_FUNCTION])
    assert final.output_text == "The answer is 7."


def test_responses_streamed_events_with_a_function_call(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model="m", input=QUESTION, tools=[ADD_FUNCTION], stream=True, extra_body=TOKEN_IDS)
    )

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 2,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    completed = events[-1].response
    assert completed.output[0].type == "function_call" and json.loads(completed.output[0].arguments) == {
        "a": 3,
        "b": 4,
    }
    assert "response_token_ids" in (completed.model_extra or {})


def test_responses_stream_helper_with_text_and_logprobs(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="hi there", include=["message.output_text.logprobs"]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()

    assert "".join(deltas) == final.output_text == "FAKE: hi there"
    logprobs = final.output[0].content[0].logprobs
    assert logprobs is not None and len(logprobs) == len("FAKE: hi there")


# --- errors and transport faults ---------------------------------------------------------------------------


def test_error_status_raises_with_the_message(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    fake_openai.script(
        FakeReply(status_code=400, error_message="bad prompt"),
        FakeReply(status_code=429),
        FakeReply(status_code=503),
    )

    with pytest.raises(openai.BadRequestError, match="bad prompt") as bad:
        client.chat.completions.create(model="m", messages=QUESTION)
    assert bad.value.status_code == 400 and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model="m", input="hi")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="m", messages=QUESTION, stream=True)


def test_client_retries_consume_the_script(fake_openai: FakeOpenAIServer) -> None:
    fake_openai.script(FakeReply(status_code=500), FakeReply("recovered"))
    retrying = openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=1)

    assert retrying.chat.completions.create(model="m", messages=QUESTION).choices[0].message.content == "recovered"
    assert len(fake_openai.requests) == 2


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="m", messages=None)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model="m", prompt=[["nested"]])  # type: ignore[list-item]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="m", input="hi")


def test_a_responses_input_item_it_cannot_map_is_a_400_and_uses_no_scripted_reply(
    fake_openai: FakeOpenAIServer, client: openai.OpenAI
) -> None:
    fake_openai.script(FakeReply(content="scripted"))
    with pytest.raises(openai.BadRequestError, match="input item type 'reasoning' is not supported"):
        client.responses.create(model="m", input=[{"type": "reasoning", "id": "rs_1", "summary": []}])
    assert client.responses.create(model="m", input="hi").output_text == "scripted"


def test_broken_stream_raises_in_the_client(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    fake_openai.script(FakeReply(break_stream_after=2))
    received = []

    with pytest.raises(STREAM_BROKEN):
        for chunk in client.chat.completions.create(model="m", messages=QUESTION, stream=True):
            received.append(chunk)
    assert len(received) == 2


async def test_broken_responses_stream_raises_in_the_async_client(
    fake_openai: FakeOpenAIServer, async_client: openai.AsyncOpenAI
) -> None:
    fake_openai.script(FakeReply("never finished", break_stream_after=3))

    stream = await async_client.responses.create(model="m", input="hi", stream=True)
    with pytest.raises(STREAM_BROKEN):
        async for _ in stream:
            pass


def test_delay_trips_client_timeouts(fake_openai: FakeOpenAIServer, client: openai.OpenAI) -> None:
    fake_openai.script(FakeReply(delay=0.5))

    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.1).chat.completions.create(model="m", messages=QUESTION)


# --- tokenizer and lifecycle -------------------------------------------------------------------------------


def test_tokenizer_round_trips_bytes_and_renders_chatml() -> None:
    tokenizer = FakeTokenizer()
    assert tokenizer.decode(tokenizer.encode("héllo ✓")) == "héllo ✓"
    assert len(tokenizer.encode("é")) == 2

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
        tools=[ADD_TOOL],
    )
    assert rendered == (
        f"<|im_start|>system\n# Tools\n\n{json.dumps(ADD_TOOL)}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n{"name": "add", "arguments": {"a": 1}}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_server_lifecycle() -> None:
    server = FakeOpenAIServer(always_token_ids=True).start()
    try:
        resp = openai.OpenAI(base_url=server.base_url, api_key="x").chat.completions.create(
            model="m", messages=QUESTION
        )
        assert "prompt_token_ids" in (resp.model_extra or {})
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.base_url


def test_completions_prompt_of_a_real_tokenizers_ids_is_answered(client: openai.OpenAI) -> None:
    """Token-in agents send their own tokenizer's ids; the byte-level fake model reads the ids below 256."""
    completion = client.completions.create(model="m", prompt=[500, 72, 105], extra_body={"return_token_ids": True})
    assert completion.choices[0].text == "FAKE: Hi"
    assert completion.choices[0].model_extra["prompt_token_ids"] == [500, 72, 105]
