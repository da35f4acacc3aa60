"""Re-tokenization with a real Hugging Face tokenizer and chat template (SmolLM2's, which the tiny policy
uses): the response ends where a server's ids end, at the end-of-turn token when the model stopped and
before it when the call was cut at max_tokens, and never with the newline the template writes between
turns (``LightningRL(tokenizer=...)`` for servers that return no ids)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import pytest
from openai import OpenAI

import agl
from agl import semconv
from agl.lightningrl import LightningRL
from agl.lightningrl.retokenize import Retokenizer
from agl.lightningrl.synthetic import TraceBuilder
from agl.serving import PolicyServer
from agl.store import SqliteLightningStore
from agl.testing import without_token_ids

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
YES_OR_NO = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"a": {"enum": ["yes", "no"]}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def _encode_template(tokenizer: Any, messages: List[dict], **kwargs: Any) -> List[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


@pytest.mark.parametrize("finish, stops", [(["stop"], True), (["tool_calls"], True), (None, True), (["length"], False)])
def test_response_ends_at_the_end_of_turn_token_when_the_call_stopped(
    tiny: Tuple[Any, Any], finish: Optional[List[str]], stops: bool
) -> None:
    _, tokenizer = tiny
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    b = TraceBuilder()
    span = b.llm(None, None, content="The answer is 4.", messages=MESSAGES)
    if finish is not None:
        span.attributes[semconv.RESPONSE_FINISH_REASONS] = finish
    prompt, response = Retokenizer(tokenizer).ids(span)
    assert prompt == _encode_template(tokenizer, MESSAGES, add_generation_prompt=True)
    content = tokenizer.encode("The answer is 4.", add_special_tokens=False)
    assert response == (content + [end_of_turn] if stops else content)
    # what the template writes for the whole turn is the prompt, the response, then only the turn separator
    turn = _encode_template(tokenizer, MESSAGES + [{"role": "assistant", "content": "The answer is 4."}])
    assert turn[: len(prompt) + len(content) + 1] == prompt + content + [end_of_turn]
    assert tokenizer.decode(turn[len(prompt) + len(content) + 1 :]).strip() == ""


@agl.rollout
def verdict_then_cut(task: dict, llm: agl.LLM) -> float:
    """A call that stops (a JSON schema ends in EOS), then one cut at max_tokens."""
    client = OpenAI(base_url=llm.get_base_url(), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model=llm.model, messages=messages, response_format=YES_OR_NO, max_tokens=40)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Why?"},
    ]
    client.chat.completions.create(model=llm.model, messages=messages, max_tokens=3)
    return 1.0


def test_retokenized_calls_of_the_policy_server_end_like_its_ids(
    tiny: Tuple[Any, Any], server: PolicyServer, tmp_path: Any
) -> None:
    """Real calls to agl's server, their ids stripped and re-tokenized: prompts are the server's ids exactly,
    and each response ends as the server's does (random text may re-tokenize differently in the middle)."""
    _, tokenizer = tiny
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    store = SqliteLightningStore(tmp_path / "retok.db")
    agl.instrument()
    try:
        trainer = agl.Trainer(
            store=store,
            runner_mode="thread",
            progress=False,
            initial_resources={"main_llm": agl.LLM(endpoint=server.base_url, model="policy")},
        )
        with trainer.runners(verdict_then_cut):
            rollouts = trainer.run_tasks([{"question": "Is 2+2 four?"}, {"question": "Is the sky green?"}])
    finally:
        agl.uninstrument()
    assert [r.status for r in rollouts] == ["succeeded", "succeeded"]
    exact = LightningRL().build_batch(store, rollouts, progress=False).transitions
    batch = LightningRL(tokenizer=tokenizer).batch_from_spans(rollouts, without_token_ids(store, rollouts))
    assert batch.report.retokenized == 4
    finishes = []
    for server_ids, retokenized in zip(exact, batch.transitions):
        assert retokenized.prompt_ids == server_ids.prompt_ids
        stopped = server_ids.response_ids[-1] == end_of_turn
        finishes.append(stopped)
        assert (retokenized.response_ids[-1] == end_of_turn) is stopped
        assert end_of_turn not in retokenized.response_ids[:-1]
    assert finishes == [True, False, True, False]  # the schema's answer stopped, the second call was cut
