"""The legacy Completions API (``/v1/completions``) of the policy server, over real HTTP with the real
``openai`` client and the tiny random Llama.

Reference values come from outside the server: prompt ids from the tokenizer, greedy answers from
transformers' ``generate``. The random model spreads its probability thinly over 49K tokens, so it almost
never writes its end-of-sequence token: answers run to ``max_tokens``.
"""

from __future__ import annotations

from typing import Any, List

import httpx
import openai
import pytest

PROMPT = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"  # a template the agent applied


def extra(obj: Any, key: str) -> Any:
    return obj.model_extra[key]


def answer_text(tokenizer: Any, ids: List[int]) -> str:
    """The text the ids stand for: all of them but a final end-of-sequence token (as the chat path)."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)


# --- prompts in, ids out -------------------------------------------------------------------------------------


def test_text_prompt_is_tokenized_with_special_tokens_and_the_answer_is_the_models(greedy, client, server, tiny):
    model, tokenizer = tiny
    raw = client.completions.with_raw_response.create(model="policy", prompt=PROMPT, max_tokens=12, temperature=0)
    completion = raw.parse()
    (choice,) = completion.choices
    prompt_ids = tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    assert extra(choice, "prompt_token_ids") == prompt_ids  # no chat template on top of the agent's own
    ids = extra(choice, "token_ids")
    assert ids == greedy(model, prompt_ids, 12)
    assert choice.text == answer_text(tokenizer, ids)  # not stripped: the model's text as it wrote it
    assert choice.finish_reason == "length" and choice.logprobs is None and extra(choice, "stop_reason") is None
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.model == "policy"
    assert completion.usage.prompt_tokens == len(prompt_ids) and completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == len(prompt_ids) + 12
    assert extra(completion, "agl_resources_version") == server.version == 1
    assert raw.headers["x-agl-resources-version"] == "1"


def test_token_id_prompt_is_used_exactly(greedy, client, tiny):
    model, tokenizer = tiny
    # ids no tokenizer would produce from text: a prompt that was never text, such as a trajectory so far
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, 17, 17, 4000]
    completion = client.completions.create(model="policy", prompt=prompt, max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert extra(choice, "prompt_token_ids") == prompt
    assert extra(choice, "token_ids") == greedy(model, prompt, 8)
    assert completion.usage.prompt_tokens == len(prompt)
    # a batch of one prompt is that prompt
    batched = client.completions.create(model="policy", prompt=[prompt], max_tokens=8, temperature=0)
    assert extra(batched.choices[0], "token_ids") == extra(choice, "token_ids")
    as_text = client.completions.create(model="policy", prompt=[PROMPT], max_tokens=3, temperature=0)
    assert extra(as_text.choices[0], "prompt_token_ids") == tokenizer(PROMPT)["input_ids"]


def test_seeded_sampling_repeats(client):
    def sample(seed: int) -> List[int]:
        completion = client.completions.create(model="policy", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=seed)
        return extra(completion.choices[0], "token_ids")

    first = sample(11)
    assert sample(11) == first and sample(12) != first


def test_max_tokens_defaults_to_16(client):
    completion = client.completions.create(model="policy", prompt=PROMPT, seed=0)
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == len(extra(choice, "token_ids")) <= 16
    if choice.finish_reason == "length":
        assert completion.usage.completion_tokens == 16


def test_a_stop_string_cuts_the_text_but_keeps_the_sampled_ids(client, tiny):
    """As on the chat path: the ids include the tokens that spelled the stop string; the text stops before
    it, plain and streamed (the stream holds back a tail that could become the stop string)."""
    _, tokenizer = tiny
    args = dict(model="policy", prompt=PROMPT, max_tokens=12, temperature=0)
    free = client.completions.create(**args).choices[0]
    free_ids = extra(free, "token_ids")
    stop = tokenizer.decode(free_ids[5:7])
    expected = free.text[: free.text.find(stop)]
    choice = client.completions.create(**args, stop=stop).choices[0]
    ids = extra(choice, "token_ids")
    assert choice.text == expected and choice.finish_reason == "stop"
    assert ids == free_ids[: len(ids)] and stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])
    chunks = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [i for c in chunks for i in extra(c.choices[0], "token_ids")] == ids


# --- streaming and logprobs ------------------------------------------------------------------------------------


def test_stream_carries_the_plain_answers_text_ids_and_logprobs(client):
    args = dict(model="policy", prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3, logprobs=0)
    plain = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    *with_choice, usage_chunk = chunks
    assert extra(with_choice[0].choices[0], "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert all("prompt_token_ids" not in (c.choices[0].model_extra or {}) for c in with_choice[1:])
    assert "".join(c.choices[0].text for c in with_choice) == plain.text
    ids = [i for c in with_choice for i in extra(c.choices[0], "token_ids")]
    assert ids == extra(plain, "token_ids")
    streamed = [lp for c in with_choice for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert [o for c in with_choice for o in c.choices[0].logprobs.text_offset] == plain.logprobs.text_offset
    assert [c.choices[0].finish_reason for c in with_choice] == [None] * (len(with_choice) - 1) + ["length"]
    assert not usage_chunk.choices and usage_chunk.usage.completion_tokens == len(ids) == 16
    assert {c.object for c in chunks} == {"text_completion"} and len({c.id for c in chunks}) == 1
    assert {extra(c, "agl_resources_version") for c in chunks} == {1}


def test_logprobs_are_one_per_sampled_token_with_up_to_n_alternatives(client, tiny):
    _, tokenizer = tiny
    none = client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    logprobs = none.choices[0].logprobs
    ids = extra(none.choices[0], "token_ids")
    assert len(logprobs.token_logprobs) == len(ids) and logprobs.top_logprobs == [None] * len(ids)
    assert logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    greedy_top = client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    top = greedy_top.choices[0].logprobs
    assert top.token_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    for sampled, alternatives in zip(top.token_logprobs, top.top_logprobs):
        assert 1 <= len(alternatives) <= 2
        assert max(alternatives.values()) == pytest.approx(sampled, abs=1e-5)  # greedy took the most likely
    # the chat API's spelling, as in a trainer's published sampling parameters: true is 0, false none
    as_chat = client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=True)
    assert as_chat.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    assert (
        client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, logprobs=False).choices[0].logprobs
        is None
    )
    sampled = client.completions.create(model="policy", prompt=PROMPT, max_tokens=6, seed=1, logprobs=2)
    drawn = sampled.choices[0].logprobs
    for logprob, alternatives in zip(drawn.token_logprobs, drawn.top_logprobs):
        assert len(alternatives) <= 2 and max(alternatives.values()) >= logprob


def test_langchain_openai_llm_gets_the_served_text(server, client):
    from langchain_openai import OpenAI

    llm = OpenAI(base_url=server.base_url, api_key="x", model="policy", max_tokens=8, temperature=0, max_retries=0)
    expected = client.completions.create(model="policy", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert llm.invoke(PROMPT) == expected
    assert "".join(llm.stream(PROMPT)) == expected


# --- bad requests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"n": 2}, "n", "only n=1"),
        ({"echo": True}, "echo", "echo is not supported"),
        ({"suffix": "x"}, "suffix", "suffix is not supported"),
        ({"best_of": 2}, "best_of", "only best_of=1"),
        ({"best_of": True}, "best_of", "only best_of=1"),
        ({"n": True}, "n", "only n=1"),
        ({"prompt": ["one", "two"]}, "prompt", "send one request per prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "send one request per prompt"),
        ({"prompt": [1, 49152]}, "prompt", "token id 49152 in 'prompt' is out of the vocabulary"),
        ({"prompt": [-1]}, "prompt", "out of the vocabulary"),
        ({"prompt": [1, "a"]}, "prompt", "a string or a list of token ids"),
        ({"prompt": ""}, "prompt", "'prompt' is empty"),
        ({"prompt": []}, "prompt", "'prompt' is empty"),
        (
            {"prompt": [1] * 2048},
            "prompt",
            "maximum context length is 2048 tokens, but the prompt is too long: 2048 tokens",
        ),
        ({"max_tokens": 10**6}, "max_tokens", "the prompt is too long for max_tokens 1000000"),
        ({"max_tokens": 0}, "max_tokens", "positive integer"),
        ({"logprobs": 21}, "logprobs", "from 0 to 20"),
        ({"logprobs": -1}, "logprobs", "from 0 to 20"),
        ({"temperature": 3}, "temperature", "from 0 to 2"),
        ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"response_format": {"type": "json_object"}}, "response_format", "use /v1/chat/completions"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "unsupported parameter"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
    ],
)
def test_bad_requests_get_a_400_that_names_the_parameter(server, change, param, words):
    body = {"model": "policy", "prompt": PROMPT, **change}
    response = httpx.post(f"{server.base_url}/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error" and response.headers["x-agl-resources-version"] == "1"


def test_ignored_fields_are_accepted_and_the_openai_client_raises_on_a_400(client):
    completion = client.completions.create(
        model="policy", prompt=PROMPT, max_tokens=2, user="u", extra_body={"return_token_ids": True}
    )
    assert len(extra(completion.choices[0], "token_ids")) == 2
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.completions.create(model="policy", prompt=PROMPT, n=2)
