"""The legacy Completions API (``client.completions.create``): token-in agents and LangChain's ``OpenAI`` LLM.

Real ``openai`` client against the fake OpenAI server's ``/v1/completions`` (vLLM's token id fields: both on
the choice), the instrumentor on around each test.
"""

from __future__ import annotations

import json
from typing import Any, List

import openai
import pytest
from instr_stream_keys import STREAMED_AS_PLAIN
from openai.resources.completions import AsyncCompletions, Completions

import agl
import agl.instrumentation
from agl import semconv
from agl.errors import MissingTokenIdsError
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.lightningrl import LightningRL
from agl.lightningrl.retokenize import Retokenizer
from agl.store import SqliteLightningStore
from agl.testing import FakeReply, FakeTokenizer
from agl.testing.fake_policy import fake_logprob

PROMPT = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
TOKENIZER = FakeTokenizer()


def extra(model: Any, key: str) -> Any:
    return (model.model_extra or {})[key]


def output_text(span: Any) -> str:
    (message,) = json.loads(span.attributes[semconv.OUTPUT_MESSAGES])
    assert message["role"] == "assistant"
    return message["content"]


def test_text_prompt_span_has_prompt_answer_and_server_token_ids(client, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="5"))
    with rollout() as scope:
        completion = client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=8, temperature=0.5)
    assert completion.choices[0].text == "5"
    assert fake_openai.requests[-1]["body"]["return_token_ids"] is True
    (span,) = sink.of(scope.rollout_id)
    a = span.attributes
    assert span.name == "text_completion fake-model" and span.kind == "llm" and span.status == "unset"
    assert a[semconv.OPERATION_NAME] == "text_completion" and a[semconv.LLM_API] == "completions"
    assert a[semconv.LLM_STREAM] is False and semconv.INPUT_MESSAGES not in a
    assert (a[semconv.REQUEST_MAX_TOKENS], a[semconv.REQUEST_TEMPERATURE]) == (8, 0.5)
    assert a[semconv.LLM_PROMPT] == PROMPT
    assert output_text(span) == "5"
    assert a[semconv.RESPONSE_ID] == completion.id and a[semconv.RESPONSE_FINISH_REASONS] == ["stop"]
    assert (a[semconv.USAGE_INPUT_TOKENS], a[semconv.USAGE_OUTPUT_TOKENS]) == (len(PROMPT), 1)
    assert a[semconv.TOKEN_IDS_SOURCE] == "server"
    assert a[semconv.PROMPT_TOKEN_IDS] == TOKENIZER.encode(PROMPT) == extra(completion.choices[0], "prompt_token_ids")
    assert a[semconv.RESPONSE_TOKEN_IDS] == TOKENIZER.encode("5") == extra(completion.choices[0], "token_ids")
    assert semconv.RESPONSE_LOGPROBS not in a  # not asked for


def test_token_id_prompt_is_recorded_as_the_ids_sent(client, fake_openai, sink, rollout):
    ids = TOKENIZER.encode(PROMPT)
    with rollout() as scope:
        completion = client.completions.create(model="fake-model", prompt=ids)
    assert fake_openai.requests[-1]["body"]["prompt"] == ids
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.LLM_PROMPT] == ids == span.attributes[semconv.PROMPT_TOKEN_IDS]
    assert output_text(span) == completion.choices[0].text


@pytest.mark.parametrize("n", [None, 2])
def test_a_batch_of_prompts_counts_its_choices_and_records_choice_0(client, fake_openai, sink, rollout, n):
    """LangChain's ``OpenAI`` LLM sends several prompts in one request for ``generate``/``batch``: only
    choice 0's ids are recorded, and the choice count (prompts x n) lets LightningRL say so."""
    fake_openai.script(FakeReply(content="4"))
    options = {} if n is None else {"n": n}
    with rollout() as scope:
        completion = client.completions.create(model="fake-model", prompt=["Q: 2+2", "Q: 3+3"], **options)
    assert [c.index for c in completion.choices] == [0, 1]  # the fake answers one choice per prompt
    (span,) = sink.of(scope.rollout_id)
    a = span.attributes
    assert a[semconv.REQUEST_CHOICE_COUNT] == 2 * (n or 1)
    assert a[semconv.PROMPT_TOKEN_IDS] == TOKENIZER.encode("Q: 2+2") and a[
        semconv.RESPONSE_TOKEN_IDS
    ] == TOKENIZER.encode("4")
    assert [m["content"] for m in json.loads(a[semconv.OUTPUT_MESSAGES])] == ["4", completion.choices[1].text]


@pytest.mark.parametrize("prompt", [["Q: hi"], [[81, 58, 32]]], ids=["text", "token-ids"])
def test_a_one_prompt_batch_is_recorded_as_that_prompt(client, sink, rollout, prompt):
    """LangChain's ``OpenAI`` LLM sends ``prompt=[text]``."""
    with rollout() as scope:
        client.completions.create(model="fake-model", prompt=prompt)
    (span,) = sink.of(scope.rollout_id)
    assert span.attributes[semconv.LLM_PROMPT] == prompt[0]
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == list(b"Q: hi" if prompt == ["Q: hi"] else prompt[0])


def test_logprobs_zero_records_one_logprob_per_response_token(client, fake_openai, sink, rollout):
    with rollout() as scope:
        completion = client.completions.create(model="fake-model", prompt="hi", logprobs=0)
    (span,) = sink.of(scope.rollout_id)
    ids = span.attributes[semconv.RESPONSE_TOKEN_IDS]
    assert span.attributes[semconv.RESPONSE_LOGPROBS] == completion.choices[0].logprobs.token_logprobs
    assert span.attributes[semconv.RESPONSE_LOGPROBS] == [fake_logprob(i) for i in range(len(ids))]


@pytest.mark.parametrize("prompt", [PROMPT, TOKENIZER.encode(PROMPT)], ids=["text", "token-ids"])
def test_stream_records_what_the_plain_call_records(client, fake_openai, sink, rollout, prompt):
    with rollout() as scope:
        plain = client.completions.create(model="fake-model", prompt=prompt, logprobs=0)
        chunks = list(
            client.completions.create(
                model="fake-model", prompt=prompt, logprobs=0, stream=True, stream_options={"include_usage": True}
            )
        )
    assert len(chunks) > 2  # one per word, then the usage chunk
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    first, streamed = sink.of(scope.rollout_id)
    assert streamed.attributes[semconv.LLM_STREAM] is True
    for key in (*STREAMED_AS_PLAIN, semconv.OUTPUT_MESSAGES, semconv.LLM_PROMPT):
        assert streamed.attributes[key] == first.attributes[key], key
    assert streamed.attributes[semconv.RESPONSE_ID] == chunks[0].id


async def test_async_plain_and_streamed(aclient, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(content="five"), FakeReply(content="six and seven"))
    with rollout() as scope:
        plain = await aclient.completions.create(model="fake-model", prompt="q")
        stream = await aclient.completions.create(model="fake-model", prompt="q", stream=True)
        text = "".join([c.choices[0].text async for c in stream])
    assert (plain.choices[0].text, text) == ("five", "six and seven")
    first, second = sink.of(scope.rollout_id)
    assert (output_text(first), output_text(second)) == ("five", "six and seven")
    assert second.attributes[semconv.RESPONSE_TOKEN_IDS] == TOKENIZER.encode("six and seven")


def test_without_server_ids_the_span_says_absent_and_keeps_the_prompt(fake_openai, sink, rollout):
    instrumentor = OpenAIInstrumentor()
    agl.instrumentation.uninstrument()
    instrumentor.instrument(request_token_ids=False)
    try:
        with openai.OpenAI(base_url=fake_openai.base_url, api_key="x") as client, rollout() as scope:
            client.completions.create(model="fake-model", prompt=[1, 2, 3])
    finally:
        instrumentor.uninstrument()
    (span,) = sink.of(scope.rollout_id)
    assert "return_token_ids" not in fake_openai.requests[-1]["body"]
    assert span.attributes[semconv.TOKEN_IDS_SOURCE] == "absent"
    assert semconv.PROMPT_TOKEN_IDS not in span.attributes and span.attributes[semconv.LLM_PROMPT] == [1, 2, 3]


def test_server_error_passes_through_and_marks_the_span(client, fake_openai, sink, rollout):
    fake_openai.script(FakeReply(status_code=429, error_message="slow down"))
    with rollout() as scope, pytest.raises(openai.RateLimitError, match="slow down"):
        client.completions.create(model="fake-model", prompt="hi")
    (span,) = sink.of(scope.rollout_id)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "RateLimitError"


def test_uninstrument_restores_the_original_create(fake_openai, sink, rollout):
    agl.instrumentation.uninstrument()
    originals = {cls: vars(cls)["create"] for cls in (Completions, AsyncCompletions)}
    inst = OpenAIInstrumentor()
    inst.instrument()
    assert all(vars(cls)["create"].__wrapped__ is original for cls, original in originals.items())
    inst.uninstrument()
    assert all(vars(cls)["create"] is original for cls, original in originals.items())
    with openai.OpenAI(base_url=fake_openai.base_url, api_key="x") as client, rollout() as scope:
        client.completions.create(model="fake-model", prompt="hi")
    assert sink.of(scope.rollout_id) == []


# --- from spans to training samples --------------------------------------------------------------------------


@agl.rollout
def token_in_agent(task, llm):
    """Applies its own template and sends token ids, as rLLM- or verl-style agent loops do."""
    client = openai.OpenAI(base_url=llm.get_base_url(), api_key="x")
    prompt = f"<|im_start|>user\n{task['question']}<|im_end|>\n<|im_start|>assistant\n"
    first = client.completions.create(model=llm.model, prompt=TOKENIZER.encode(prompt), max_tokens=32)
    stream = client.completions.create(
        model=llm.model, prompt=prompt + first.choices[0].text + "\nSure?", max_tokens=32, stream=True
    )
    answer = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    agl.emit_reward(1.0 if str(task["answer"]) in answer else 0.0)


def run_token_in_agent(tmp_path, fake_openai, fake_trainer) -> Any:
    store = SqliteLightningStore(tmp_path / "completions.db")
    trainer = fake_trainer(store, "fake-model")
    fake_openai.script(
        FakeReply(content="It is 5."),
        FakeReply(content="Yes, 5."),
        FakeReply(content="It is 9."),
        FakeReply(content="Yes, 9."),
    )
    with trainer.runners(token_in_agent):
        rollouts = trainer.run_tasks([{"question": "2 + 3?", "answer": 5}], n_per_task=2)
    return store, rollouts


def test_token_in_agent_gives_samples_with_the_servers_ids(tmp_path, fake_openai, fake_trainer, instrumentor):
    store, rollouts = run_token_in_agent(tmp_path, fake_openai, fake_trainer)
    assert sorted(r.final_reward for r in rollouts) == [0.0, 1.0]
    batch = LightningRL().build_batch(store, rollouts, progress=False)
    assert batch.report.samples == 4 and batch.report.retokenized == 0
    requests = [r["body"] for r in fake_openai.requests]
    sent_prompts: List[List[int]] = [
        p if isinstance(p, list) else TOKENIZER.encode(p) for p in (r["prompt"] for r in requests)
    ]
    assert sorted(s.prompt_ids for s in batch.samples) == sorted(sent_prompts)
    by_prompt = {tuple(s.prompt_ids): s for s in batch.samples}
    for request, prompt in zip(requests, sent_prompts):
        assert request["return_token_ids"] is True
        sample = by_prompt[tuple(prompt)]
        assert TOKENIZER.decode(sample.response_ids) in ("It is 5.", "Yes, 5.", "It is 9.", "Yes, 9.")
    rewards = {TOKENIZER.decode(s.response_ids): s.reward for s in batch.samples}
    assert rewards == {"It is 5.": 1.0, "Yes, 5.": 1.0, "It is 9.": 0.0, "Yes, 9.": 0.0}


def test_completion_calls_without_ids_are_retokenized_from_the_prompt(tmp_path, fake_openai, fake_trainer):
    agl.instrumentation.uninstrument()
    agl.instrument(request_token_ids=False)
    try:
        store, rollouts = run_token_in_agent(tmp_path, fake_openai, fake_trainer)
    finally:
        agl.uninstrument()
    with pytest.raises(MissingTokenIdsError):
        LightningRL().build_batch(store, rollouts, progress=False)
    batch = LightningRL(tokenizer=TOKENIZER).build_batch(store, rollouts, progress=False)
    assert batch.report.retokenized == 4
    prompts = sorted(s.prompt_ids for s in batch.samples)
    sent = sorted(
        p if isinstance(p, list) else TOKENIZER.encode(p) for p in (r["body"]["prompt"] for r in fake_openai.requests)
    )
    assert prompts == sent
    assert {TOKENIZER.decode(s.response_ids) for s in batch.samples} == {"It is 5.", "Yes, 5.", "It is 9.", "Yes, 9."}


class _EosTokenizer(FakeTokenizer):
    eos_token_id = 0


def test_retokenized_completion_ends_with_eos_when_the_model_stopped(client, sink, rollout):
    with rollout() as scope:
        client.completions.create(model="fake-model", prompt="hi", extra_body={"return_token_ids": False})
    (span,) = sink.of(scope.rollout_id)
    prompt_ids, response_ids = Retokenizer(_EosTokenizer()).ids(span)
    assert prompt_ids == TOKENIZER.encode("hi") and response_ids == TOKENIZER.encode(output_text(span)) + [0]
