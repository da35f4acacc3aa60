"""Re-tokenizing calls with tool calls through a real Hugging Face chat template (``LightningRL(tokenizer=...)``):
SmolLM2's template writes only ``content``, so a tool-call-only answer (no ``content`` key) used to crash it
with a raw jinja2 error and sink the whole batch. Now messages are normalised first, a call whose tool calls
the template cannot render is skipped under its own reason, and any other failure skips that call only."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, List

import pytest
from openai import OpenAI

import agl
from agl import semconv
from agl.instrumentation.framework import agent_span
from agl.lightningrl import LightningRL
from agl.lightningrl.retokenize import (
    SKIP_RETOKENIZE_FAILED,
    SKIP_TOOL_CALLS_NOT_RENDERED,
    RetokenizeError,
    Retokenizer,
)
from agl.lightningrl.synthetic import TraceBuilder
from agl.serving.models import smollm2_tokenizer
from agl.testing import FakeReply
from agl.types import Rollout, Span

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "add 2 3"}]
# a ChatML template that writes tool calls (arguments as the object they encode, as transformers expects)
# and concatenates content like SmolLM2's, so a null content would still fail in it
TOOL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + "
    "'\n</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2: Any) -> Any:
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


@pytest.fixture
def instrumented():
    agl.instrument()
    yield
    agl.uninstrument()


def tool_call_answer(b: TraceBuilder, messages: List[dict], arguments: str = '{"a": 2, "b": 3}') -> Span:
    """A tool-call-only answer recorded as the openai client records it: no ``content`` key at all."""
    span = b.llm(None, None, messages=messages, content=None)
    span.attributes[semconv.OUTPUT_MESSAGES] = json.dumps(
        [
            {
                "role": "assistant",
                "annotations": [],
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}
                ],
            }
        ]
    )
    span.attributes[semconv.TOOL_DEFINITIONS] = json.dumps(TOOLS)
    span.attributes[semconv.RESPONSE_FINISH_REASONS] = ["tool_calls"]
    return span


HISTORY = QUESTION + [
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]


def test_plain_agent_with_a_tool_call_no_longer_sinks_the_batch(smollm2, fake_openai, sink, instrumented, caplog):
    """The probe's repro: a real openai-client agent whose first call answers with a tool call only, its ids
    stripped. The tool-call answer is skipped under its reason (SmolLM2's template cannot write it), with one
    warning naming it; the call after it, whose history holds the call, is re-tokenized (one warning that its
    history's tool calls are dropped); the batch is built."""
    client = OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0)
    fake_openai.script(FakeReply(tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]), FakeReply(content="5"))
    with agl.rollout_scope("ro-retok", "at-1"):
        with agent_span("calc", "test"):
            messages = list(QUESTION)
            first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            message = first.choices[0].message
            messages += [
                message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"},
            ]
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    spans = [
        s.model_copy(update={"attributes": {**s.attributes, semconv.TOKEN_IDS_SOURCE: "absent"}})
        if s.kind == "llm"
        else s
        for s in sink.of("ro-retok")
    ]
    for span in spans:
        for key in (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS, semconv.RESPONSE_LOGPROBS):
            span.attributes.pop(key, None)
    llm = [s for s in spans if s.kind == "llm"]
    assert "content" not in json.loads(llm[0].attributes[semconv.OUTPUT_MESSAGES])[0]  # as the probe recorded it
    rollout = Rollout(rollout_id="ro-retok", task_id="t", status="succeeded", final_reward=1.0)
    with caplog.at_level(logging.WARNING, logger="agl.lightningrl"):
        batch = LightningRL(tokenizer=smollm2).batch_from_spans([rollout], [(rollout, spans)])
    assert batch.report.skipped == {SKIP_TOOL_CALLS_NOT_RENDERED: 1}
    assert batch.report.retokenized == 1 and batch.report.transitions == 1 and batch.report.accounted
    assert batch.transitions[0].span_id == llm[1].span_id
    skips = [r.getMessage() for r in caplog.records if "skipped an llm call" in r.getMessage()]
    assert len(skips) == 1 and llm[0].span_id in skips[0] and "pass token ids from the server" in skips[0]
    dropped = [r.getMessage() for r in caplog.records if "history of llm span" in r.getMessage()]
    assert len(dropped) == 1 and llm[1].span_id in dropped[0]


def test_a_span_the_template_fails_on_is_skipped_alone(smollm2: Any, caplog) -> None:
    """Whatever the template raises, only that call is lost: counted as ``cannot re-tokenize``, one warning."""
    broken = copy.deepcopy(smollm2)
    broken.chat_template = (
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('this template refuses') }}"
        "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    b = TraceBuilder()
    b.llm(None, None, content="fine", messages=QUESTION)
    bad = b.llm(None, None, content="fine", messages=[{"role": "user", "content": "boom"}])
    spans = b.finish()
    rollout = Rollout(rollout_id="ro-1", task_id="t", status="succeeded", final_reward=1.0)
    with pytest.raises(RetokenizeError, match=bad.span_id) as raised:
        Retokenizer(broken).ids(bad)
    assert raised.value.reason == SKIP_RETOKENIZE_FAILED and "this template refuses" in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="agl.lightningrl"):
        batch = LightningRL(tokenizer=broken).batch_from_spans([rollout], [(rollout, spans)])
    assert batch.report.skipped == {SKIP_RETOKENIZE_FAILED: 1} and batch.report.transitions == 1
    assert sum(bad.span_id in r.getMessage() for r in caplog.records) == 1


def test_tool_call_answer_the_template_cannot_render_is_skipped(smollm2: Any) -> None:
    """SmolLM2's template with the tool calls or without them writes the same: an empty response, not a sample."""
    b = TraceBuilder()
    span = tool_call_answer(b, QUESTION)
    with pytest.raises(RetokenizeError, match="does not render tool calls") as raised:
        Retokenizer(smollm2).ids(span)
    assert raised.value.reason == SKIP_TOOL_CALLS_NOT_RENDERED


def test_text_with_tool_calls_the_template_drops_is_not_trained_as_text_alone(smollm2: Any) -> None:
    b = TraceBuilder()
    span = b.llm(
        None,
        None,
        messages=QUESTION,
        content="Let me add.",
        tool_calls=[{"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'}],
    )
    with pytest.raises(RetokenizeError) as raised:
        Retokenizer(smollm2).ids(span)
    assert raised.value.reason == SKIP_TOOL_CALLS_NOT_RENDERED


def test_tool_calls_render_through_a_template_that_writes_them(tool_tokenizer: Any) -> None:
    """Normalised messages: the missing content is "", the arguments the object they encode; the response is
    what the template writes for the call, up to and with its end-of-turn token."""
    end_of_turn = tool_tokenizer.convert_tokens_to_ids("<|im_end|>")
    b = TraceBuilder()
    span = tool_call_answer(b, HISTORY)  # a history with a tool call, and an answer with one
    prompt, response = Retokenizer(tool_tokenizer).ids(span)
    normalised = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    prompt_text = tool_tokenizer.apply_chat_template(normalised, tokenize=False, add_generation_prompt=True)
    assert prompt == tool_tokenizer.encode(prompt_text, add_special_tokens=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt_text
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert response == tool_tokenizer.encode(call, add_special_tokens=False) + [end_of_turn]


def test_unparsable_arguments_are_rendered_as_sent(tool_tokenizer: Any) -> None:
    b = TraceBuilder()
    span = tool_call_answer(b, QUESTION, arguments='{"a": 2, "b')
    _, response = Retokenizer(tool_tokenizer).ids(span)
    assert tool_tokenizer.decode(response).startswith('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2, \\"b"}')


def test_history_tool_calls_the_template_drops_warn_once(smollm2: Any, caplog) -> None:
    """The prompt is still what the template writes (the call is lost from it), with one warning per
    Retokenizer, however many prompts hold tool calls."""
    retokenizer = Retokenizer(smollm2)
    b = TraceBuilder()
    first = b.llm(None, None, content="It is 5.", messages=HISTORY)
    b.llm(None, None, content="It is 5.", messages=HISTORY)
    with caplog.at_level(logging.WARNING, logger="agl.lightningrl"):
        for span in b.finish():
            if span.kind == "llm":
                prompt, response = retokenizer.ids(span)
                assert prompt and response
    warnings = [r.getMessage() for r in caplog.records if "history of llm span" in r.getMessage()]
    assert len(warnings) == 1 and first.span_id in warnings[0]
