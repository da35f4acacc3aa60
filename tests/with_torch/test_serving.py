"""The policy server over real HTTP with the real ``openai`` client and a real (tiny, random) Llama.

Reference values come from outside the server: prompt ids from the tokenizer's own chat template, greedy
answers from transformers' ``generate``, logprobs from a full teacher-forced forward pass.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Iterator, List, Literal, Tuple

import httpx
import openai
import pytest
import torch

import agl
import agl.instrumentation
from agl import semconv
from agl.instrumentation.openai_client import OpenAIInstrumentor
from agl.openai_wire.chat_format import render_prompt
from agl.serving import PolicyServer, SamplingParams
from agl.serving.models import load_policy
from agl.testing import ListSink, tracer_writes_to

MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
TOOL_ANSWER = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


# --- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_server() -> Iterator[PolicyServer]:
    """A tiny model taught to answer MESSAGES + [ADD_TOOL] with TOOL_ANSWER and its end-of-sequence token."""
    model, tokenizer = load_policy("tiny", seed=1, device="cpu")
    prompt = prompt_ids(tokenizer, MESSAGES, [ADD_TOOL])
    teach(model, prompt, tokenizer(TOOL_ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    with PolicyServer(model, tokenizer, model_name="policy", version=4) as s:
        yield s


@pytest.fixture
def tool_client(tool_server: PolicyServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tool_server.base_url, api_key="x", max_retries=0) as c:
        yield c


def teach(model: Any, prompt: List[int], target: List[int], max_steps: int = 600) -> None:
    """Overfit ``model`` until greedy decoding after ``prompt`` writes ``target`` (teacher-forced argmax).

    One thread: for a model this small, thread synchronisation costs more than it saves.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompt + target])
    model.train()
    try:
        for _ in range(max_steps):
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
            logits = model.lm_head(hidden)
            if logits.argmax(-1).tolist() == target:
                return
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(logits, torch.tensor(target)).backward()
            optimizer.step()
        raise AssertionError(f"the tiny model did not learn its answer in {max_steps} steps")
    finally:
        model.eval()
        torch.set_num_threads(threads)


def prompt_ids(tokenizer: Any, messages: List[Dict[str, Any]], tools: Any = None) -> List[int]:
    return tokenizer(render_prompt(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]


def template_ids(tokenizer: Any, messages: List[Dict[str, Any]]) -> List[int]:
    """The tokenizer's own chat template, without agl's rendering in between."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def teacher_forced_logprobs(
    model: Any, prompt: List[int], response: List[int], temperature: float = 1.0
) -> List[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def extra(obj: Any, key: str) -> Any:
    return obj.model_extra[key]


# --- plain and streamed answers ----------------------------------------------------------------------------


def chat_policy(client: openai.OpenAI, **options: Any) -> Any:
    """The served "policy" model's chat completion of MESSAGES, with ``options``."""
    return client.chat.completions.create(model="policy", messages=MESSAGES, **options)


def final_completion(client: openai.OpenAI, stream: bool, **args: Any) -> Any:
    """The chat completion of ``args``: assembled by the SDK's stream helper when ``stream``, else one create."""
    if stream:
        with client.chat.completions.stream(**args) as events:
            return events.get_final_completion()
    return client.chat.completions.create(**args)


def test_plain_completion_returns_exact_prompt_and_response_ids(greedy, client, server, tiny):
    model, tokenizer = tiny
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True
    )
    completion = raw.parse()
    choice = completion.choices[0]
    expected_prompt = template_ids(tokenizer, MESSAGES)
    assert extra(completion, "prompt_token_ids") == expected_prompt
    response = extra(choice, "token_ids")
    assert response == greedy(model, expected_prompt, 12)
    assert choice.finish_reason == "length" and completion.model == "policy"
    assert completion.usage.prompt_tokens == len(expected_prompt) and completion.usage.completion_tokens == 12
    assert choice.message.content == tokenizer.decode(response)  # as written: nothing stripped (vLLM neither)
    served = [t.logprob for t in choice.logprobs.content]
    assert served == pytest.approx(teacher_forced_logprobs(model, expected_prompt, response), abs=1e-4)
    assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([i]) for i in response]
    assert extra(completion, "agl_resources_version") == server.version == 1
    assert raw.headers["x-agl-resources-version"] == "1"


def test_sampling_logprobs_are_those_of_the_tempered_distribution_and_seeds_repeat(client, tiny):
    model, tokenizer = tiny

    def sample(seed: int) -> Any:
        return chat_policy(client, max_tokens=10, temperature=0.7, seed=seed, logprobs=True, top_logprobs=3).choices[0]

    first, again, other = sample(11), sample(11), sample(12)
    ids = extra(first, "token_ids")
    assert ids == extra(again, "token_ids") and ids != extra(other, "token_ids")
    served = [t.logprob for t in first.logprobs.content]
    expected = teacher_forced_logprobs(model, template_ids(tokenizer, MESSAGES), ids, temperature=0.7)
    assert served == pytest.approx(expected, abs=1e-4)
    for token in first.logprobs.content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] >= token.logprob


def test_top_p_renormalizes_over_the_nucleus(client, tiny):
    model, tokenizer = tiny
    choice = client.chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=6, temperature=1.0, top_p=0.5, seed=3, logprobs=True
    ).choices[0]
    ids = extra(choice, "token_ids")
    plain = teacher_forced_logprobs(model, template_ids(tokenizer, MESSAGES), ids)
    served = [t.logprob for t in choice.logprobs.content]
    # Dropping the tail raises every kept token's probability: renormalized over at most half the mass.
    assert all(s > p for s, p in zip(served, plain))
    assert all(s >= p + 0.69 for s, p in zip(served, plain))  # log(1/0.5) = 0.693


def test_top_k_samples_among_the_k_most_likely_tokens_on_every_api(client, tiny):
    """vLLM's ``top_k`` (verl's ``rollout.top_k``, which agl's proxy fills into every request): each token is
    one of the k most likely, and its logprob is renormalized over them."""
    model, tokenizer = tiny
    choice = client.chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=6, seed=5, logprobs=True, extra_body={"top_k": 3}
    ).choices[0]
    ids = extra(choice, "token_ids")
    prompt = template_ids(tokenizer, MESSAGES)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    top3 = torch.topk(logits, 3)
    expected = torch.log_softmax(top3.values, dim=-1)
    for position, (token, served) in enumerate(zip(ids, choice.logprobs.content)):
        assert token in top3.indices[position].tolist()
        rank = top3.indices[position].tolist().index(token)
        assert served.logprob == pytest.approx(float(expected[position, rank]), abs=1e-4)

    def completion(top_k: Any) -> List[int]:
        body = {"model": "policy", "prompt": "2 + 3 =", "max_tokens": 6, "seed": 2, "top_k": top_k}
        return httpx.post(f"{client.base_url}completions", json=body).json()["choices"][0]["token_ids"]

    assert completion(-1) == completion(0) == completion(None)  # vLLM's "off"
    responses = httpx.post(
        f"{client.base_url}responses", json={"model": "policy", "input": "hi", "max_output_tokens": 4, "top_k": 1}
    ).json()
    greedy_ids = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert responses["output"][0]["content"][0]["text"] == greedy_ids.choices[0].message.content  # k=1 is greedy
    for bad in (-2, 1.5, "3"):
        refused = httpx.post(
            f"{client.base_url}chat/completions", json={"model": "policy", "messages": MESSAGES, "top_k": bad}
        )
        assert refused.status_code == 400 and "top_k must be an integer" in refused.text


def test_a_minuscule_temperature_or_top_p_is_answered_and_its_batch_neighbours_too(greedy, client, server, tiny):
    """temperature 1e-40 overflowed ``logits / temperature`` to NaN, and top_p 1e-300 (0 in float32) kept no
    token: the decode step raised and failed every request generating alongside with a 500. A temperature
    that small samples greedily now, and the most likely token is always in the nucleus."""
    model, tokenizer = tiny
    expected = greedy(model, template_ids(tokenizer, MESSAGES), 6)
    settings = [
        {"temperature": 1e-40},
        {"temperature": 5e-324},
        {"top_p": 1e-300},
        {"temperature": 1e-300, "top_p": 1e-300},
    ]

    def ask(setting: Dict[str, float]) -> Any:
        return client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=6, seed=1, **setting)

    with ThreadPoolExecutor(len(settings) + 1) as pool:
        neighbour = pool.submit(ask, {"temperature": 1.0})
        answers = list(pool.map(ask, settings))
    assert extra(neighbour.result().choices[0], "token_ids")
    assert [extra(a.choices[0], "token_ids") for a in answers[:2]] == [expected, expected]  # greedy
    assert all(len(extra(a.choices[0], "token_ids")) == 6 for a in answers)


def test_stream_carries_the_same_ids_content_and_version_as_the_plain_answer(client, tiny):
    _, tokenizer = tiny
    plain = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16, temperature=0)
    streaming = {"stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    stream = chat_policy(client, max_tokens=16, temperature=0, **streaming)
    chunks = list(stream)
    assert extra(chunks[0], "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    with_choice = [c for c in chunks if c.choices]
    ids = [i for c in with_choice for i in extra(c.choices[0], "token_ids")]
    assert ids == extra(plain.choices[0], "token_ids")
    assert sum(len(c.choices[0].logprobs.content) for c in with_choice if c.choices[0].logprobs) == len(ids)
    content = "".join(c.choices[0].delta.content or "" for c in with_choice)
    assert content == (plain.choices[0].message.content or "")
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert {extra(c, "agl_resources_version") for c in chunks} == {1}


def test_models_and_health(server):
    root = server.base_url.removesuffix("/v1")
    models = httpx.get(f"{server.base_url}/models").json()
    assert [m["id"] for m in models["data"]] == ["policy"]
    health = httpx.get(f"{root}/health")
    assert health.json()["status"] == "ok" and health.headers["x-agl-resources-version"] == str(server.version)


# --- tool calls, end of sequence, stop strings -------------------------------------------------------------


def test_tool_call_is_parsed_and_ids_are_what_the_model_wrote(tool_client, tool_server):
    tokenizer = tool_server.tokenizer
    completion = tool_client.chat.completions.create(
        model="policy", messages=MESSAGES, tools=[ADD_TOOL], temperature=0, max_tokens=80
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    ids = extra(choice, "token_ids")
    assert ids[-1] == tokenizer.eos_token_id  # sampled, so it is trained on
    assert tokenizer.decode(ids[:-1]) == TOOL_ANSWER
    assert extra(completion, "prompt_token_ids") == prompt_ids(tokenizer, MESSAGES, [ADD_TOOL])
    assert extra(completion, "agl_resources_version") == 4


def test_streamed_tool_call_is_assembled_by_the_openai_client(tool_client, tool_server):
    with tool_client.chat.completions.stream(
        model="policy", messages=MESSAGES, tools=[ADD_TOOL], temperature=0, max_tokens=80
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me add." and final.choices[0].finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls == [("add", {"a": 2, "b": 3})]
    ids = [i for c in chunks if c.choices for i in extra(c.choices[0], "token_ids")]
    assert tool_server.tokenizer.decode(ids[:-1]) == TOOL_ANSWER
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in streamed_text  # content is held back once a call may be starting


def cut_answer(client: openai.OpenAI, api: str, max_tokens: int) -> Tuple[str, List[Any], str]:
    """``(content, [(name, arguments)], finish)`` of TOOL_ANSWER's request cut at ``max_tokens``, per API."""
    if api == "responses":
        response = client.responses.create(
            **responses_args(tools=[FLAT_ADD_TOOL], temperature=0, max_output_tokens=max_tokens)
        )
        calls = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
        return response.output_text, calls, response.status
    args = {"model": "policy", "messages": MESSAGES, "tools": [ADD_TOOL], "temperature": 0, "max_tokens": max_tokens}
    if api == "chat":
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    deltas = [call.function for c in chunks for call in c.delta.tool_calls or []]
    content = "".join(c.delta.content or "" for c in chunks)
    return content, [(f.name, json.loads(f.arguments)) for f in deltas], chunks[-1].finish_reason


@pytest.mark.parametrize("api", ["chat", "stream", "responses"])
@pytest.mark.parametrize(
    "cut_in, calls",
    [("</tool_call", [("add", {"a": 2, "b": 3})]), ('"arguments"', [])],  # its closing tag, its JSON
)
def test_a_tool_call_cut_by_max_tokens_keeps_whole_calls_and_no_markup(tool_client, tool_server, api, cut_in, calls):
    tokenizer = tool_server.tokenizer
    ids = tokenizer(TOOL_ANSWER, add_special_tokens=False)["input_ids"]
    max_tokens = next(n for n in range(len(ids)) if cut_in in tokenizer.decode(ids[:n]))
    content, parsed, finish = cut_answer(tool_client, api, max_tokens)
    assert (content, parsed) == ("Let me add.", calls)
    assert finish == ("incomplete" if api == "responses" else "length")


def test_tool_call_format_without_tools_offered_stays_content(tool_client, tool_server):
    """Asking with tool_choice='none' drops the tools from the prompt, and nothing is parsed as a call."""
    tokenizer = tool_server.tokenizer
    prompt = prompt_ids(tokenizer, MESSAGES, [ADD_TOOL])
    gen = tool_server.engine.generate(prompt, SamplingParams(max_tokens=80, temperature=0))
    assert gen.text == TOOL_ANSWER and gen.finish_reason == "stop"
    completion = tool_client.chat.completions.create(
        model="policy", messages=MESSAGES, tools=[ADD_TOOL], tool_choice="none", temperature=0, max_tokens=5
    )
    assert extra(completion, "prompt_token_ids") == template_ids(tokenizer, MESSAGES)
    assert completion.choices[0].message.tool_calls is None


def test_stop_string_cuts_content_but_keeps_the_sampled_ids(tool_client, tool_server):
    tokenizer = tool_server.tokenizer
    completion = tool_client.chat.completions.create(
        model="policy", messages=MESSAGES, tools=[ADD_TOOL], temperature=0, max_tokens=80, stop=["add."]
    )
    choice = completion.choices[0]
    assert choice.message.content == "Let me " and choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "add." in tokenizer.decode(extra(choice, "token_ids"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_does_not_cut_a_tool_call(tool_client, tool_server, stream):
    """A stop string that occurs in the call markup ("}") cut the call, and its ``<tool_call>`` markup came
    back as content with finish_reason "stop". Stop strings apply outside calls only, as OpenAI's stop does
    not cut function arguments."""
    args = {
        "model": "policy",
        "messages": MESSAGES,
        "tools": [ADD_TOOL],
        "temperature": 0,
        "max_tokens": 80,
        "stop": ["}"],
    }
    completion = final_completion(tool_client, stream, **args)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("add", {"a": 2, "b": 3})
    ]


def test_parallel_tool_calls_false_returns_the_first_call_only():
    """With ``tool_choice`` "auto" no grammar limits the calls, so an answer with two came back as two
    although the client sent ``parallel_tool_calls: false`` (OpenAI: at most one). The first is kept."""
    model, tokenizer = load_policy("tiny", seed=1, device="cpu")
    two = TOOL_ANSWER + '\n<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>'
    teach(model, prompt_ids(tokenizer, MESSAGES, [ADD_TOOL]), encode(tokenizer, two) + [tokenizer.eos_token_id])
    with (
        PolicyServer(model, tokenizer) as server,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
    ):
        args = {"model": "policy", "messages": MESSAGES, "tools": [ADD_TOOL], "temperature": 0, "max_tokens": 80}

        def calls(stream: bool, **more: Any) -> List[Tuple[str, Dict[str, Any]]]:
            message = final_completion(client, stream, **args, **more).choices[0].message
            assert message.content == "Let me add."
            return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]

        for stream in (False, True):
            assert calls(stream) == [("add", {"a": 2, "b": 3}), ("add", {"a": 4, "b": 5})]
            assert calls(stream, parallel_tool_calls=False) == [("add", {"a": 2, "b": 3})]


def encode(tokenizer: Any, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- batching, pausing, versions ---------------------------------------------------------------------------


def test_concurrent_requests_run_as_one_batch(greedy, client, server, tiny):
    model, tokenizer = tiny
    questions = [f"What is {i} + {i}?" for i in range(6)]
    before = dict(vars(server.stats))

    def ask(question: str) -> List[int]:
        completion = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0
        )
        return extra(completion.choices[0], "token_ids")

    with ThreadPoolExecutor(len(questions)) as pool:
        with server.paused():
            futures = [pool.submit(ask, q) for q in questions]
            _wait_for(lambda: server.engine.waiting == len(questions))
        answers = [f.result(timeout=60) for f in futures]
    stats = server.stats
    assert stats.prefills - before["prefills"] == 1  # all six prompts went through one forward pass
    assert stats.max_batch >= len(questions)
    assert stats.row_steps - before["row_steps"] == len(questions) * 7  # 8 tokens: 1 from the prefill + 7 steps
    for question, answer in zip(questions, answers):
        assert answer == greedy(model, template_ids(tokenizer, [{"role": "user", "content": question}]), 8)


def test_a_request_arriving_mid_generation_joins_the_running_batch(client, server):
    stats = server.stats
    before = stats.prefills, stats.decode_steps, stats.row_steps, stats.generated_tokens

    def ask() -> int:
        completion = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=150, temperature=0)
        return completion.usage.completion_tokens

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ask)
        _wait_for(lambda: stats.generated_tokens > before[3])  # the first one is generating
        second = pool.submit(ask)
        assert (first.result(timeout=60), second.result(timeout=60)) == (150, 150)
    steps = stats.decode_steps - before[1]
    assert stats.prefills - before[0] == 2  # admitted separately...
    assert steps < 2 * 149  # ...yet they shared forward passes (one after the other: 2 * 149 steps)
    assert stats.row_steps - before[2] == 2 * 149


def test_pause_drains_running_requests_and_holds_new_ones(client, server):
    results: Dict[str, Any] = {}

    def ask(name: str, max_tokens: int) -> None:
        results[name] = client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=max_tokens, temperature=0
        )

    started = server.stats.generated_tokens
    running = threading.Thread(target=ask, args=("running", 200))
    running.start()
    _wait_for(lambda: server.stats.generated_tokens > started)  # it is generating
    with server.paused():
        # On entry the running request has been generated to its end (drained), not cut short.
        assert server.stats.generated_tokens - started >= 200
        running.join(timeout=30)
        assert results["running"].usage.completion_tokens == 200
        held = threading.Thread(target=ask, args=("held", 4))
        held.start()
        _wait_for(lambda: server.engine.waiting == 1)
        time.sleep(0.2)
        assert "held" not in results and server.engine.waiting == 1
    held.join(timeout=60)
    assert results["held"].usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_stops_its_generation(server, stream):
    """A client that times out (the SDK then retries) or closes its stream frees its place in the batch.

    Starlette does not cancel a handler whose client left: a non-streamed request went on generating to
    ``max_tokens`` for nobody, each retry one more (streams were already stopped by their own loop).
    """
    max_tokens = 1000
    before = server.stats.generated_tokens
    args = {"model": "policy", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
            with client.chat.completions.create(**args, stream=True) as chunks:
                next(iter(chunks))
    else:
        with openai.OpenAI(base_url=server.base_url, api_key="x", timeout=0.5, max_retries=1) as client:
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(**args)
    drained = threading.Event()

    def drain() -> None:
        with server.paused():  # on entry, the running batch has finished
            drained.set()

    threading.Thread(target=drain, daemon=True).start()
    assert drained.wait(10), "the server still generated 10 s after its client went away"
    generated = server.stats.generated_tokens - before
    assert generated < max_tokens  # not even one of the requests was generated to its end


def test_load_weights_swaps_the_policy_and_the_version(greedy, tiny):
    _, tokenizer = tiny
    model, _ = load_policy("tiny", seed=0, device="cpu")
    other, _ = load_policy("tiny", seed=5, device="cpu")
    prompt = template_ids(tokenizer, MESSAGES)
    expected_before, expected_after = greedy(model, prompt, 8), greedy(other, prompt, 8)
    assert expected_before != expected_after
    with (
        PolicyServer(model, tokenizer, version=0) as server,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
    ):

        def answer() -> Tuple[List[int], Any, str]:
            raw = client.chat.completions.with_raw_response.create(
                model="policy", messages=MESSAGES, max_tokens=8, temperature=0
            )
            completion = raw.parse()
            return (
                extra(completion.choices[0], "token_ids"),
                extra(completion, "agl_resources_version"),
                raw.headers["x-agl-resources-version"],
            )

        assert answer() == (expected_before, 0, "0")
        server.load_weights(other.state_dict(), version=7)
        assert answer() == (expected_after, 7, "7")
        server.set_version(8)  # an in-process trainer changed the shared model itself
        assert answer()[1:] == (8, "8")


# --- bad requests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"n": 2}, "n", "only n=1"),
        ({"n": True}, "n", "only n=1"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools to call"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "sub"}}, "tools": [ADD_TOOL]},
            "tool_choice",
            "not one of the tools ['add']",
        ),
        ({"tool_choice": {"type": "allowed_tools"}, "tools": [ADD_TOOL]}, "tool_choice", "is not supported"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        ({"temperature": 3}, "temperature", "from 0 to 2"),
        ({"max_tokens": 10**6}, "max_tokens", "maximum context length is 2048 tokens"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be {'type': 'text'}"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
            "response_format",
            "cannot be enforced: failed to compile JSON schema: Invalid type: frob",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "is not one of"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
            "reads text only",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        (  # was rendered into the prompt as the string it is, and answered with a 200
            {"tools": [ADD_TOOL, {"type": "function", "function": {"name": "sub", "parameters": "{}"}}]},
            "tools[1].function.parameters",
            "must be a JSON schema object, e.g. {'type': 'object', 'properties': {...}}, not \"{}\"",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "sub", "parameters": ["a"]}}], "tool_choice": "none"},
            "tools[0].function.parameters",
            "must be a JSON schema object",
        ),
    ],
)
def test_bad_requests_get_a_400_that_names_the_parameter(server, change, param, words):
    body = {"model": "policy", "messages": MESSAGES, **change}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_bad_request_through_the_openai_client_and_invalid_json(client, server):
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model="policy", messages=MESSAGES, n=3)
    response = httpx.post(
        f"{server.base_url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def history_body(depth: int) -> bytes:
    """A chat body whose earlier tool call has ``depth`` nested arrays as arguments: the body nests 6 + depth
    levels (body, messages, message, tool_calls, call, function). Written by hand: ``json.dumps`` itself
    would run out of recursion in this process."""
    arguments = "[" * depth + "1" + "]" * depth
    call = '{"id": "c", "type": "function", "function": {"name": "f", "arguments": ' + arguments + "}}"
    messages = (
        '[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [' + call + "]}, "
        '{"role": "tool", "tool_call_id": "c", "content": "1"}]'
    )
    return ('{"model": "policy", "max_tokens": 2, "messages": ' + messages + "}").encode()


DEEP_BODY = b'{"model": "policy", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", DEEP_BODY, None),  # too deep to parse
        ("responses", DEEP_BODY, None),
        ("completions", DEEP_BODY, None),
        ("chat/completions", history_body(954), "messages"),  # parsed, then too deep to render
        ("chat/completions", history_body(123), "messages"),  # one level beyond the limit
    ],
)
def test_a_body_nested_too_deeply_gets_a_400(server, path, body, param):
    """Python's JSON parser and the prompt renderer each met such a body as a RecursionError, which the
    server answered with a bare 500."""
    response = httpx.post(f"{server.base_url}/{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith("the request body nests arrays and objects more than 128 levels deep")
    assert (error["param"], error["type"]) == (param, "invalid_request_error")


def test_a_body_nested_128_levels_deep_is_served(server):
    body = history_body(122)
    response = httpx.post(
        f"{server.base_url}/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"


LONG = "word " * 2100  # beyond the tiny model's context of 2048 tokens


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        ("responses", {"input": LONG}, "input"),
        ("completions", {"prompt": LONG}, "prompt"),
        ("chat/completions", {"messages": MESSAGES, "max_tokens": 2040}, "max_tokens"),
        ("chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2040}, "max_completion_tokens"),
        ("responses", {"input": "hi", "max_output_tokens": 2040}, "max_output_tokens"),
    ],
)
def test_a_context_overflow_is_refused_as_openai_refuses_it(server, path, body, param):
    """OpenAI's code and wording, which LangChain, CrewAI and LiteLLM match to shorten a conversation."""
    response = httpx.post(f"{server.base_url}/{path}", json={"model": "policy", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("context_length_exceeded", "invalid_request_error")
    assert error["param"] == param
    assert error["message"].startswith("This model's maximum context length is 2048 tokens, but the prompt is too")
    assert ("ask for at most" if param.startswith("max") else "; shorten it") in error["message"]
    if param.startswith("max"):
        assert f"too long for {param} 2040" in error["message"]  # the name the client used


@pytest.mark.parametrize("prompt, max_tokens", [(LONG, 4), ("hi", 2040)])
def test_langchain_recognizes_a_context_overflow(server, prompt, max_tokens):
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url, api_key="x", model="policy", max_retries=0, max_tokens=max_tokens)
    with pytest.raises(ContextOverflowError, match="maximum context length is 2048 tokens"):
        llm.invoke(prompt)


def test_a_refused_request_is_logged_once_without_its_body(server, caplog):
    secret = f"do-not-log-{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger="agl.serving.server"):
        response = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": secret}], "n": 2},
        )
    assert response.status_code == 400
    (record,) = [r for r in caplog.records if r.name == "agl.serving.server"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "/v1/chat/completions answered 400: " + response.json()["error"]["message"]
    assert secret not in caplog.text


def test_unknown_routes_and_methods_get_openai_errors_that_say_what_is_served(server, client, caplog):
    """FastAPI answered {"detail": "Not Found"}: the openai client said only "Error code: 404" (an agent calling
    embeddings), and nothing was logged."""
    with caplog.at_level(logging.WARNING, logger="agl.serving.server"):
        with pytest.raises(openai.NotFoundError, match="no POST /v1/embeddings") as told:
            client.embeddings.create(model="policy", input="hi")
        wrong_method = httpx.get(f"{server.base_url}/chat/completions")
    assert "POST /v1/chat/completions" in str(told.value) and told.value.code == "unknown_route"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "unknown_method" and "GET /v1/chat/completions" in wrong_method.text
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "agl.serving.server"] == [
        "/v1/embeddings answered 404",
        "/v1/chat/completions answered 405",
    ]


# --- the Responses API ---------------------------------------------------------------------------------------

FLAT_ADD_TOOL = {"type": "function", **ADD_TOOL["function"]}
LOGPROBS = ["message.output_text.logprobs"]


def responses_args(**more: Any) -> Dict[str, Any]:
    """MESSAGES as a Responses request: the system message as instructions, the user's as input."""
    return {"model": "policy", "instructions": MESSAGES[0]["content"], "input": MESSAGES[1]["content"], **more}


def test_responses_answer_is_the_chat_answer_with_the_same_ids(greedy, client, server, tiny):
    model, tokenizer = tiny
    chat = client.chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True
    )
    raw = client.responses.with_raw_response.create(
        **responses_args(max_output_tokens=12, temperature=0, include=LOGPROBS)
    )
    response = raw.parse()
    assert extra(response, "prompt_token_ids") == extra(chat, "prompt_token_ids") == template_ids(tokenizer, MESSAGES)
    ids = extra(response, "response_token_ids")
    assert ids == extra(chat.choices[0], "token_ids") == greedy(model, template_ids(tokenizer, MESSAGES), 12)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (
        response.usage.input_tokens == len(extra(response, "prompt_token_ids")) and response.usage.output_tokens == 12
    )
    (message,) = response.output
    logprobs = [t.logprob for t in message.content[0].logprobs]
    assert logprobs == [t.logprob for t in chat.choices[0].logprobs.content]
    assert extra(response, "agl_resources_version") == 1 and raw.headers["x-agl-resources-version"] == "1"


def test_responses_stream_assembles_to_the_plain_response(client, tiny):
    plain = client.responses.create(**responses_args(max_output_tokens=16, temperature=0))
    with client.responses.stream(**responses_args(max_output_tokens=16, temperature=0)) as stream:
        events = list(stream)
    final = events[-1].response  # cut at max_output_tokens: "response.incomplete", as OpenAI sends it
    assert final.output_text == plain.output_text and final.status == plain.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert extra(final, "response_token_ids") == extra(plain, "response_token_ids")
    assert extra(final, "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"


def test_responses_tool_call_has_the_chat_prompt_and_the_models_ids(tool_client, tool_server):
    tokenizer = tool_server.tokenizer
    response = tool_client.responses.create(
        **responses_args(tools=[FLAT_ADD_TOOL], temperature=0, max_output_tokens=80)
    )
    message, call = response.output
    assert message.type == "message" and response.output_text == "Let me add."
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert response.status == "completed"
    assert extra(response, "prompt_token_ids") == prompt_ids(tokenizer, MESSAGES, [ADD_TOOL])
    ids = extra(response, "response_token_ids")
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == TOOL_ANSWER
    with tool_client.responses.stream(
        **responses_args(tools=[FLAT_ADD_TOOL], temperature=0, max_output_tokens=80)
    ) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [("message", None), ("function_call", "add")]
    assert final.output[1].call_id.startswith("call_") and json.loads(final.output[1].arguments) == {"a": 2, "b": 3}
    assert streamed == "Let me add."  # held back from "<tool_call>" on


def test_responses_input_items_render_the_same_prompt_as_the_chat_conversation(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    chat_messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": MESSAGES[1]["content"]}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    chat = client.chat.completions.create(model="policy", messages=chat_messages, tools=[ADD_TOOL], max_tokens=2)
    response = client.responses.create(**responses_args(input=items, tools=[FLAT_ADD_TOOL], max_output_tokens=2))
    assert extra(response, "prompt_token_ids") == extra(chat, "prompt_token_ids")


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format must be {'type': 'text'}"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
            "text.format",
            "Invalid type",
        ),
        ({"text": "json"}, "text", "must be an object"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tools"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning' is not supported"),
        ({"max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "too long for max_output_tokens 1000000"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "is not one of"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input",
            "reads text only",
        ),
        ({"temperature": 3}, "temperature", "from 0 to 2"),
        ({"frobnicate": 1}, "frobnicate", "unsupported parameter"),
        (
            {"tools": [{"type": "function", "name": "sub", "parameters": "{}"}]},
            "tools[0].parameters",
            "tools[0].parameters must be a JSON schema object",
        ),
    ],
)
def test_bad_responses_requests_get_a_400_that_names_the_parameter(server, change, param, words):
    response = httpx.post(f"{server.base_url}/responses", json=responses_args(**change))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# --- structured output ---------------------------------------------------------------------------------------

VERDICT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
VERDICT_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}


def verdict(text: str) -> Dict[str, Any]:
    """The answer parsed and checked against VERDICT."""
    value = json.loads(text)
    assert set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    return value


def test_a_json_schema_answer_always_parses_and_matches_the_schema(client, server):
    free = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=24, seed=0)
    assert not (free.choices[0].message.content or "").startswith("{")  # the random model writes no JSON itself
    for seed in range(6):
        completion = client.chat.completions.create(
            model="policy", messages=MESSAGES, response_format=VERDICT_FORMAT, max_tokens=40, seed=seed, logprobs=True
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        verdict(choice.message.content)
        ids = extra(choice, "token_ids")
        assert ids[-1] == server.tokenizer.eos_token_id and server.tokenizer.decode(ids[:-1]) == choice.message.content
        # tokens the grammar forces were drawn from a one-token distribution: logprob exactly 0; where the
        # schema leaves a choice (the enum, the boolean) the model made it
        logprobs = [t.logprob for t in choice.logprobs.content]
        assert logprobs.count(0.0) >= len(logprobs) // 2 and any(lp < 0 for lp in logprobs)
    greedy_answer = client.chat.completions.create(
        model="policy", messages=MESSAGES, response_format=VERDICT_FORMAT, max_tokens=40, temperature=0
    )
    verdict(greedy_answer.choices[0].message.content)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_logprob_bytes_of_a_character_split_across_tokens_rebuild_the_text(client, tiny, api):
    """🙂 is two tokens, neither a whole character: each one's ``bytes`` held U+FFFD's (its decoded text),
    so joining them did not rebuild the answer, the field's purpose."""
    _, tokenizer = tiny
    assert len(tokenizer("🙂", add_special_tokens=False)["input_ids"]) == 2
    schema = {"type": "string", "enum": ["🙂"]}
    if api == "chat":
        fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
        choice = chat_policy(client, max_tokens=10, temperature=0, logprobs=True, response_format=fmt).choices[0]
        text, entries = choice.message.content, choice.logprobs.content
    else:
        response = client.responses.create(
            **responses_args(
                max_output_tokens=10,
                temperature=0,
                include=["message.output_text.logprobs"],
                text={"format": {"type": "json_schema", "name": "e", "schema": schema}},
            )
        )
        text, entries = response.output_text, response.output[0].content[0].logprobs
    assert text == '"🙂"'
    joined = bytes(b for entry in entries for b in entry.bytes).decode("utf-8")
    assert joined.startswith(text) and "\ufffd" not in joined


FROB_TOOL = {"type": "function", "function": {"name": "frob", "parameters": {"type": "frob"}}}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"tool_choice": "required"}, "tools[1].function.parameters"),
        ({"tool_choice": {"type": "function", "function": {"name": "frob"}}}, "tools[1].function.parameters"),
        ({"response_format": {"type": "json_object"}}, "tools[1].function.parameters"),
        (
            {
                "tools": [ADD_TOOL],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            },
            "response_format",
        ),
    ],
)
def test_a_tool_whose_parameters_cannot_be_enforced_gets_a_400_naming_it(server, change, param):
    """The tools' and the answer's schemas compile as one grammar, whose 400 named ``response_format`` even
    for a client that sent none."""
    body = {"model": "policy", "messages": MESSAGES, "tools": [ADD_TOOL, FROB_TOOL], **change}
    answer = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["message"] == f"{param} cannot be enforced: failed to compile JSON schema: Invalid type: frob"


def test_a_responses_tool_whose_parameters_cannot_be_enforced_gets_a_400_naming_it(client):
    frob = {"type": "function", **FROB_TOOL["function"]}
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(**responses_args(tools=[FLAT_ADD_TOOL, frob], tool_choice="required"))
    assert raised.value.body["param"] == "tools[1].parameters"
    assert raised.value.body["message"].startswith("tools[1].parameters cannot be enforced")


def test_json_object_mode_answers_with_an_object(client):
    for seed in range(3):
        completion = client.chat.completions.create(
            model="policy", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=48, seed=seed
        )
        content = completion.choices[0].message.content
        assert content.startswith("{")
        if completion.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_is_the_chat_response_format(client, stream):
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}}
    chat = client.chat.completions.create(
        model="policy", messages=MESSAGES, response_format=VERDICT_FORMAT, max_tokens=40, temperature=0
    )
    args = responses_args(text=text, max_output_tokens=40, temperature=0)
    if stream:
        with client.responses.stream(**args) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**args)
    assert response.status == "completed" and verdict(response.output_text)
    assert extra(response, "response_token_ids") == extra(chat.choices[0], "token_ids")


def test_with_tools_the_answer_is_the_json_or_calls_to_offered_tools(client):
    finished = 0
    for seed in range(6):
        completion = client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            tools=[ADD_TOOL],
            response_format=VERDICT_FORMAT,
            max_tokens=48,
            seed=seed,
        )
        choice = completion.choices[0]
        if choice.finish_reason == "length":
            continue  # cut mid-answer (the random model may chain calls)
        finished += 1
        if choice.message.tool_calls:
            for call in choice.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name == "add" and set(arguments) <= {"a", "b"}
                assert all(isinstance(v, int) for v in arguments.values())
        else:
            verdict(choice.message.content)
    assert finished >= 3


VOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "vote",
        "parameters": {
            "type": "object",
            "properties": {"choice": {"enum": ["a", "b"]}},
            "required": ["choice"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "vote"}}])
def test_tool_choice_required_or_named_forces_one_valid_call(client, tool_choice):
    free = client.chat.completions.create(model="policy", messages=MESSAGES, tools=[ADD_TOOL, VOTE_TOOL], seed=0)
    assert not free.choices[0].message.tool_calls  # the random model calls nothing by itself
    names = set()
    for seed in range(4):
        completion = client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            tools=[ADD_TOOL, VOTE_TOOL],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=64,
            seed=seed,
        )
        choice = completion.choices[0]
        if choice.finish_reason == "length":  # the random model may write a long integer for add's a or b
            assert choice.message.content is None and not choice.message.tool_calls  # the cut call is dropped
            continue
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        arguments = json.loads(call.function.arguments)
        if call.function.name == "vote":
            assert arguments in ({"choice": "a"}, {"choice": "b"})
        else:
            assert call.function.name == "add" and all(isinstance(v, int) for v in arguments.values())
        names.add(call.function.name)
    assert names  # some answers finished within max_tokens
    if isinstance(tool_choice, dict):
        assert names == {"vote"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_does_not_cut_a_forced_tool_call(client, stream):
    """A forced call begins ``<tool_call>\n``: a "\n" stop cut it to the bare tag, returned as content."""
    args = {
        "model": "policy",
        "messages": MESSAGES,
        "tools": [VOTE_TOOL],
        "max_tokens": 64,
        "seed": 0,
        "tool_choice": {"type": "function", "function": {"name": "vote"}},
        "stop": ["\n", "}"],
    }
    completion = final_completion(client, stream, **args)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content  # (the stream helper's is "")
    (call,) = choice.message.tool_calls
    assert call.function.name == "vote" and json.loads(call.function.arguments) in ({"choice": "a"}, {"choice": "b"})


def test_streamed_structured_answers_assemble_to_valid_output(client):
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=MESSAGES, response_format=VERDICT_FORMAT, max_tokens=40, seed=1, stream=True
        )
    )
    verdict("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    chunks = list(
        client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            tools=[ADD_TOOL, VOTE_TOOL],
            parallel_tool_calls=False,
            max_tokens=40,
            tool_choice={"type": "function", "function": {"name": "vote"}},
            seed=1,
            stream=True,
        )
    )
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(call.function.name, json.loads(call.function.arguments)["choice"] in "ab") for call in calls] == [
        ("vote", True)
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_responses_named_tool_choice_gives_a_function_call_to_it(client):
    flat_vote = {"type": "function", **VOTE_TOOL["function"]}
    response = client.responses.create(
        **responses_args(
            tools=[FLAT_ADD_TOOL, flat_vote],
            tool_choice={"type": "function", "name": "vote"},
            parallel_tool_calls=False,
            max_output_tokens=64,
        )
    )
    (item,) = response.output
    assert item.type == "function_call" and item.name == "vote"
    assert json.loads(item.arguments) in ({"choice": "a"}, {"choice": "b"})


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_is_served_and_recorded_with_token_ids(instrumented, server, method):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        sure: bool

    llm = ChatOpenAI(base_url=server.base_url, api_key="x", model="policy", max_retries=0, max_tokens=40)
    # strict: the tool's schema gets additionalProperties false, as json_schema's has; without it the schema
    # lets the random model add keys until max_tokens, and LangChain then has no object to parse.
    structured = llm.with_structured_output(Verdict, method=method, strict=True)
    rollout_id = f"ro-{uuid.uuid4().hex[:8]}"
    with tracer_writes_to(ListSink()) as sink, agl.rollout_scope(rollout_id, "at-1"):
        result = structured.invoke([{"role": "user", "content": "Is 2 + 3 = 5?"}])
        (span,) = sink.of(rollout_id, "llm")
    assert isinstance(result, Verdict)
    ids = span.attributes[semconv.RESPONSE_TOKEN_IDS]
    answer = server.tokenizer.decode(ids[:-1])
    if method == "function_calling":  # one forced call to the "Verdict" tool, whose arguments are the object
        call = json.loads(answer.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] == "Verdict"
        answer = json.dumps(call["arguments"])
    assert Verdict.model_validate_json(answer) == result


# --- a generation that fails ------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_generation_that_fails_reaches_the_client_as_an_error_and_the_server_goes_on(api):
    """The model raises at its second forward pass (the first decode step, after the prefill): a plain
    request gets a 500, a stream an error event the ``openai`` client raises; the next request is served."""
    model, tokenizer = load_policy("tiny", device="cpu")
    forward, passes = model.forward, {"n": 0, "fail": True}

    @functools.wraps(forward)  # the engine reads forward's signature
    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        passes["n"] += 1
        if passes["fail"] and passes["n"] == 2:
            raise RuntimeError("the accelerator fell over")
        return forward(*args, **kwargs)

    model.forward = failing_forward
    with (
        PolicyServer(model, tokenizer, model_name="policy") as server,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
    ):

        def ask(stream: bool) -> Any:
            passes["n"] = 0
            if api == "chat":
                result = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4, stream=stream)
            else:
                result = client.responses.create(**responses_args(max_output_tokens=4, stream=stream))
            return list(result) if stream else result

        with pytest.raises(openai.InternalServerError, match="generation failed: the accelerator fell over"):
            ask(stream=False)
        with pytest.raises(openai.APIError, match="generation failed: the accelerator fell over") as raised:
            ask(stream=True)
        assert not isinstance(raised.value, openai.APIStatusError)  # the stream had begun (200): an error event
        passes["fail"] = False
        assert ask(stream=False) and ask(stream=True)


# --- agl's instrumented client -----------------------------------------------------------------------------


@pytest.fixture
def instrumented() -> Iterator[OpenAIInstrumentor]:
    agl.instrumentation.uninstrument()  # a test elsewhere may have left agl.instrument() on
    instrumentor = OpenAIInstrumentor()
    assert instrumentor.instrument()
    yield instrumentor
    instrumentor.uninstrument()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_instrumented_client_records_token_ids_and_version_in_the_llm_span(instrumented, server, stream, api):
    rollout_id = f"ro-{uuid.uuid4().hex[:8]}"
    with (
        tracer_writes_to(ListSink()) as sink,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
        _version(server, 12),
    ):
        with agl.rollout_scope(rollout_id, "at-1"):
            if api == "chat":
                result = client.chat.completions.create(
                    model="policy", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, stream=stream
                )
                chunks = list(result) if stream else [result]
                prompt = extra(chunks[0], "prompt_token_ids")
                response = [i for c in chunks if c.choices for i in extra(c.choices[0], "token_ids")]
            else:
                args = responses_args(max_output_tokens=6, temperature=0, include=LOGPROBS, stream=stream)
                result = client.responses.create(**args)
                final = [e.response for e in result if e.type == "response.incomplete"][0] if stream else result
                prompt, response = extra(final, "prompt_token_ids"), extra(final, "response_token_ids")
        (span,) = sink.of(rollout_id, "llm")
    a = span.attributes
    assert a[semconv.PROMPT_TOKEN_IDS] == prompt == template_ids(server.tokenizer, MESSAGES)
    assert a[semconv.RESPONSE_TOKEN_IDS] == response and len(response) == 6
    assert len(a[semconv.RESPONSE_LOGPROBS]) == 6
    assert a[semconv.TOKEN_IDS_SOURCE] == "server"
    assert a[semconv.RESOURCES_VERSION] == 12


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_answer_of_calls_only_carries_its_logprobs_to_the_span(instrumented, server, stream):
    """The Responses format has logprobs only on a message's ``output_text``: an answer of calls only, asked
    for logprobs, has an empty message ahead of its calls that carries them. Without it the span had none
    and the trainer lost the server's logprobs of every tool-call turn (grammar-forced tokens' included)."""
    flat_vote = {"type": "function", **VOTE_TOOL["function"]}
    args = responses_args(
        tools=[flat_vote],
        tool_choice={"type": "function", "name": "vote"},
        temperature=0,
        parallel_tool_calls=False,
        max_output_tokens=64,
        include=LOGPROBS,
    )
    rollout_id = f"ro-{uuid.uuid4().hex[:8]}"
    with (
        tracer_writes_to(ListSink()) as sink,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
    ):
        with agl.rollout_scope(rollout_id, "at-1"):
            if stream:
                events = list(client.responses.create(**args, stream=True))
                (response,) = [e.response for e in events if e.type == "response.completed"]
            else:
                response = client.responses.create(**args)
        (span,) = sink.of(rollout_id, "llm")
        message, call = response.output
        assert message.type == "message" and response.output_text == ""
        assert call.type == "function_call" and call.name == "vote"
        ids = extra(response, "response_token_ids")
        logprobs = [t.logprob for t in message.content[0].logprobs]
        assert len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)
        assert span.attributes[semconv.RESPONSE_TOKEN_IDS] == ids
        assert span.attributes[semconv.RESPONSE_LOGPROBS] == logprobs
        # Sent back, the empty message and the call are the one assistant turn the chat API would send.
        follow_up = client.responses.create(
            **{
                **args,
                "max_output_tokens": 1,
                "input": [
                    {"role": "user", "content": MESSAGES[1]["content"]},
                    message.model_dump(),
                    call.model_dump(),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
                ],
            }
        )
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": "vote", "arguments": call.arguments}}
    chat_messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "ok"},
    ]
    assert extra(follow_up, "prompt_token_ids") == prompt_ids(server.tokenizer, chat_messages, [VOTE_TOOL])


def test_a_responses_stream_the_agent_stops_reading_keeps_the_ids_of_what_it_read(instrumented, server):
    """agl's server sent a Responses stream's ids with its final event only: a stream the agent broke out of
    had none, and LightningRL could only skip the call. Each text delta now carries its tokens' ids."""
    args = responses_args(temperature=0, max_output_tokens=48, include=LOGPROBS)
    rollout_id = f"ro-{uuid.uuid4().hex[:8]}"
    with (
        tracer_writes_to(ListSink()) as sink,
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client,
    ):
        complete = client.responses.create(**args)
        with agl.rollout_scope(rollout_id, "at-1"):
            stream = client.responses.create(**args, stream=True)
            read = ""
            for event in stream:
                if event.type == "response.output_text.delta":
                    read += event.delta
                    if len(read) >= 8:
                        break
            stream.close()
    (span,) = sink.of(rollout_id, "llm")
    attrs = span.attributes
    assert attrs[semconv.STREAM_ABANDONED] is True
    assert attrs[semconv.PROMPT_TOKEN_IDS] == extra(complete, "prompt_token_ids")
    ids = attrs[semconv.RESPONSE_TOKEN_IDS]
    assert 0 < len(ids) < len(extra(complete, "response_token_ids"))
    assert ids == extra(complete, "response_token_ids")[: len(ids)]  # greedy: the same answer, cut where read
    assert server.tokenizer.decode(ids) == read
    assert len(attrs[semconv.RESPONSE_LOGPROBS]) == len(ids)


@contextlib.contextmanager
def _version(server: PolicyServer, version: int) -> Iterator[None]:
    previous = server.version
    server.set_version(version)
    try:
        yield
    finally:
        server.set_version(previous)


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_request_defaults_fill_what_a_request_leaves_out(client, server):
    """A trainer publishes its sampling settings in the LLM resource, but an agent that does not pass
    llm.sampling_parameters on (the README's does not) was sampled at the server's own defaults: 512 tokens,
    temperature 1, no logprobs, whatever the trainer computed its loss with. The server now fills in the
    trainer's settings for what a request leaves out; what it sets itself is kept."""
    messages = [{"role": "user", "content": "hello"}]
    server.request_defaults = {"max_tokens": 3, "logprobs": True, "temperature": 0.0}
    try:
        plain = client.chat.completions.create(model="policy", messages=messages)
        assert plain.usage.completion_tokens <= 3 and plain.choices[0].logprobs is not None
        again = client.chat.completions.create(model="policy", messages=messages)
        assert again.choices[0].message.content == plain.choices[0].message.content  # temperature 0: greedy
        own = client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=5, logprobs=False)
        assert own.usage.completion_tokens == 5 and own.choices[0].logprobs is None
        response = client.responses.create(model="policy", input="hello")
        assert response.usage.output_tokens <= 3
        completion = client.completions.create(model="policy", prompt="hello")
        assert completion.usage.completion_tokens <= 3 and completion.choices[0].logprobs is None
    finally:
        server.request_defaults = {}
    assert client.chat.completions.create(model="policy", messages=messages, max_tokens=4).usage.completion_tokens <= 4


def test_a_default_max_tokens_is_capped_by_the_context_like_the_servers_own(client, server, tiny):
    """TorchGRPO sets its ``max_tokens`` in ``request_defaults``: it acted as if the agent had sent it, so a
    conversation that fits the context but not prompt + that default got a 400 naming ``max_tokens``."""
    _, tokenizer = tiny
    context = server.engine.max_context

    def asking(n: int) -> List[Dict[str, Any]]:
        return [{"role": "user", "content": "hi " * n}]

    size = next(n for n in range(context // 2, context) if len(prompt_ids(tokenizer, asking(n))) > context - 20)
    messages = asking(size)
    room = context - len(prompt_ids(tokenizer, messages))
    server.request_defaults = {"max_tokens": 512, "temperature": 0.0}
    try:
        chat = client.chat.completions.create(model="policy", messages=messages)
        assert chat.usage.completion_tokens <= room and chat.usage.prompt_tokens + room == context
        completion = client.completions.create(model="policy", prompt=[1] * (context - 5))
        assert completion.usage.completion_tokens <= 5
        with pytest.raises(openai.BadRequestError, match="ask for at most"):  # what the client asks is kept
            client.chat.completions.create(model="policy", messages=messages, max_tokens=512)
    finally:
        server.request_defaults = {}
