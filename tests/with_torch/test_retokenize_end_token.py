"""Re-tokenization (``LightningRL(tokenizer=...)``) ends a response with the end-of-turn token only when the
model sampled it: not when the call ended on one of the request's ``stop`` strings (finish reason ``stop``
as well, but the server's ids end with the stop string's tokens), and not for a stream that ended
mid-answer. Calls are recorded with the real ``openai`` client against the fake server, without token ids,
and re-tokenized with SmolLM2's tokenizer and chat template."""

from __future__ import annotations

from typing import Any, Iterator, List

import openai
import pytest

import agl.instrumentation
from agl import semconv
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.lightningrl.retokenize import Retokenizer
from agl.lightningrl.transitions import extract_transitions
from agl.lightningrl.tree import build_tree
from agl.testing import FakeReply, ListSink, tracer_writes_to
from agl.tracing.context import rollout_scope
from agl.types import Span

MESSAGES = [{"role": "user", "content": "Name a fruit."}]
ANSWER = "a ripe pear and some more words"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from agl.serving.models import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture
def client(fake_openai: Any) -> Iterator[openai.OpenAI]:
    agl.instrumentation.uninstrument()  # a test elsewhere may have left agl.instrument() on
    instrumentor = OpenAIInstrumentor()
    assert instrumentor.instrument()
    try:
        with openai.OpenAI(base_url=fake_openai.base_url, api_key="x", max_retries=0) as c:
            yield c
    finally:
        instrumentor.uninstrument()


def recorded(calls: Any) -> List[Span]:
    """The llm spans of ``calls(...)`` run in a rollout whose server is not asked for token ids."""
    with tracer_writes_to(ListSink()) as sink:
        with rollout_scope("ro-end-token", "at-1", request_token_ids=False):
            calls()
        spans = sink.of("ro-end-token", "llm")
    assert all(semconv.RESPONSE_TOKEN_IDS not in s.attributes for s in spans)
    return spans


def test_a_call_that_ended_on_a_stop_string_gets_no_end_token(client, fake_openai, tokenizer):
    """Finish reason ``stop`` from a stop string was re-tokenized with ``<|im_end|>`` appended: a token the model
    never sampled (its ids end with the stop string's tokens), trained as if it had stopped there."""
    fake_openai.script(FakeReply(content=ANSWER), FakeReply(content=ANSWER))

    def calls() -> None:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stop=["e", "x"])

    plain, with_stop = recorded(calls)
    assert with_stop.attributes[semconv.RESPONSE_FINISH_REASONS] == plain.attributes[semconv.RESPONSE_FINISH_REASONS]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    content = tokenizer.encode(ANSWER, add_special_tokens=False)
    retokenizer = Retokenizer(tokenizer)
    assert retokenizer.ids(plain)[1] == content + [end_of_turn]
    assert retokenizer.ids(with_stop)[1] == content


def test_a_stream_abandoned_mid_answer_gets_no_end_token(client, fake_openai, tokenizer):
    """A stream the agent stopped reading has no finish reason, which read as "stopped": the re-tokenized
    response ended with an end-of-turn token the model had not produced when the agent left."""
    fake_openai.script(FakeReply(content=ANSWER))

    def calls() -> None:
        with client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True) as stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content == "ripe ":
                    break

    (span,) = recorded(calls)
    assert span.attributes[semconv.STREAM_ABANDONED] is True
    out = extract_transitions(build_tree([span]), task_id="t", retokenizer=Retokenizer(tokenizer))
    (transition,) = out.transitions
    assert out.retokenized == 1
    assert transition.response_ids == tokenizer.encode("a ripe ", add_special_tokens=False)
